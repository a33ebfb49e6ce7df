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
#include <stdlib.h>
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

/* ---------------------------------------------------------------------------------------------------------
 * Quantized experts (ferrylm/experts/quantized.py): each expert row holds, per projection (gate|up [2I, H], then
 * down [H, I]), the fields data / scales / mins / row_scale at byte offsets the caller passes. A weight row is
 * dequantized into a float32 buffer (codes -> values in registers, times its group's scale, minus its min), then
 * dotted with up to TB tokens by dot_f32: the expert's bytes are read once per TB tokens, at 4 or 8 bits per weight
 * instead of 16, and everything after the load is float32.
 *   kind: 1 int4 ((u - 8) * s, or u * s - m), 2 int8 ((u - 128) * s, or u * s - m), 3 fp4 e2m1 * s, 4 fp8 e4m3 * s,
 *         GGML blocks kept as a GGUF file's bytes (no scales field; layouts: experts/gguf_blocks.py, from ggml's
 *         ggml-common.h, decoded as ggml-quants.c's dequantize_row_*): 5 Q8_0, 6 Q4_K, 7 Q5_K, 8 Q6_K,
 *         9 kmix: per expert one of 6..8, read from the tag byte at off_scales; rows padded to the widest kind of
 *         the mix, whose code sdtype holds
 *   scale dtype: 0 float32, 1 bfloat16, 2 float16, 3 float8 e4m3;  s times the row scale (float32) when present
 * ------------------------------------------------------------------------------------------------------- */
typedef struct {
    int64_t kind, group, sdtype, has_mins, has_row, off_data, off_scales, off_mins, off_row;
} qproj;

static float e4m3_lut[256];
static const float e2m1_lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float e4m3_to_f32(uint8_t b) {  /* sign bit 7, exponent bits 6-3 (bias 7), mantissa 2-0; e = 0 subnormal */
    int ex = (b >> 3) & 15, man = b & 7;
    float v = ex == 0 ? man * 0.001953125f : ldexpf(1.0f + man / 8.0f, ex - 7);
    if ((b & 0x7f) == 0x7f) v = NAN;
    return (b & 0x80) ? -v : v;
}

static float f16_to_f32(uint16_t h) {
    int sign = h >> 15, ex = (h >> 10) & 31, man = h & 1023;
    float v = ex == 0 ? ldexpf((float)man, -24) : ex == 31 ? (man ? NAN : INFINITY) : ldexpf(1024.0f + man, ex - 25);
    return sign ? -v : v;
}

static inline float load_scale(const uint8_t *p, int64_t i, int64_t sdtype) {
    switch (sdtype) {
    case 0: { float f; memcpy(&f, p + 4 * i, 4); return f; }
    case 1: { uint16_t h; memcpy(&h, p + 2 * i, 2); return bf16_to_f32(h); }
    case 2: { uint16_t h; memcpy(&h, p + 2 * i, 2); return f16_to_f32(h); }
    default: return e4m3_lut[p[i]];
    }
}

static inline float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return f16_to_f32(h); }

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes s */
static inline void scale_min_k4(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static const int64_t BLOCK_BYTES[9] = {0, 0, 0, 0, 0, 34, 144, 176, 210};

/* row r (K inputs) of GGML blocks of kind 5..8 -> buf[0:K]; every product exact in float32 (gguf_blocks.py) */
static void dequant_blocks(int64_t kind, const uint8_t *d, int64_t K, float *buf) {
    if (kind == 5) {
        for (int64_t b = 0; b < K / 32; b++, d += 34) {
            const float s = f16_at(d);
            for (int i = 0; i < 32; i++) buf[b * 32 + i] = s * (float)(int8_t)d[2 + i];
        }
        return;
    }
    for (int64_t b = 0; b < K / 256; b++, d += BLOCK_BYTES[kind]) {
        float *o = buf + b * 256;
        if (kind == 8) {  /* Q6_K: ql[128], qh[64], scales int8[16], d */
            const float dd = f16_at(d + 208);
            for (int v = 0; v < 256; v++) {
                const int h = v >> 7, w = v & 127;
                const int lo = (d[64 * h + (w & 63)] >> (4 * (w >> 6))) & 15;
                const int hi = (d[128 + 32 * h + (w & 31)] >> (2 * (w >> 5))) & 3;
                o[v] = dd * (float)(int8_t)d[192 + v / 16] * (float)((lo | (hi << 4)) - 32);
            }
            continue;
        }
        const float dd = f16_at(d), dmin = f16_at(d + 2);  /* Q4_K / Q5_K: d, dmin, scales[12], (qh[32]), qs[128] */
        const uint8_t *qs = d + (kind == 6 ? 16 : 48), *qh = d + 16;
        for (int j = 0; j < 8; j++) {
            float sc, mn;
            scale_min_k4(d + 4, j, &sc, &mn);
            const float s = dd * sc, m = dmin * mn;
            const uint8_t *c = qs + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) {
                int u = (c[l] >> shift) & 15;
                if (kind == 7) u |= ((qh[l] >> j) & 1) << 4;
                o[32 * j + l] = s * (float)u - m;
            }
        }
    }
}

/* row r (K inputs) of projection q of the expert row `base` -> buf[0:K] float32 */
static void dequant_row(const qproj *q, const uint8_t *base, int64_t r, int64_t K, float *buf) {
    if (q->kind == 9) {
        dequant_blocks(base[q->off_scales], base + q->off_data + r * (K / 256) * BLOCK_BYTES[q->sdtype], K, buf);
        return;
    }
    if (q->kind >= 5) {
        dequant_blocks(q->kind, base + q->off_data + r * (K / q->group) * BLOCK_BYTES[q->kind], K, buf);
        return;
    }
    const int64_t g = q->group, G = K / g;
    const uint8_t *sc = base + q->off_scales, *mn = base + q->off_mins;
    float rs = 1.0f;
    if (q->has_row) memcpy(&rs, base + q->off_row + 4 * r, 4);
    if (q->kind == 1 || q->kind == 3) {
        const uint8_t *d = base + q->off_data + r * (K / 2);
        for (int64_t j = 0; j < G; j++) {
            const float s = load_scale(sc, r * G + j, q->sdtype) * rs;
            const uint8_t *dj = d + j * (g / 2);
            float *o = buf + j * g;
            if (q->kind == 1 && q->has_mins) {
                const float m = load_scale(mn, r * G + j, q->sdtype);
                for (int64_t i = 0; i < g / 2; i++) {
                    o[2 * i] = (float)(dj[i] & 15) * s - m;
                    o[2 * i + 1] = (float)(dj[i] >> 4) * s - m;
                }
            } else if (q->kind == 1) {
                for (int64_t i = 0; i < g / 2; i++) {
                    o[2 * i] = ((float)(dj[i] & 15) - 8.0f) * s;
                    o[2 * i + 1] = ((float)(dj[i] >> 4) - 8.0f) * s;
                }
            } else {
                for (int64_t i = 0; i < g / 2; i++) {
                    o[2 * i] = e2m1_lut[dj[i] & 15] * s;
                    o[2 * i + 1] = e2m1_lut[dj[i] >> 4] * s;
                }
            }
        }
    } else {
        const uint8_t *d = base + q->off_data + r * K;
        for (int64_t j = 0; j < G; j++) {
            const float s = load_scale(sc, r * G + j, q->sdtype) * rs;
            const uint8_t *dj = d + j * g;
            float *o = buf + j * g;
            if (q->kind == 4) {
                for (int64_t i = 0; i < g; i++) o[i] = e4m3_lut[dj[i]] * s;
            } else if (q->has_mins) {
                const float m = load_scale(mn, r * G + j, q->sdtype);
                for (int64_t i = 0; i < g; i++) o[i] = (float)dj[i] * s - m;
            } else {
                for (int64_t i = 0; i < g; i++) o[i] = ((float)dj[i] - 128.0f) * s;
            }
        }
    }
}

#if VW == 16
/* AVX-512: 16 consecutive codes of a row (element k, a multiple of 16) as float32 values before scaling (fp8:
 * 2^-8 times the value: its bits read as float16, the 2^8 is folded into the scale). */
static inline __m512 decode16(int64_t kind, const uint8_t *d, int64_t k) {
    if (kind == 1 || kind == 3) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(d + k / 2));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        __m512i c = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  /* element 2i: low nibble of byte i */
        if (kind == 3) return _mm512_permutexvar_ps(c, _mm512_loadu_ps(e2m1_lut));
        return _mm512_cvtepi32_ps(c);
    }
    __m128i b = _mm_loadu_si128((const __m128i *)(d + k));
    if (kind == 2) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    __m256i h = _mm256_cvtepu8_epi16(b);  /* e4m3 -> float16 bits: sign to bit 15, exponent|mantissa << 7 */
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
    __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(mag, sgn));
}

/* res[t] = row r of projection q (dequantized in registers) . x[t] for t < nt; the group size a multiple of 16 */
static void qrow_dot16(const qproj *q, const uint8_t *base, int64_t r, int64_t K, const float *x, int64_t ldx,
                       int nt, float *res) {
    const int64_t g = q->group, G = K / g;
    const uint8_t *sc = base + q->off_scales, *mn = base + q->off_mins;
    const uint8_t *d = base + q->off_data + r * (q->kind == 1 || q->kind == 3 ? K / 2 : K);
    float rs = 1.0f;
    if (q->has_row) memcpy(&rs, base + q->off_row + 4 * r, 4);
    if (q->kind == 4) rs *= 256.0f;
    vf acc[TB];
    for (int t = 0; t < TB; t++) acc[t] = vzero();
    for (int64_t j = 0; j < G; j++) {
        const float s = load_scale(sc, r * G + j, q->sdtype) * rs;
        float off = 0.0f;  /* w = c * s + off */
        if (q->has_mins) off = -load_scale(mn, r * G + j, q->sdtype);
        else if (q->kind == 1) off = -8.0f * s;
        else if (q->kind == 2) off = -128.0f * s;
        const vf vs = _mm512_set1_ps(s), voff = _mm512_set1_ps(off);
        for (int64_t k = j * g; k < (j + 1) * g; k += 16) {
            vf wv = _mm512_fmadd_ps(decode16(q->kind, d, k), vs, voff);
            for (int t = 0; t < nt; t++) acc[t] = vfma(wv, vload(x + t * ldx + k), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) res[t] = vsum(acc[t]);
}
#endif

static void rows_dot_q(const qproj *q, const uint8_t *base, int64_t r0, int64_t r1, int64_t K, const float *x,
                       int64_t ldx, int64_t nx, float *y, int64_t ldy, const float *scale, float *buf) {
    float res[TB];
#if VW == 16
    const int fused = q->group % 16 == 0 && q->kind <= 4;  /* GGML blocks: dequant_row, then the float32 dot */
#else
    const int fused = 0;
#endif
    for (int64_t r = r0; r < r1; r++) {
        if (!fused) dequant_row(q, base, r, K, buf);
        for (int64_t t0 = 0; t0 < nx; t0 += TB) {
            int nt = (int)(nx - t0 < TB ? nx - t0 : TB);
#if VW == 16
            if (fused) qrow_dot16(q, base, r, K, x + t0 * ldx, ldx, nt, res);
            else
#endif
            dot_f32(buf, x + t0 * ldx, ldx, nt, K, res);
            for (int t = 0; t < nt; t++)
                y[(t0 + t) * ldy + r] = scale ? res[t] * scale[t0 + t] : res[t];
        }
    }
}

static int q_ok(const qproj *q, int64_t K) {
    if (q->kind == 9) return q->group == 256 && K % 256 == 0 && q->sdtype >= 6 && q->sdtype <= 8;
    if (q->kind >= 5 && q->kind <= 8)
        return q->group == (q->kind == 5 ? 32 : 256) && K % q->group == 0;
    return q->kind >= 1 && q->kind <= 4 && q->group > 0 && K % q->group == 0 && q->sdtype >= 0 && q->sdtype <= 3 &&
           (q->group % 2 == 0 || q->kind == 2 || q->kind == 4);
}

/* As ferry_expert_gemv, for quantized expert rows: qp[0] describes gate|up ([2I, H] rows), qp[1] down ([H, I]);
 * offsets are bytes from the start of the expert row. Returns 0, or -1 on bad arguments. */
int ferry_expert_gemv_q(const qproj *qp, int nthreads, int k, const void *const *rows, const int64_t *starts,
                        const int64_t *counts, int64_t H, int64_t I, const float *x, const float *w, float *scratch,
                        float *out) {
    if (k <= 0 || H <= 0 || I <= 0 || nthreads < 1 || !q_ok(&qp[0], H) || !q_ok(&qp[1], I)) return -1;
    if (e4m3_lut[0x38] != 1.0f)  /* 0x38 = 1.0 in e4m3: the table is filled on first use (idempotent) */
        for (int b = 0; b < 256; b++) e4m3_lut[b] = e4m3_to_f32((uint8_t)b);
    const int64_t nb1 = (2 * I + BLOCK_ROWS - 1) / BLOCK_ROWS, nb2 = (H + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t kmax = H > I ? H : I;
    int64_t M = 0;
    for (int e = 0; e < k; e++) M = starts[e] + counts[e] > M ? starts[e] + counts[e] : M;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * kmax);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < (int64_t)k * nb1; task++) {
            int e = (int)(task / nb1);
            int64_t r0 = (task % nb1) * BLOCK_ROWS, r1 = r0 + BLOCK_ROWS < 2 * I ? r0 + BLOCK_ROWS : 2 * I;
            if (counts[e] > 0)
                rows_dot_q(&qp[0], (const uint8_t *)rows[e], r0, r1, H, x + starts[e] * H, H, counts[e],
                           scratch + starts[e] * 2 * I, 2 * I, NULL, buf);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *g = scratch + m * 2 * I;
            for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < (int64_t)k * nb2; task++) {
            int e = (int)(task / nb2);
            int64_t r0 = (task % nb2) * BLOCK_ROWS, r1 = r0 + BLOCK_ROWS < H ? r0 + BLOCK_ROWS : H;
            if (counts[e] > 0)
                rows_dot_q(&qp[1], (const uint8_t *)rows[e], r0, r1, I, scratch + starts[e] * 2 * I, 2 * I,
                           counts[e], out + starts[e] * H, H, w + starts[e], buf);
        }
        free(buf);
    }
    return 0;
}

/* The compiled instruction set, for logs: 2 = AVX-512F, 1 = AVX2+FMA, 0 = scalar. */
int ferry_isa(void) { return VW == 16 ? 2 : VW == 8 ? 1 : 0; }
