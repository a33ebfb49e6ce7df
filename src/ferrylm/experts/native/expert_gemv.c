/* Fused CPU expert kernel for small token counts (decode): a layer's CPU share of experts in one OpenMP region.
 *
 * For each expert e with tokens m in [start_e, start_e + count_e):
 *     [g; u] = [gate; up]_e @ x_m            (gate|up is one [2I, H] row-major block of the expert row)
 *     a      = silu(g) * u                   (Jiang et al. 2024, "Mixtral of Experts", eq. 3; SwiGLU)
 *     out_m  = w_m * (down_e @ a)            (down is [H, I] row-major, right after gate|up)
 * Weights are bfloat16 (widened to float32 exactly: a 16-bit shift) or float32; activations, accumulation and
 * outputs are float32. Each weight row is read once and dotted with up to 4 tokens at a time, so the kernel
 * streams the expert bytes from DRAM once per 4 tokens: it is a GEMV, bound by host memory bandwidth.
 *
 * Parallelism: one `omp parallel` per call; the gate|up rows of all experts are split over the threads, then
 * (after a barrier) the activation, then the down rows. One team wake-up per layer instead of two GEMMs and
 * several elementwise ops per expert, each its own parallel region.
 *
 * Built by ferrylm/experts/cpu_kernel.py with the host compiler (-O3 -march=native -fopenmp) and called
 * through ctypes (which releases the GIL for the call).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define TB 4   /* tokens per pass over a weight row */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One vector abstraction per instruction set: VW lanes of float32, the weight loads widen bf16 exactly. */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vload_bf16(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline vf vload_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#else
#define VW 0  /* scalar only */
#endif

/* res[t] = w[0:n] . x[t * ldx : t * ldx + n] for t < nt (nt <= TB): the vector loop over whole VW-lane blocks,
 * then the scalar tail. WT: the weight element type, WCVT: its exact widening, VLOADW: its vector load. */
#if VW
#define DEF_DOT(NAME, WT, WCVT, VLOADW)                                                                      \
static void NAME(const WT *w, const float *x, int64_t ldx, int nt, int64_t n, float *res) {                  \
    vf acc[TB];                                                                                               \
    for (int t = 0; t < TB; t++) acc[t] = vzero();                                                            \
    int64_t j = 0;                                                                                            \
    for (; j + VW <= n; j += VW) {                                                                            \
        vf wv = VLOADW(w + j);                                                                                \
        for (int t = 0; t < nt; t++) acc[t] = vfma(wv, vload(x + t * ldx + j), acc[t]);                       \
    }                                                                                                         \
    for (int t = 0; t < nt; t++) {                                                                            \
        float s = vsum(acc[t]);                                                                               \
        for (int64_t q = j; q < n; q++) s += WCVT(w[q]) * x[t * ldx + q];                                     \
        res[t] = s;                                                                                           \
    }                                                                                                         \
}
#else
#define DEF_DOT(NAME, WT, WCVT, VLOADW)                                                                      \
static void NAME(const WT *w, const float *x, int64_t ldx, int nt, int64_t n, float *res) {                  \
    for (int t = 0; t < nt; t++) {                                                                            \
        float s = 0.0f;                                                                                       \
        for (int64_t q = 0; q < n; q++) s += WCVT(w[q]) * x[t * ldx + q];                                     \
        res[t] = s;                                                                                           \
    }                                                                                                         \
}
#endif

#define F32_ID(v) (v)
DEF_DOT(dot_bf16, uint16_t, bf16_to_f32, vload_bf16)
DEF_DOT(dot_f32, float, F32_ID, vload)

/* rows [r0, r1) of matrix `mat` ([R, n] row-major, element size by wdtype) dotted with `nx` token vectors
 * (x, stride ldx); result for row r, token t goes to y[t * ldy + r] (times scale[t] when scale != NULL). */
static void rows_dot(int wdtype, const void *mat, int64_t r0, int64_t r1, int64_t n, const float *x, int64_t ldx,
                     int64_t nx, float *y, int64_t ldy, const float *scale) {
    float res[TB];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t t0 = 0; t0 < nx; t0 += TB) {
            int nt = (int)(nx - t0 < TB ? nx - t0 : TB);
            if (wdtype == 0)
                dot_bf16((const uint16_t *)mat + r * n, x + t0 * ldx, ldx, nt, n, res);
            else
                dot_f32((const float *)mat + r * n, x + t0 * ldx, ldx, nt, n, res);
            for (int t = 0; t < nt; t++)
                y[(t0 + t) * ldy + r] = scale ? res[t] * scale[t0 + t] : res[t];
        }
    }
}

/* Returns 0 on success, -1 on bad arguments.
 *   wdtype: 0 = bfloat16 weights, 1 = float32 weights
 *   nthreads: OpenMP threads for this call (>= 1)
 *   k: number of experts; rows[e]: expert e's row (gate|up [2I, H] then down [H, I]); starts/counts: its tokens
 *   x [M, H], w [M], scratch [M, 2I], out [M, H]: float32, contiguous; M = sum(counts)
 * The row blocks are sized so that each task reads ~BLOCK_ROWS rows (one of k experts' blocks).       */
#define BLOCK_ROWS 32
int ferry_expert_gemv(int wdtype, int nthreads, int k, const void *const *rows, const int64_t *starts,
                      const int64_t *counts, int64_t H, int64_t I, const float *x, const float *w, float *scratch,
                      float *out) {
    if (k <= 0 || H <= 0 || I <= 0 || nthreads < 1 || (wdtype != 0 && wdtype != 1)) return -1;
    const int64_t esize = wdtype == 0 ? 2 : 4;
    const int64_t nb1 = (2 * I + BLOCK_ROWS - 1) / BLOCK_ROWS, nb2 = (H + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int64_t M = 0;
    for (int e = 0; e < k; e++) M = starts[e] + counts[e] > M ? starts[e] + counts[e] : M;
#pragma omp parallel num_threads(nthreads)
    {
        /* 1. [g; u] = [gate; up] @ x for every expert's tokens */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < (int64_t)k * nb1; task++) {
            int e = (int)(task / nb1);
            int64_t r0 = (task % nb1) * BLOCK_ROWS, r1 = r0 + BLOCK_ROWS < 2 * I ? r0 + BLOCK_ROWS : 2 * I;
            if (counts[e] > 0)
                rows_dot(wdtype, rows[e], r0, r1, H, x + starts[e] * H, H, counts[e], scratch + starts[e] * 2 * I,
                         2 * I, NULL);
        }
        /* 2. a = silu(g) * u, in place over g */
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *g = scratch + m * 2 * I;
            for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
        }
        /* 3. out = w * (down @ a) */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < (int64_t)k * nb2; task++) {
            int e = (int)(task / nb2);
            int64_t r0 = (task % nb2) * BLOCK_ROWS, r1 = r0 + BLOCK_ROWS < H ? r0 + BLOCK_ROWS : H;
            const char *down = (const char *)rows[e] + 2 * I * H * esize;
            if (counts[e] > 0)
                rows_dot(wdtype, down, r0, r1, I, scratch + starts[e] * 2 * I, 2 * I, counts[e], out + starts[e] * H,
                         H, w + starts[e]);
        }
    }
    return 0;
}

/* The compiled instruction set, for logs: 2 = AVX-512F, 1 = AVX2+FMA, 0 = scalar. */
int ferry_isa(void) { return VW == 16 ? 2 : VW == 8 ? 1 : 0; }
