// Runs the kernels (kernels_all.cu: the kernel source, every kernels/*.cu)
// on the CPU (prelude.h) over the cases that server/model/src/cuda/
// emulation/mod.rs and formats.rs wrote with the CPU backend's results,
// and compares bit for bit. Usage: harness DIR LANES SHARED (LANES 8 or 16:
// the CPU flavour's vector width; SHARED 1: also the flavour-independent
// cases, which the run of the other flavour leaves out). Prints one line
// per case; exit status 1 when any differs.
#include "prelude.h"
#include "kernels_all.cu"

#include <cstdio>
#include <string>

struct Reader {
    FILE* f;
    explicit Reader(const std::string& path) : f(fopen(path.c_str(), "rb")) {
        if (!f) { perror(path.c_str()); exit(2); }
    }
    ~Reader() { fclose(f); }
    template <class T> std::vector<T> get(size_t n) {
        std::vector<T> v(n);
        if (fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short read\n"); exit(2); }
        return v;
    }
    template <class T> T one() { return get<T>(1)[0]; }
};

static int failures = 0;
static void check(const std::string& what, const void* got, const void* want, size_t bytes) {
    if (memcmp(got, want, bytes) != 0) {
        const unsigned char* a = (const unsigned char*)got;
        const unsigned char* b = (const unsigned char*)want;
        size_t i = 0;
        while (a[i] == b[i]) ++i;
        printf("FAIL %s: first differing byte %zu of %zu\n", what.c_str(), i, bytes);
        ++failures;
    } else {
        printf("ok   %s\n", what.c_str());
    }
}

static void attention_cases(const std::string& dir, int w) {
    Reader r(dir + "/attention.bin");
    const int n = r.one<int>();
    for (int c = 0; c < n; ++c) {
        const int decode = r.one<int>(), n_pos = r.one<int>(), nh = r.one<int>(), hd = r.one<int>();
        auto qkv = r.get<float>((nh + 2) * hd);
        auto k = r.get<unsigned short>(n_pos * hd), v = r.get<unsigned short>(n_pos * hd);
        auto want = r.get<float>(nh * hd);
        auto want_q = r.get<bq8_1>(nh * hd / 32);
        const int pos = n_pos - 1;
        const float scale = 1.0f / sqrtf((float)hd);
        const std::string name = "attention decode=" + std::to_string(decode) + " n_pos=" + std::to_string(n_pos);
        std::vector<float> out(nh * hd, -7.0f);
        std::vector<bq8_1> outq(nh * hd / 32);
        emu_launch(1, nh, ATT_THREADS, [&] {
            attention(qkv.data(), k.data(), v.data(), nullptr, out.data(), outq.data(), &pos, 0, n_pos, nh, 1, hd,
                      scale, w, decode);
        });
        check(name, out.data(), want.data(), out.size() * 4);
        check(name + " quantised", outq.data(), want_q.data(), outq.size() * sizeof(bq8_1));
        if (decode) {
            std::vector<float> scores(nh * n_pos, -9.0f), out2(nh * hd, -7.0f);
            // Two blocks at most: the grid-stride loop is exercised too.
            emu_launch(std::min((n_pos + SCORE_THREADS - 1) / SCORE_THREADS, 2), nh, SCORE_THREADS, [&] {
                attn_scores(qkv.data(), k.data(), scores.data(), &pos, 0, n_pos, nh, 1, hd, scale, w);
            });
            emu_launch(1, nh, ATT_THREADS, [&] {
                attention(qkv.data(), k.data(), v.data(), scores.data(), out2.data(), nullptr, &pos, 0, n_pos, nh, 1,
                          hd, scale, w, decode);
            });
            check(name + " (attn_scores)", out2.data(), want.data(), out2.size() * 4);
        }
    }
}

static void norm_case(const std::string& dir) {
    Reader r(dir + "/norm.bin");
    const int rows = r.one<int>(), d = r.one<int>();
    const float eps = r.one<float>();
    auto x = r.get<float>(rows * d), add = r.get<float>(rows * d), wt = r.get<float>(d);
    auto want_x = r.get<float>(rows * d), want_f = r.get<float>(rows * d);
    auto want_q = r.get<bq8_1>(rows * d / 32);
    std::vector<bq8_1> q(rows * d / 32);
    std::vector<float> f(rows * d, -7.0f);
    emu_launch(rows, 1, NORM_THREADS,
               [&] { add_norm_quant(x.data(), add.data(), wt.data(), q.data(), f.data(), d, eps); });
    check("add_norm_quant residual", x.data(), want_x.data(), x.size() * 4);
    check("add_norm_quant", q.data(), want_q.data(), q.size() * sizeof(bq8_1));
    check("add_norm_quant f32", f.data(), want_f.data(), f.size() * 4);
    // Without the residual add (x already holds the sum) and without the
    // Q8_1 output: the f32 values alone.
    std::fill(f.begin(), f.end(), -7.0f);
    emu_launch(rows, 1, NORM_THREADS, [&] { add_norm_quant(x.data(), nullptr, wt.data(), nullptr, f.data(), d, eps); });
    check("add_norm_quant f32 only", f.data(), want_f.data(), f.size() * 4);
}

static void swiglu_case(const std::string& dir, int w) {
    Reader r(dir + "/swiglu.bin");
    const int n = r.one<int>(), n_ff = r.one<int>();
    auto gu = r.get<float>(n * 2 * n_ff);
    auto want_f = r.get<float>(n * n_ff);
    auto want = r.get<bq8_1>(n * n_ff / 32);
    std::vector<bq8_1> q(n * n_ff / 32);
    std::vector<float> f(n * n_ff, -7.0f);
    emu_launch((n * n_ff / 32 + 7) / 8, 1, 256, [&] { swiglu_quant(gu.data(), q.data(), f.data(), n, n_ff, w); });
    check("swiglu_quant", q.data(), want.data(), q.size() * sizeof(bq8_1));
    check("swiglu_quant f32", f.data(), want_f.data(), f.size() * 4);
    std::fill(f.begin(), f.end(), -7.0f);
    emu_launch((n * n_ff / 32 + 7) / 8, 1, 256, [&] { swiglu_quant(gu.data(), nullptr, f.data(), n, n_ff, w); });
    check("swiglu_quant f32 only", f.data(), want_f.data(), f.size() * 4);
}

static void rope_case(const std::string& dir, const char* file) {
    Reader r(dir + "/" + file);
    const int nh = r.one<int>(), nkv = r.one<int>(), hd = r.one<int>(), pairs = r.one<int>(), neox = r.one<int>(),
              pos = r.one<int>(), cap = r.one<int>();
    const int rows = (nh + 2 * nkv) * hd;
    auto qkv = r.get<float>(rows);
    auto table = r.get<float>((pos + 1) * pairs * 2);
    auto want_q = r.get<float>(nh * hd);
    auto want_k = r.get<unsigned short>(nkv * hd), want_v = r.get<unsigned short>(nkv * hd);
    std::vector<unsigned short> kc(nkv * cap * hd), vc(nkv * cap * hd);
    emu_launch(1, nh + nkv, 64, [&] {
        qkv_rope_store(qkv.data(), nullptr, table.data(), &pos, nh, nkv, hd, pairs, neox, kc.data(), vc.data(), 0, cap);
    });
    const std::string name = std::string("qkv_rope_store neox=") + std::to_string(neox);
    check(name + " q", qkv.data(), want_q.data(), nh * hd * 4);
    for (int g = 0; g < nkv; ++g) {
        check(name + " k", &kc[((size_t)g * cap + pos) * hd], &want_k[g * hd], hd * 2);
        check(name + " v", &vc[((size_t)g * cap + pos) * hd], &want_v[g * hd], hd * 2);
    }
}

#include "formats.cpp"

// top_k against a stable sort (logit descending, ties by lower id).
static void top_k_cases() {
    uint64_t seed = 7;
    auto next = [&] { seed = seed * 6364136223846793005ull + 1442695040888963407ull; return (float)((seed >> 33) % 20000) / 1000.0f - 10.0f; };
    const int shapes[][3] = {{49152, 40, 0}, {49152, 40, 1}, {3000, 1, 2}, {5000, 1000, 1}};
    for (auto& s : shapes) {
        const int n = s[0], k = s[1], variant = s[2];
        std::vector<float> x(n);
        for (auto& v : x) v = next();
        if (variant == 1) for (auto& v : x) v = std::round(v * 2.0f) / 2.0f; // many ties at the cut
        if (variant == 2) { for (int i = 0; i < n; i += 3) x[i] = -INFINITY; x[5] = -0.0f; x[6] = 0.0f; }
        const int status = 0;
        std::vector<unsigned int> out(2 + 2 * TOPK_MAX, 0xdeadbeef);
        emu_launch(1, 1, TOPK_THREADS, [&] { top_k(x.data(), n, k, &status, out.data()); });
        std::vector<int> idx(n);
        for (int i = 0; i < n; ++i) idx[i] = i;
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return x[a] > x[b]; });
        std::vector<unsigned int> want(2 + 2 * TOPK_MAX, 0xdeadbeef);
        want[0] = 0;
        want[1] = k;
        for (int i = 0; i < k; ++i) {
            want[2 + 2 * i] = idx[i];
            want[3 + 2 * i] = __float_as_uint(x[idx[i]]);
        }
        check("top_k n=" + std::to_string(n) + " k=" + std::to_string(k) + " variant=" + std::to_string(variant),
              out.data(), want.data(), (2 + 2 * k) * 4);
    }
}

int main(int argc, char** argv) {
    if (argc != 4) { fprintf(stderr, "usage: harness DIR LANES SHARED\n"); return 2; }
    const std::string dir = argv[1];
    const int w = atoi(argv[2]);
    // SHARED = 1: also the cases that do not depend on the flavour.
    const bool shared = atoi(argv[3]) != 0;
    attention_cases(dir, w);
    swiglu_case(dir, w);
    format_cases(dir, shared);
    if (shared) {
        norm_case(dir);
        rope_case(dir, "rope.bin");
        rope_case(dir, "rope_neox.bin");
        top_k_cases();
    }
    printf("%d failures\n", failures);
    return failures != 0;
}
