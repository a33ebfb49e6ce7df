/* Fused CPU expert kernels: a layer's CPU share of experts in one OpenMP region, reading the expert bytes as stored.
 *
 * For each expert e with tokens m in [start_e, start_e + count_e):
 *     [g; u] = [gate; up]_e @ x_m            (gate|up is one [2I, H] block of the expert row)
 *     a      = silu(g) * u                   (Jiang et al. 2024, "Mixtral of Experts", eq. 3; SwiGLU)
 *     out_m  = w_m * (down_e @ a)            (down is [H, I], after gate|up)
 *
 * Weight kinds (qproj.kind; layouts in ferrylm/experts/quantized.py and gguf_blocks.py, from ggml's ggml-common.h):
 *   float kinds, float32 activations:  10 bf16, 11 f32, 4 fp8 e4m3 (a scale per group)
 *   integer kinds, Q8 activations:     1 int4, 2 int8 (symmetric, or u * s - m with mins), 3 fp4 e2m1 (MXFP4: bf16
 *                                      e8m0 scales; NVFP4: fp8 scales and a row scale), 5 Q8_0, 6 Q4_K, 7 Q5_K,
 *                                      8 Q6_K, 9 kmix (per expert one of 6..8, read from its tag byte)
 * An integer kind's dot product is integer, as ggml's CPU backend does it: the activation is quantized once per call
 * to int8 with a float32 scale per 32 inputs (round to nearest, |q| <= 127), each weight row is read 32 inputs at a
 * time and its codes decoded in a register into int8 values with a float32 scale and offset per 16 inputs
 * (w = v * s + o), and sum(v * q) runs in int32 (AVX2 maddubs, AVX-512 VNNI dpbusd). The K-quants (6..9) read the
 * activation as ggml's Q8_K (one scale per 256 inputs) and apply their integer sub-block scales in int32, one float
 * multiply per block of 256 (ggml's vec_dot_q*_K_q8_K). Relative to float32 activations that rounds each input by at
 * most 1/254 of its block's largest magnitude.
 * The dense entry ferry_matvec computes a GGUF's other matrices (lm_head, attention ...) from the same row kernels.
 *
 * Instruction sets: isa_kernels.h is compiled for AVX-512 (F/BW/VL/VNNI), AVX2 (+FMA, F16C) and plain C in this one
 * file; the caller picks one per call (ferry_isa_best: the best this CPU runs), so one build serves any x86-64 CPU.
 * Parallelism: one `omp parallel` per call (libgomp keeps its team between calls): the activation is quantized,
 * the gate|up rows of all experts are split over the threads, then silu (and the activation of down quantized),
 * then the down rows. Each weight row is read from memory once per call, for all the tokens routed to it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(_M_X64)
#define FERRY_X86 1
#include <immintrin.h>
#endif

#define TB 4   /* tokens per pass over a decoded weight row */
#define SHORT_ROW 1024  /* a one-token step reads Q4_K rows of at most this many inputs two at a time (longer: slower) */
/* the lane kernels' blocking (isa_kernels.h): weight rows a pass share each activation load, lane tiles a pass share
 * each decoded weight block; the best of 1-4 on Zen 4 */
#define Q4K_RB 4
#define Q4K_NS 1
#define Q8_RB 2
#define Q8_NS 2
#define RB_MAX 4
#define NS_MAX 2
#define TT 64  /* tokens per tile (rows in isa_kernels.h) */
#define LANES 16    /* tokens a pass of the level-2 Q4_K / Q8_0 row loops, one per 32-bit lane */
#define LANE_MIN 8  /* a tile of at least this many tokens takes the lanes */
#define TILE_FLOATS(k) ((k) * LANES / 4 + (k) / 32 * LANES + (k) / 256 * LANES)  /* one lane tile (isa_kernels.h) */
#define ROWBUF_FLOATS(k) ((k) + TT / LANES * TILE_FLOATS(k))  /* a thread's scratch: K floats (an fp8 row, scale
                                                                 * tables), then the lane tiles of a token tile */
#define PF_BYTES 4096  /* the integer row loops prefetch this far ahead of the block they read (rows lie in turn) */
#define KIND_BF16 10
#define KIND_F32 11
#define FAM_INT 1
#define FAM_FLOAT 0

typedef struct {  /* one projection of an expert row; offsets are bytes from the row's start */
    int64_t kind, group, sdtype, has_mins, has_row, off_data, off_scales, off_mins, off_row;
} qproj;

typedef struct {  /* Q8 activation of M tokens: q [M, K] int8, d [M, K/32] scales, d8 [M, K/4] each scale eight
                   * times (one per int32 lane of a 32-input dpbusd), s16 [M, K/16] and s32 [M, K/32] sums of q * d;
                   * and, where K % 256 == 0, its Q8_K form for the K-quants: qk [M, K] int8, dk
                   * [M, K/256] scales, bk [M, K/16] sums of qk (NULL otherwise) */
    int8_t *q;
    float *d, *d8, *s16, *s32;
    int8_t *qk;
    float *dk;
    int16_t *bk;
} qact;

typedef struct {  /* a projection's input: float32 x (row stride ldx) and, for integer kinds, its Q8 form */
    const float *x;
    int64_t ldx;
    qact q;
} act;

static const int64_t BLOCK_BYTES[9] = {0, 0, 0, 0, 0, 34, 144, 176, 210};
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  /* 2 * e2m1 */
static float e4m3_lut[256];

static inline int kind_family(int64_t kind) { return kind == 4 || kind >= KIND_BF16 ? FAM_FLOAT : FAM_INT; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#define F32_ID(v) (v)

static inline float f16_to_f32(uint16_t h) {  /* exact: the 15 magnitude bits moved to float's place, times 2^112 */
    uint32_t u = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &u, sizeof f);
    f *= 0x1p112f;
    if ((h & 0x7c00) == 0x7c00) f = (h & 0x3ff) ? NAN : INFINITY;
    return (h & 0x8000) ? -f : f;
}

static inline float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return f16_to_f32(h); }

static float e4m3_to_f32(uint8_t b) {  /* sign bit 7, exponent bits 6-3 (bias 7), mantissa 2-0; e = 0 subnormal */
    int ex = (b >> 3) & 15, man = b & 7;
    float v = ex == 0 ? man * 0.001953125f : ldexpf(1.0f + man / 8.0f, ex - 7);
    if ((b & 0x7f) == 0x7f) v = NAN;
    return (b & 0x80) ? -v : v;
}

/* scale i of a scale field: 0 float32, 1 bfloat16, 2 float16, 3 float8 e4m3 */
static inline float load_scale(const uint8_t *p, int64_t i, int64_t sdtype) {
    switch (sdtype) {
    case 0: { float f; memcpy(&f, p + 4 * i, 4); return f; }
    case 1: { uint16_t h; memcpy(&h, p + 2 * i, 2); return bf16_to_f32(h); }
    case 2: { uint16_t h; memcpy(&h, p + 2 * i, 2); return f16_to_f32(h); }
    default: return e4m3_lut[p[i]];
    }
}

static inline float row_scale(const qproj *q, const uint8_t *base, int64_t r) {
    float rs = 1.0f;
    if (q->has_row) memcpy(&rs, base + q->off_row + 4 * r, 4);
    return rs;
}

typedef struct {  /* row r of an integer-kind projection: its kind (a kmix row's own), first byte of its blocks or
                   * codes, and for the group kinds (1..3) its scales, mins, first group and row scale */
    int64_t kind;
    const uint8_t *d, *sc, *mn;
    int64_t g0;
    float rs;
} qrow;

static inline qrow qrow_of(const qproj *q, const uint8_t *base, int64_t r, int64_t K) {
    qrow w = {q->kind, base + q->off_data, base + q->off_scales, base + q->off_mins, 0, 1.0f};
    if (q->kind == 9) {  /* kmix: this expert's kind from its tag byte, rows padded to the widest kind */
        w.kind = base[q->off_scales];
        w.d += r * (K / 256) * BLOCK_BYTES[q->sdtype];
    } else if (q->kind >= 5) {
        w.d += r * (K / q->group) * BLOCK_BYTES[q->kind];
    } else {
        w.d += r * (q->kind == 1 || q->kind == 3 ? K / 2 : K);
        w.g0 = r * (K / q->group);
        w.rs = row_scale(q, base, r) * (q->kind == 3 ? 0.5f : 1.0f);  /* fp4: v holds 2 * e2m1 */
    }
    return w;
}

/* a Q4_K / Q5_K block's 6-bit sub-block scales and mins as bytes: sc[0..7] then mn[0..7] (ggml's get_scale_min_k4);
 * sub-blocks 0-3 from the low 6 bits of bytes 0-7, 4-7 from bytes 8-11 and the top bits */
static inline void kq_scale_bytes(const uint8_t *b, uint32_t *p) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    p[0] = u[0] & 0x3f3f3f3fu;
    p[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    p[2] = u[1] & 0x3f3f3f3fu;
    p[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
}

/* a group kind's row w (1 int4, 2 int8, 3 fp4): the scale s16[h] and offset o16[h] of its inputs 16h..16h+15 */
static void group_scales(const qproj *q, const qrow *w, int64_t K, float *s16, float *o16) {
    const int64_t g = q->group;
    for (int64_t j = 0; j < K / g; j++) {
        const float s = load_scale(w->sc, w->g0 + j, q->sdtype) * w->rs;
        const float m = q->has_mins ? load_scale(w->mn, w->g0 + j, q->sdtype) : 0.0f;
        const float o = q->kind == 2 && q->has_mins ? 128.0f * s - m : -m;
        for (int64_t h = 0; h < g / 16; h++) {
            s16[j * (g / 16) + h] = s;
            o16[j * (g / 16) + h] = o;
        }
    }
}

/* x [n] -> q (int8, round to nearest) with one scale max|x| / 127 (returned); isa_kernels.h's SFX(quantize_block)
 * are this, vectorized */
static float quantize_block_plain(const float *x, int n, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)lrintf(x[i] * inv);
    return amax / 127.0f;
}

/* prefetch `lines` cache lines from PF_BYTES past b (the bytes an integer row loop reads next); inlined, as a call
 * from a row loop would spill its vector registers */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *b, int lines) {
#ifdef FERRY_X86
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)b + PF_BYTES + 64 * i, _MM_HINT_T0);
#else
    (void)b;
    (void)lines;
#endif
}

/* ---- the row kernels, once per instruction set ---------------------------------------------------------- */
#ifdef FERRY_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
#define SFX(n) n##_avx512
#define ISA_LEVEL 2
#include "isa_kernels.h"
#include "decode_attention.h"
#undef SFX
#undef ISA_LEVEL
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define SFX(n) n##_avx2
#define ISA_LEVEL 1
#include "isa_kernels.h"
#include "decode_attention.h"
#undef SFX
#undef ISA_LEVEL
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
#define SFX(n) n##_c
#define ISA_LEVEL 0
#include "isa_kernels.h"
#include "decode_attention.h"
#undef SFX
#undef ISA_LEVEL

typedef void (*rows_fn)(const qproj *, const uint8_t *, int64_t, int64_t, int64_t, const act *, int64_t, int64_t,
                        float *, int64_t, const float *, float *);
typedef void (*dequant_fn)(const qproj *, const uint8_t *, int64_t, int64_t, float *, float *);

typedef float (*quant_fn)(const float *, int, int8_t *);
#ifdef FERRY_X86
static const quant_fn QUANT[3] = {quantize_block_c, quantize_block_avx2, quantize_block_avx512};
static const rows_fn ROWS[3] = {rows_c, rows_avx2, rows_avx512};
static const dequant_fn DEQUANT[3] = {dequant_row_c, dequant_row_avx2, dequant_row_avx512};
#else
static const quant_fn QUANT[3] = {quantize_block_c, NULL, NULL};
static const rows_fn ROWS[3] = {rows_c, NULL, NULL};
static const dequant_fn DEQUANT[3] = {dequant_row_c, NULL, NULL};
#endif

/* The best instruction set this CPU (and its OS) runs: 2 AVX-512 F/BW/VL/VNNI, 1 AVX2 + FMA + F16C, 0 plain C. */
int ferry_isa_best(void) {
#ifdef FERRY_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static void init_tables(void) {
    if (e4m3_lut[0x38] != 1.0f)  /* 0x38 = 1.0 in e4m3: filled on first use (idempotent) */
        for (int b = 0; b < 256; b++) e4m3_lut[b] = e4m3_to_f32((uint8_t)b);
}

/* Checks a projection of K inputs: integer kinds need K % 32 == 0 and groups of 16s; fp8 groups of 8s. */
static int q_ok(const qproj *q, int64_t K) {
    if (q->kind == KIND_BF16 || q->kind == KIND_F32) return 1;
    if (K % 32) return q->kind == 4 && q->group % 8 == 0 && K % q->group == 0 && q->sdtype >= 0 && q->sdtype <= 3;
    if (q->kind == 9) return q->group == 256 && K % 256 == 0 && q->sdtype >= 6 && q->sdtype <= 8;
    if (q->kind >= 5 && q->kind <= 8) return q->group == (q->kind == 5 ? 32 : 256) && K % q->group == 0;
    return q->kind >= 1 && q->kind <= 4 && q->group % (q->kind == 4 ? 8 : 16) == 0 && q->group > 0 &&
           K % q->group == 0 && q->sdtype >= 0 && q->sdtype <= 3;
}

static int isa_ok(int isa) { return isa >= 0 && isa <= ferry_isa_best(); }


/* token m's K inputs x -> row m of a (K inputs a row), the forms a holds: with a->q, q (int8, round to nearest), d (a
 * scale per 32: max|x| / 127), s16 and s32 (sums of q * d per 16 and 32: the offsets see the same quantized x as the
 * codes); with a->qk, the Q8_K form (a scale per 256, ggml's block_q8_K: qk, dk, and bk the sums of qk per 16) */
static void quantize_token(const float *x, int64_t K, const qact *a, int64_t m, int isa) {
    const quant_fn quantize_block = QUANT[isa];
    if (a->qk) {
        int8_t *qk = a->qk + m * K;
        for (int64_t b = 0; b < K / 256; b++) {
            a->dk[m * (K / 256) + b] = quantize_block(x + 256 * b, 256, qk + 256 * b);
            for (int h = 0; h < 16; h++) {
                int16_t sum = 0;
                for (int i = 0; i < 16; i++) sum = (int16_t)(sum + qk[256 * b + 16 * h + i]);
                a->bk[m * (K / 16) + 16 * b + h] = sum;
            }
        }
    }
    if (!a->q) return;
    int8_t *q = a->q + m * K;
    float *d = a->d + m * (K / 32), *d8 = a->d8 + m * (K / 4), *s16 = a->s16 + m * (K / 16), *s32 = a->s32 + m * (K / 32);
    for (int64_t c = 0; c < K / 32; c++) {
        const float dc = quantize_block(x + 32 * c, 32, q + 32 * c);
        d[c] = dc;
        for (int i = 0; i < 8; i++) d8[8 * c + i] = dc;
        int32_t sh[2] = {0, 0};
        for (int i = 0; i < 32; i++) sh[i / 16] += q[32 * c + i];
        s16[2 * c] = (float)sh[0] * dc;
        s16[2 * c + 1] = (float)sh[1] * dc;
        s32[c] = (float)(sh[0] + sh[1]) * dc;
    }
}

/* the scratch of n threads, ROWBUF_FLOATS(kmax) floats each */
static float *rowbufs_alloc(int n, int64_t kmax) {
    const size_t bytes = sizeof(float) * (size_t)(ROWBUF_FLOATS(kmax) * n);
    return (float *)aligned_alloc(64, (bytes + 63) / 64 * 64);
}

typedef struct {  /* the call's activation buffers */
    qact x, a;
    void *mem;
} actmem;

#define FORM_32 1  /* the activation per 32 inputs (int4, int8, fp4, Q8_0) */
#define FORM_K 2   /* ggml's Q8_K (the K-quants) */

/* the activation forms the integer kinds of q[0..n) read (0 for float kinds) */
static int act_forms(const qproj *q, int n) {
    int f = 0;
    for (int i = 0; i < n; i++)
        if (kind_family(q[i].kind) == FAM_INT) f |= q[i].kind >= 6 ? FORM_K : FORM_32;
    return f;
}

static int64_t act_bytes(int64_t M, int64_t K, int forms) {
    return (forms & FORM_32 ? M * (4 * (2 * (K / 32) + K / 16 + K / 4) + K) : 0) +
           (forms & FORM_K ? M * (4 * (K / 256) + 2 * (K / 16) + K) : 0);
}

/* one activation's buffers (M tokens of K inputs, the forms asked; NULL the others) at f; returns the bytes after */
static char *act_init(qact *a, char *f, int64_t M, int64_t K, int forms) {
    memset(a, 0, sizeof *a);
    if (forms & FORM_32) {
        a->d = (float *)f; f += 4 * M * (K / 32);
        a->d8 = (float *)f; f += 4 * M * (K / 4);
        a->s16 = (float *)f; f += 4 * M * (K / 16);
        a->s32 = (float *)f; f += 4 * M * (K / 32);
        a->q = (int8_t *)f; f += M * K;
    }
    if (forms & FORM_K) {
        a->dk = (float *)f; f += 4 * M * (K / 256);
        a->bk = (int16_t *)f; f += 2 * M * (K / 16);
        a->qk = (int8_t *)f; f += M * K;
    }
    return f;
}

/* the call's activation buffers: x (H inputs, forms fx) and a (I inputs, forms fa) of M tokens */
static int actmem_init(actmem *m, int64_t M, int64_t H, int fx, int64_t I, int fa) {
    m->mem = malloc((size_t)(act_bytes(M, H, fx) + act_bytes(M, I, fa)) + 64);
    if (!m->mem) return -1;
    act_init(&m->a, act_init(&m->x, (char *)m->mem, M, H, fx), M, I, fa);
    return 0;
}

/* ---- entry points (called through ctypes, which releases the GIL); each returns 0, or -1 on bad arguments, -2
 * for an instruction set this CPU lacks, -3 when out of memory ------------------------------------------------ */

/* rows per task: 32, or 128 where a tile takes the lanes (its interleaved activation is built once per task) */
static int64_t block_rows(int64_t tokens) { return tokens >= LANE_MIN ? 128 : 32; }

static int64_t span_end(int k, const int64_t *starts, const int64_t *counts) {
    int64_t M = 0;
    for (int e = 0; e < k; e++) M = starts[e] + counts[e] > M ? starts[e] + counts[e] : M;
    return M;
}

/* One projection of every expert: rows [0, N) of q (K inputs) for expert e's tokens of `a`, into y (stride ldy),
 * times w (per token) when w != NULL; rows below `split` from base lo, the others from base hi (the bases: three
 * per expert, gate|up below I, gate|up from I, down). Runs inside the caller's parallel region; tasks are handed out
 * one at a time (dynamic): a task's cost follows its expert's token count, which routing makes uneven. */
static void experts_proj(rows_fn rows, const qproj *q, int k, const void *const *bases, int lo, int hi, int64_t split,
                         const int64_t *starts, const int64_t *counts, int64_t N, int64_t K, const act *a, float *y,
                         int64_t ldy, const float *w, float *rb, int64_t br) {
    if (br <= 0) br = (N + omp_get_num_threads() - 1) / omp_get_num_threads();
    const int64_t nb = (N + br - 1) / br;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)k * nb; task++) {
        const int e = (int)(task / nb);
        const int64_t r0 = (task % nb) * br, r1 = r0 + br < N ? r0 + br : N;
        if (counts[e] <= 0) continue;
        float *ye = y + starts[e] * ldy;
        const float *we = w ? w + starts[e] : NULL;
        if (r0 < split)
            rows(q, (const uint8_t *)bases[3 * e + lo], r0, r1 < split ? r1 : split, K, a, starts[e], counts[e], ye,
                 ldy, we, rb);
        if (r1 > split)
            rows(q, (const uint8_t *)bases[3 * e + hi], r0 > split ? r0 : split, r1, K, a, starts[e], counts[e], ye,
                 ldy, we, rb);
    }
}

/* A layer's experts (see the header).
 *   qp[0]: gate|up ([2I, H] rows), qp[1]: down ([H, I]); isa: 0..2 (ferry_isa_best or lower)
 *   k experts; bases[3e .. 3e + 2]: expert e's gate|up rows below I, from I, and down (the qproj offsets are
 *   from these; a bank row is all three); starts/counts: its assignments (rows m < M = max(start + count))
 *   src [M] (or NULL: m): the row of x (x_rows of them) assignment m reads; w [M] its routing weight; scratch [M, 2I]
 *   pos [M] (or NULL): assignment m is the (pos % top_k)-th of token pos / top_k; then out [M / top_k, H] gets each
 *   token's weighted outputs summed in that order, and y [M, H] is scratch; without pos, out = y [M, H] gets
 *   assignment m's weighted output in row m (rows no expert owns are left as they are). Float32, contiguous.
 *   -1 also for a src out of range or a pos that is no permutation of 0 .. M - 1 (checked before any work). */
int ferry_experts(const qproj *qp, int isa, int nthreads, int k, const void *const *bases, const int64_t *starts,
                  const int64_t *counts, int64_t H, int64_t I, const float *x, int64_t x_rows, const int64_t *src,
                  const float *w, float *scratch, const int64_t *pos, int64_t top_k, float *y, float *out) {
    if (k <= 0 || H <= 0 || I <= 0 || nthreads < 1 || !q_ok(&qp[0], H) || !q_ok(&qp[1], I)) return -1;
    if (!isa_ok(isa)) return -2;
    init_tables();
    const rows_fn rows_isa = ROWS[isa];
    const int64_t M = span_end(k, starts, counts), kmax = H > I ? H : I;
    const int qx = act_forms(&qp[0], 1), qa = act_forms(&qp[1], 1);
    int64_t most = 0;
    for (int e = 0; e < k; e++) most = counts[e] > most ? counts[e] : most;
    /* an expert's rows: 128-row tasks where tiles take the lanes, else one contiguous run per thread (a few
     * tokens' rows are read once: long runs keep the hardware prefetcher streaming, where 32-row tasks handed out
     * in turn broke the stream every 37 KB) */
    const int64_t br = most >= LANE_MIN ? 128 : 0;
    actmem am = {.mem = NULL};
    float *rbs = rowbufs_alloc(nthreads, kmax);
    int64_t *inv = pos ? (int64_t *)malloc(sizeof(int64_t) * (size_t)M) : NULL;
    float *xg = src && !qx ? (float *)malloc(sizeof(float) * (size_t)(M * H)) : NULL;  /* float kinds read x rows */
    int rc = 0;
    if (!rbs || actmem_init(&am, M, H, qx, I, qa) || (pos && !inv) || (src && !qx && !xg)) {
        rc = -3;
        goto done;
    }
    int bad = pos && (top_k < 1 || M % top_k);
    if (pos) {
        for (int64_t m = 0; m < M; m++) inv[m] = -1;
        for (int64_t m = 0; m < M && !bad; m++) {
            bad = pos[m] < 0 || pos[m] >= M || inv[pos[m]] >= 0;
            if (!bad) inv[pos[m]] = m;
        }
    }
    for (int64_t m = 0; src && m < M && !bad; m++) bad = src[m] < 0 || src[m] >= x_rows;
    if (bad) {
        rc = -1;
        goto done;
    }
    float *yd = pos ? y : out;
    act ax = {xg ? xg : x, H, am.x}, aa = {scratch, 2 * I, am.a};
#pragma omp parallel num_threads(nthreads)
    {
        float *rb = rbs + omp_get_thread_num() * ROWBUF_FLOATS(kmax);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + (src ? src[m] : m) * H;
            if (qx) quantize_token(xm, H, &am.x, m, isa);
            else if (xg) memcpy(xg + m * H, xm, sizeof(float) * (size_t)H);
        }
        experts_proj(rows_isa, &qp[0], k, bases, 0, 1, I, starts, counts, 2 * I, H, &ax, scratch, 2 * I, NULL, rb, br);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {  /* a = silu(g) * u in place over g, then its Q8 form */
            float *g = scratch + m * 2 * I;
            for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
            if (qa) quantize_token(g, I, &am.a, m, isa);
        }
        experts_proj(rows_isa, &qp[1], k, bases, 2, 2, H, starts, counts, H, I, &aa, yd, H, w, rb, br);
        if (pos) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M / top_k; t++) {  /* a token's k outputs summed in rank order */
                float *o = out + t * H;
                memcpy(o, y + inv[t * top_k] * H, sizeof(float) * (size_t)H);
                for (int64_t j = 1; j < top_k; j++) {
                    const float *r = y + inv[t * top_k + j] * H;
                    for (int64_t h = 0; h < H; h++) o[h] += r[h];
                }
            }
        }
    }
done:
    free(inv);
    free(xg);
    free(rbs);
    free(am.mem);
    return rc;
}

/* out [T, H] = a layer's routed experts for T tokens of x [T, H] (float32): ids, w [T * top_k] (int64 expert ids,
 * each in [0, E), and float32 weights, token-major) are grouped here by expert (an expert's assignments in token
 * order) and each token's top_k outputs are summed in ascending expert id (ties in rank order), the order of
 * experts/work.py's LayerWork.combine. Expert e's rows: gate at g + e * gs, up at u + e * us (shifted back I rows,
 * see native_layouts.StackRows), down at d + e * ds (bytes). Returns the number of experts used, or ferry_experts'
 * codes (-1 also for an id out of range, checked before any work). */
int ferry_experts_routed(const qproj *qp, int isa, int nthreads, const uint8_t *g, int64_t gs, const uint8_t *u,
                         int64_t us, const uint8_t *d, int64_t ds, int64_t E, int64_t H, int64_t I, const float *x,
                         int64_t T, const int64_t *ids, const float *w, int64_t top_k, float *out) {
    if (T <= 0 || top_k < 1 || E < 1) return -1;
    const int64_t M = T * top_k;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= E) return -1;
    int64_t *at = (int64_t *)calloc((size_t)E, sizeof(int64_t));   /* per expert: count, then its next slot */
    int64_t *meta = (int64_t *)malloc(sizeof(int64_t) * (size_t)(4 * M));   /* src, pos, starts, counts */
    float *wsorted = (float *)malloc(sizeof(float) * (size_t)M);
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *y = (float *)malloc(sizeof(float) * (size_t)(M * H));
    const void **bases = (const void **)malloc(sizeof(void *) * (size_t)(3 * (M < E ? M : E)));
    int rc = -3;
    if (!at || !meta || !wsorted || !scratch || !y || !bases) goto done;
    int64_t *src = meta, *pos = meta + M, *starts = meta + 2 * M, *counts = meta + 3 * M;
    for (int64_t m = 0; m < M; m++) at[ids[m]]++;
    int k = 0;
    for (int64_t e = 0, s = 0; e < E; e++) {
        const int64_t n = at[e];
        if (n) {
            starts[k] = s;
            counts[k] = n;
            bases[3 * k] = g + e * gs;
            bases[3 * k + 1] = u + e * us;
            bases[3 * k + 2] = d + e * ds;
            k++;
        }
        at[e] = s;
        s += n;
    }
    for (int64_t m = 0; m < M; m++) {
        const int64_t t = m / top_k, slot = at[ids[m]]++;
        int64_t rank = 0;   /* this expert's place among the token's, ascending id, ties in rank order */
        for (int64_t j = t * top_k; j < (t + 1) * top_k; j++)
            rank += ids[j] < ids[m] || (ids[j] == ids[m] && j < m);
        src[slot] = t;
        pos[slot] = t * top_k + rank;
        wsorted[slot] = w[m];
    }
    rc = ferry_experts(qp, isa, nthreads, k, bases, starts, counts, H, I, x, T, src, wsorted, scratch, pos, top_k, y,
                       out);
    if (rc == 0) rc = k;
done:
    free(at);
    free(meta);
    free(wsorted);
    free(scratch);
    free(y);
    free(bases);
    return rc;
}

/* y [M, N] = x [M, K] @ W^T, W's N rows in nseg segments (segment s: seg_rows[s] rows of layout q[s] at bases[s],
 * its outputs after the earlier segments'): the matrices outside the experts (a fused q|k|v is three segments read
 * where they lie, each of its own kind), and the tests' view of one projection. */
int ferry_matvec(const qproj *q, int isa, int nthreads, int nseg, const void *const *bases, const int64_t *seg_rows,
                 int64_t K, const float *x, int64_t M, float *y) {
    if (nseg <= 0 || K <= 0 || M <= 0 || nthreads < 1) return -1;
    const int64_t br = block_rows(M);
    int64_t N = 0, ntask = 0;
    for (int s = 0; s < nseg; s++) {
        if (seg_rows[s] <= 0 || !q_ok(&q[s], K)) return -1;
        N += seg_rows[s];
        ntask += (seg_rows[s] + br - 1) / br;
    }
    const int qx = act_forms(q, nseg);
    if (!isa_ok(isa)) return -2;
    init_tables();
    actmem am;
    float *rbs = rowbufs_alloc(nthreads, K);
    if (!rbs || actmem_init(&am, M, K, qx, 0, 0)) {
        free(rbs);
        return -3;
    }
    act ax = {x, K, am.x};
    const rows_fn rows = ROWS[isa];
#pragma omp parallel num_threads(nthreads)
    {
        float *rb = rbs + omp_get_thread_num() * ROWBUF_FLOATS(K);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            if (qx) quantize_token(x + m * K, K, &am.x, m, isa);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < ntask; task++) {  /* a task: br rows of one segment */
            int s = 0;
            int64_t t = task, col = 0;
            while (t >= (seg_rows[s] + br - 1) / br) {
                t -= (seg_rows[s] + br - 1) / br;
                col += seg_rows[s++];
            }
            const int64_t r0 = t * br, r1 = r0 + br < seg_rows[s] ? r0 + br : seg_rows[s];
            rows(&q[s], (const uint8_t *)bases[s], r0, r1, K, &ax, 0, M, y + col, N, NULL, rb);
        }
    }
    free(rbs);
    free(am.mem);
    return 0;
}

/* The Q8 activation of x [M, K] as the integer kinds read it: per 32 inputs (block 32; K % 32 == 0), or the K-quants'
 * Q8_K form (block 256; K % 256 == 0): codes q [M, K] and scales d [M, K / block] (tests: x as the kernels see it is
 * q * d). */
int ferry_quantize_act(const float *x, int64_t M, int64_t K, int64_t block, int8_t *q, float *d) {
    if (M <= 0 || K <= 0 || (block != 32 && block != 256) || K % block) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / block; b++)
            d[m * (K / block) + b] = QUANT[ferry_isa_best()](x + m * K + block * b, (int)block, q + m * K + block * b);
    return 0;
}

/* Rows of an integer-kind projection as the kernel decodes them, w = v * s + o in float32 (two roundings, no fused
 * multiply-add), into out [n, K]: rows idx[0..n) (n rows from 0 when idx is NULL; each < N, the projection's rows),
 * e.g. the embedding rows of a step's tokens. */
int ferry_dequant(const qproj *q, int isa, const void *base, int64_t N, const int64_t *idx, int64_t n, int64_t K,
                  float *out) {
    if (N <= 0 || n < 0 || !q_ok(q, K) || kind_family(q->kind) != FAM_INT) return -1;
    for (int64_t i = 0; idx && i < n; i++)
        if (idx[i] < 0 || idx[i] >= N) return -1;
    if (!idx && n > N) return -1;
    if (!isa_ok(isa)) return -2;
    init_tables();
    float *tab = (float *)malloc(sizeof(float) * (size_t)(K / 8));
    if (!tab) return -3;
    for (int64_t i = 0; i < n; i++) DEQUANT[isa](q, (const uint8_t *)base, idx ? idx[i] : i, K, tab, out + i * K);
    free(tab);
    return 0;
}
