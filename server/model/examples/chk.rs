use samplerd_model::gguf::GgufFile;
fn mv(g: &mut GgufFile, name: &str, x: &[f32]) -> Vec<f32> {
    let w = g.f32_values(name).unwrap();
    let cols = x.len();
    w.chunks_exact(cols).map(|r| r.iter().zip(x).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() as f32).collect()
}
fn norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let s: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
    let sc = 1.0 / ((s as f32) + 1e-5).sqrt();
    x.iter().zip(w).map(|(a, b)| a * sc * b).collect()
}
fn main() {
    let mut g = GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf".as_ref()).unwrap();
    let emb = g.f32_values("token_embd.weight").unwrap();
    let tok = 1usize;
    let mut x: Vec<f32> = emb[tok * 576..(tok + 1) * 576].to_vec();
    for l in 0..30 {
        let n = |s: &str| format!("blk.{l}.{s}");
        let h = norm(&x, &g.f32_values(&n("attn_norm.weight")).unwrap());
        let v = mv(&mut g, &n("attn_v.weight"), &h);
        let mut a = vec![0f32; 576];
        for hh in 0..9 { let kv = hh / 3; a[hh * 64..(hh + 1) * 64].copy_from_slice(&v[kv * 64..(kv + 1) * 64]); }
        let o = mv(&mut g, &n("attn_output.weight"), &a);
        for i in 0..576 { x[i] += o[i]; }
        let h = norm(&x, &g.f32_values(&n("ffn_norm.weight")).unwrap());
        let gt = mv(&mut g, &n("ffn_gate.weight"), &h);
        let up = mv(&mut g, &n("ffn_up.weight"), &h);
        let act: Vec<f32> = gt.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let d = mv(&mut g, &n("ffn_down.weight"), &act);
        for i in 0..576 { x[i] += d[i]; }
    }
    let h = norm(&x, &g.f32_values("output_norm.weight").unwrap());
    let lg: Vec<f32> = emb.chunks_exact(576).map(|r| r.iter().zip(&h).map(|(a, b)| a * b).sum()).collect();
    println!("{:?}", &lg[..3]);
}
