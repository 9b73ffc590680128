// The cases of every weight format (server/model/src/cuda/emulation/formats.rs
// writes them): the block sizes, the embedding lookups, quantize_q8_k, and
// the weight products in both kernel layouts. Included by harness.cpp.

// Formats by their index in DevFormat::ALL.
enum { F_Q8_0, F_Q4_1, F_Q5_0, F_Q5_1, F_Q4_K, F_Q5_K, F_Q6_K, F_F16, F_BF16, N_FORMATS };
static const char* format_name(int f) {
    static const char* names[N_FORMATS] = {"q8_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16"};
    return names[f];
}

static void size_cases(const std::string& dir) {
    Reader r(dir + "/sizes.bin");
    auto host = r.get<int>(N_FORMATS + 1);
    const int dev[N_FORMATS + 1] = {sizeof(bq8_0), sizeof(bq4_1), sizeof(bq5_0), sizeof(bq5_1), sizeof(bq4_K),
                                    sizeof(bq5_K), sizeof(bq6_K), sizeof(bh_f16), sizeof(bh_bf16), sizeof(bq8_K)};
    check("block sizes (host upload = CUDA structs)", host.data(), dev, sizeof(dev));
}

static void embed_cases(const std::string& dir) {
    Reader r(dir + "/embed.bin");
    const int n = r.one<int>();
    for (int c = 0; c < n; ++c) {
        const int f = r.one<int>(), cols = r.one<int>(), nt = r.one<int>(), wlen = r.one<int>();
        auto tok = r.get<unsigned int>(nt);
        auto w = r.get<unsigned char>(wlen);
        auto want = r.get<float>(nt * cols);
        std::vector<float> out(nt * cols, -7.0f);
        const void* wp = w.data();
        emu_launch(nt, 1, 256, [&] {
            switch (f) {
            case F_Q8_0: embed_q8_0((const bq8_0*)wp, tok.data(), cols, out.data()); break;
            case F_Q4_1: embed_q4_1((const bq4_1*)wp, tok.data(), cols, out.data()); break;
            case F_Q5_0: embed_q5_0((const bq5_0*)wp, tok.data(), cols, out.data()); break;
            case F_Q5_1: embed_q5_1((const bq5_1*)wp, tok.data(), cols, out.data()); break;
            case F_Q4_K: embed_q4_k((const bq4_K*)wp, tok.data(), cols, out.data()); break;
            case F_Q5_K: embed_q5_k((const bq5_K*)wp, tok.data(), cols, out.data()); break;
            case F_Q6_K: embed_q6_k((const bq6_K*)wp, tok.data(), cols, out.data()); break;
            case F_F16: embed_f16((const bh_f16*)wp, tok.data(), cols, out.data()); break;
            case F_BF16: embed_bf16((const bh_bf16*)wp, tok.data(), cols, out.data()); break;
            }
        });
        check(std::string("embed_") + format_name(f), out.data(), want.data(), out.size() * 4);
    }
}

static void q8k_case(const std::string& dir) {
    Reader r(dir + "/q8k.bin");
    const int n = r.one<int>();
    auto x = r.get<float>(n * QK_K);
    auto want = r.get<bq8_K>(n);
    std::vector<bq8_K> out(n);
    memset(out.data(), 0xAB, out.size() * sizeof(bq8_K)); // every byte must be written
    emu_launch((n * 32 + 255) / 256, 1, 256, [&] { quantize_q8_k(x.data(), out.data(), n); });
    check("quantize_q8_k", out.data(), want.data(), out.size() * sizeof(bq8_K));
}

// One product launch of format f in the warp (mmw_*) or lanes (mm_*) layout.
static void run_mm(int f, bool lanes, const void* w, const void* x, float* out, int rows, int nb, int nt, int tiled,
                   int lw, int gemm, int pairs) {
    const int grid = lanes ? (rows + 15) / 16 : (rows + MMW_WARPS - 1) / MMW_WARPS;
    const int threads = lanes ? 128 : MMW_WARPS * 32;
    const bq8_1* x1 = (const bq8_1*)x;
    const bq8_K* xk = (const bq8_K*)x;
    const float* xf = (const float*)x;
#define Q32_CASE(F, fmt)                                                                                             \
    case F:                                                                                                          \
        if (lanes) mm_q##fmt((const bq##fmt*)w, x1, out, rows, nb, nt, rows, 0);                                     \
        else mmw_q##fmt((const bq##fmt*)w, x1, out, rows, nb, nt, rows, 0);                                          \
        break;
#define K_CASE(F, k)                                                                                                 \
    case F:                                                                                                          \
        if (lanes) mm_q##k##_k((const bq##k##_K*)w, xk, out, rows, nb, nt, rows, 0, tiled);                          \
        else mmw_q##k##_k((const bq##k##_K*)w, xk, out, rows, nb, nt, rows, 0, tiled);                               \
        break;
#define HALF_CASE(F, fmt)                                                                                            \
    case F:                                                                                                          \
        if (lanes) mm_##fmt((const bh_##fmt*)w, xf, out, rows, nb, nt, rows, 0, lw, gemm, pairs);                    \
        else mmw_##fmt((const bh_##fmt*)w, xf, out, rows, nb, nt, rows, 0, lw, gemm, pairs);                         \
        break;
    emu_launch(grid, 1, threads, [&] {
        switch (f) {
            Q32_CASE(F_Q8_0, 8_0)
            Q32_CASE(F_Q4_1, 4_1)
            Q32_CASE(F_Q5_0, 5_0)
            Q32_CASE(F_Q5_1, 5_1)
            K_CASE(F_Q4_K, 4)
            K_CASE(F_Q5_K, 5)
            K_CASE(F_Q6_K, 6)
            HALF_CASE(F_F16, f16)
            HALF_CASE(F_BF16, bf16)
        }
    });
#undef Q32_CASE
#undef K_CASE
#undef HALF_CASE
}

static void mm_format_cases(const std::string& dir) {
    Reader r(dir + "/mm.bin");
    const int n = r.one<int>();
    for (int c = 0; c < n; ++c) {
        auto label = r.get<char>(r.one<int>());
        const int f = r.one<int>(), rows = r.one<int>(), cols = r.one<int>(), nt = r.one<int>();
        const int tiled = r.one<int>(), gemm = r.one<int>(), pairs = r.one<int>(), lw = r.one<int>();
        const int wlen = r.one<int>(), xlen = r.one<int>();
        auto w = r.get<unsigned char>(wlen);
        auto x = r.get<unsigned char>(xlen);
        auto want = r.get<float>(nt * rows);
        const int nb = (f == F_Q4_K || f == F_Q5_K || f == F_Q6_K) ? cols / QK_K : cols / 32;
        const std::string name(label.begin(), label.end());
        for (bool lanes : {false, true}) {
            std::vector<float> out(nt * rows, -7.0f);
            run_mm(f, lanes, w.data(), x.data(), out.data(), rows, nb, nt, tiled, lw, gemm, pairs);
            check(std::string(lanes ? "mm  " : "mmw ") + name, out.data(), want.data(), out.size() * 4);
        }
    }
}

// `shared`: the flavour-independent cases too (else mm.bin holds only the
// products the flavour changes).
static void format_cases(const std::string& dir, bool shared) {
    if (shared) {
        size_cases(dir);
        embed_cases(dir);
        q8k_case(dir);
    }
    mm_format_cases(dir);
}
