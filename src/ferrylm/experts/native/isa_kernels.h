/* Row kernels of one instruction set, included once per set by expert_gemv.c, which defines before including:
 *   SFX(name)  the name with the set's suffix (name##_avx512, name##_avx2, name##_c)
 *   ISA_LEVEL  2: AVX-512 F/BW/VL/VNNI, 1: AVX2 + FMA + F16C, 0: plain C
 * and compiles the include under that target (so -O3 auto-vectorizes the plain loops for it too).
 *
 * Integer kinds (int4, int8, fp4, Q8_0): a weight row is read 32 inputs (a chunk) at a time, its codes decoded into a
 * register (int8 v, w = v * s + o with a float32 scale and offset per 16 inputs) and dotted there with each of up to
 * TB tokens' Q8 activations (int8 codes, a float32 scale per 32 inputs, float32 sums per 16 and 32): sum_32 (v * xq)
 * in int32, times s * dx, plus o * sum(x); a group kind's scales decoded once per row. K-quants (Q4_K, Q5_K, Q6_K):
 * against the Q8_K activation (kdot_nt). Float kinds (bf16, f32, fp8): float32 activations; fp8 rows decoded to
 * float32 first. At level 2, Q4_K and Q8_0 (the bulk of a GGUF's bytes) read 64 inputs a step on 512-bit registers
 * (q4k_dot512, q8_0_dot512); a tile of >= LANE_MIN tokens puts 16 tokens in the lanes (q4k_dot16, q8_0_dot16: one
 * vpdpbusd per 4 weight bytes for 16 tokens, each block's scales once for all; a pass takes several rows and tiles:
 * tile_rows); every integer row loop prefetches PF_BYTES ahead. */

/* ---- primitives ---------------------------------------------------------------------------------------- */
#if ISA_LEVEL >= 1
static inline float SFX(hsum8)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* int32 lane i = sum of the 4 byte products 4i..4i+3 of u (unsigned, <= 128) and s (signed) */
static inline __m256i SFX(dot4)(__m256i u, __m256i s) {
#if ISA_LEVEL == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#if ISA_LEVEL == 2
#define VW 16
typedef __m512 SFX(vf);
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
    _mm256_loadu_si256((const __m256i *)(p))), 16))
#elif ISA_LEVEL == 1
#define VW 8
typedef __m256 SFX(vf);
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSUM(v) SFX(hsum8)(v)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32( \
    _mm_loadu_si128((const __m128i *)(p))), 16))
#endif

/* res[t] = w[0:n] . x[t * ldx : t * ldx + n] for t < nt (<= TB): vector loop, then the scalar tail */
#if ISA_LEVEL >= 1
#define DEF_FDOT(NAME, WT, WCVT, VLOADW)                                                                     \
static void NAME(const WT *w, const float *x, int64_t ldx, int nt, int64_t n, float *res) {                  \
    SFX(vf) acc[TB];                                                                                          \
    for (int t = 0; t < TB; t++) acc[t] = VZERO();                                                            \
    int64_t j = 0;                                                                                            \
    for (; j + VW <= n; j += VW) {                                                                            \
        SFX(vf) wv = VLOADW(w + j);                                                                           \
        for (int t = 0; t < nt; t++) acc[t] = VFMA(wv, VLOAD(x + t * ldx + j), acc[t]);                       \
    }                                                                                                         \
    for (int t = 0; t < nt; t++) {                                                                            \
        float s = VSUM(acc[t]);                                                                               \
        for (int64_t q = j; q < n; q++) s += WCVT(w[q]) * x[t * ldx + q];                                     \
        res[t] = s;                                                                                           \
    }                                                                                                         \
}
#else
#define DEF_FDOT(NAME, WT, WCVT, VLOADW)                                                                     \
static void NAME(const WT *w, const float *x, int64_t ldx, int nt, int64_t n, float *res) {                  \
    for (int t = 0; t < nt; t++) {                                                                            \
        float s = 0.0f;                                                                                       \
        for (int64_t q = 0; q < n; q++) s += WCVT(w[q]) * x[t * ldx + q];                                     \
        res[t] = s;                                                                                           \
    }                                                                                                         \
}
#endif
DEF_FDOT(SFX(fdot_bf16), uint16_t, bf16_to_f32, VLOAD_BF16)
DEF_FDOT(SFX(fdot_f32), float, F32_ID, VLOAD)
#undef DEF_FDOT

/* x [n] (n % 32 == 0) -> q (int8, round to nearest even, as lrintf) with one scale max|x| / 127 (returned); every
 * level gives the same bits */
static float SFX(quantize_block)(const float *x, int n, int8_t *q) {
#if ISA_LEVEL >= 1
    __m256 mx = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(abs, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), inv));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3,
                                                                                                   7)));
    }
    return amax / 127.0f;
#else
    return quantize_block_plain(x, n, q);
#endif
}

/* ---- integer kinds: a weight row read 32 inputs (one chunk) at a time, its codes decoded in registers ------ */
/* Per level: cod (a chunk's 32 int8 codes), sv (its two 16-input halves' scales), acc (a float accumulator). */
#if ISA_LEVEL >= 1
typedef __m256i SFX(cod);
typedef __m256 SFX(sv);
typedef __m256 SFX(acc);
#define SV_ONE(p) _mm256_broadcast_ss(p)  /* both halves *p */
#define SV_TWO(p) _mm256_set_m128(_mm_broadcast_ss((p) + 1), _mm_broadcast_ss(p))  /* halves p[0], p[1] */
#define ACC_ZERO() _mm256_setzero_ps()
#define ACC_SUM(a, b) SFX(hsum8)(_mm256_add_ps(a, b))
static inline float SFX(f16)(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* 16 bytes of packed nibbles -> 32 bytes, element 2i the low nibble of byte i */
static inline __m256i SFX(nibbles32)(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* 32 bytes at p shifted right by `shift` bits (< 8), masked to `mask` */
static inline __m256i SFX(bits32)(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)p), shift), _mm256_set1_epi8(mask));
}

/* acc[2 t + P] += (v . token (m0 + t)'s codes of chunk c, in int32 per 4 inputs) * sv * dx, t < NT (two accumulators
 * a token, P alternating with the chunks, halve the chain of dependent adds); U: v is unsigned (< 128) */
static inline __attribute__((always_inline)) void SFX(qstep)(__m256i v, __m256 sv, const qact *a, int64_t K,
                                                               int64_t m0, int64_t c, const int NT, const int U,
                                                               const int P, __m256 *acc) {
    const __m256i av = U ? v : _mm256_abs_epi8(v);
    for (int t = 0; t < NT; t++) {
        const int64_t m = m0 + t;
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + 32 * c));
        const __m256i p = SFX(dot4)(av, U ? xq : _mm256_sign_epi8(xq, v));
        acc[2 * t + P] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, _mm256_set1_ps(a->d[m * (K / 32) + c])),
                                         acc[2 * t + P]);
    }
}
#define CODES_STORE(v8, cod) _mm256_storeu_si256((__m256i *)(v8), cod)
#define OFF8(acc, o, x) ((acc) = _mm256_fmadd_ps(_mm256_load_ps(o), _mm256_loadu_ps(x), acc))  /* acc += o[0:8] x[0:8] */
#else
typedef struct { int8_t v[32]; } SFX(cod);
typedef struct { float s[2]; } SFX(sv);
typedef float SFX(acc);
static inline SFX(sv) SFX(sv_of)(float s0, float s1) { SFX(sv) r = {{s0, s1}}; return r; }
#define SV_ONE(p) SFX(sv_of)(*(p), *(p))
#define SV_TWO(p) SFX(sv_of)((p)[0], (p)[1])
#define ACC_ZERO() 0.0f
#define ACC_SUM(a, b) ((a) + (b))

static inline void SFX(qstep)(SFX(cod) v, SFX(sv) sv, const qact *a, int64_t K, int64_t m0, int64_t c, const int NT,
                              const int U, const int P, float *acc) {
    (void)U;
    for (int t = 0; t < NT; t++) {
        const int64_t m = m0 + t;
        for (int h = 0; h < 2; h++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += (int32_t)v.v[16 * h + i] * a->q[m * K + 32 * c + 16 * h + i];
            acc[2 * t + P] += (float)s * (sv.s[h] * a->d[m * (K / 32) + c]);
        }
    }
}
#define CODES_STORE(v8, cod) memcpy(v8, (cod).v, 32)
#define OFF8(acc, o, x) for (int j_ = 0; j_ < 8; j_++) (acc) += (o)[j_] * (x)[j_]
#endif
#if ISA_LEVEL >= 1
#define F16(p) SFX(f16)(p)
#else
#define F16(p) f16_at(p)
#endif

/* K-quant block b (Q4_K 6, Q5_K 7, Q6_K 8; ggml's layouts): Q4_K / Q5_K, w = d * sc * q - dmin * mn with a 6-bit
 * sc and mn per 32 inputs packed in 12 bytes: ss[j] = d * sc_j and so[j] = -(dmin * mn_j), j < 8; Q6_K, d times an
 * int8 scale per 16 inputs: ss[i], i < 16 (so untouched). */
static inline __attribute__((always_inline)) void SFX(kq_scales)(const uint8_t *b, const int KIND, float *ss,
                                                                   float *so) {
    if (KIND == 8) {
        const float dd = F16(b + 208);
#if ISA_LEVEL >= 1
        for (int h = 0; h < 2; h++)
            _mm256_store_ps(ss + 8 * h, _mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h))))));
#else
        for (int i = 0; i < 16; i++) ss[i] = dd * (float)(int8_t)b[192 + i];
#endif
        return;
    }
    uint32_t p[4];
    kq_scale_bytes(b, p);
    const float dd = F16(b), dmin = F16(b + 2);
#if ISA_LEVEL >= 1
    const __m128i sm = _mm_loadu_si128((const __m128i *)p);  /* sc[0..7], mn[0..7] */
    _mm256_store_ps(ss, _mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    _mm256_store_ps(so, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(
                                          _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))))));
#else
    uint8_t sm[16];
    memcpy(sm, p, 16);
    for (int j = 0; j < 8; j++) {
        ss[j] = dd * (float)sm[j];
        so[j] = -(dmin * (float)sm[8 + j]);
    }
#endif
}

/* the codes of chunk j (inputs 32j..32j+31) of K-quant block b: Q4_K / Q5_K unsigned, Q6_K minus 32 */
static inline __attribute__((always_inline)) SFX(cod) SFX(kq_codes)(const uint8_t *b, const int KIND, int j) {
    SFX(cod) v;
    if (KIND == 8) {
        const int h = j >> 2, q = j & 3;
        const uint8_t *ql = b + 64 * h + 32 * (q & 1), *qh = b + 128 + 32 * h;
#if ISA_LEVEL >= 1
        const __m256i lo = SFX(bits32)(ql, 4 * (q >> 1), 15), hi = SFX(bits32)(qh, 2 * q, 3);
        v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
#else
        for (int l = 0; l < 32; l++)
            v.v[l] = (int8_t)((((ql[l] >> (4 * (q >> 1))) & 15) | (((qh[l] >> (2 * q)) & 3) << 4)) - 32);
#endif
        return v;
    }
    const uint8_t *cq = b + (KIND == 6 ? 16 : 48) + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
#if ISA_LEVEL >= 1
    v = SFX(bits32)(cq, shift, 15);
    if (KIND == 7) v = _mm256_or_si256(v, _mm256_slli_epi16(SFX(bits32)(b + 16, j, 1), 4));
#else
    for (int l = 0; l < 32; l++)
        v.v[l] = (int8_t)(((cq[l] >> shift) & 15) | (KIND == 7 ? ((b[16 + l] >> j) & 1) << 4 : 0));
#endif
    return v;
}

/* Q8_0 block c's 32 int8 codes (its f16 scale is at b) */
static inline SFX(cod) SFX(q8_0_codes)(const uint8_t *b) {
#if ISA_LEVEL >= 1
    return _mm256_loadu_si256((const __m256i *)(b + 2));
#else
    SFX(cod) v;
    memcpy(v.v, b + 2, 32);
    return v;
#endif
}

/* chunk c of a group kind (1 int4, 2 int8, 3 fp4; two 4-bit codes a byte for int4 / fp4) */
static inline __attribute__((always_inline)) SFX(cod) SFX(group_codes)(const qproj *q, const qrow *w, const int KIND,
                                                                        int64_t c) {
    SFX(cod) v;
#if ISA_LEVEL >= 1
    if (KIND == 2) {  /* u - 128 */
        v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w->d + 32 * c)), _mm256_set1_epi8((char)0x80));
    } else {
        const __m256i u = SFX(nibbles32)(w->d + 16 * c);
        v = KIND == 3 ? _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2)), u)
                      : _mm256_sub_epi8(u, _mm256_set1_epi8(q->has_mins ? 0 : 8));
    }
#else
    const int8_t z = q->has_mins ? 0 : 8;
    for (int i = 0; i < 32; i++) {
        if (KIND == 2) {
            v.v[i] = (int8_t)(w->d[32 * c + i] ^ 0x80);
            continue;
        }
        const int u = (w->d[16 * c + i / 2] >> (4 * (i & 1))) & 15;
        v.v[i] = KIND == 3 ? E2M1_X2[u] : (int8_t)(u - z);
    }
#endif
    return v;
}

#if ISA_LEVEL == 2
/* perm[g]: the vpermw index that puts a Q4_K block's sub-block scales 2g and 2g + 1 in the 16-bit lanes of the
 * low and high halves of a register (the two chunks of code group g) */
static inline void SFX(q4k_perms)(__m512i *perm) {
    for (int g = 0; g < 4; g++)
        perm[g] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * g))),
                                     _mm256_set1_epi16((short)(2 * g + 1)), 1);
}

/* a Q4_K block's 8 mins (bytes 8..15 of smv, kq_scale_bytes' order) each twice, as 16-bit lanes: one per 16 inputs */
static inline __m256i SFX(q4k_mins16)(__m128i smv) {
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(smv, 8), _mm_set_epi8(
        7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)));
}

/* res[r * NT + t] = Q4_K row w[r] . token (m0 + t)'s Q8_K activation on 512-bit registers, r < NR (<= 2), t < NT
 * (<= TB), the integers of kdot_nt: a 32-byte group of codes holds two chunks (low nibbles: inputs 64g..64g+31,
 * high: the next 32), decoded into one register and dotted with the activation's 64 bytes there (maddubs), times
 * the chunks' 6-bit scales as 16-bit lanes (vpermw), summed in int32 (vpdpwssd); the mins as kdot_nt takes them.
 * A row's decoded group serves the NT tokens; the NR rows share each activation load (a one-token step reads rows
 * of 3 blocks for a down projection: two at a time). */
static inline __attribute__((always_inline)) void SFX(q4k_dot512)(const qrow *w, const int NR, int64_t K,
                                                                    const qact *a, int64_t m0, const int NT,
                                                                    float *res) {
    const int64_t nb = K / 256;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i perm[4];
    SFX(q4k_perms)(perm);
    __m512 acc[2 * TB];
    __m256 accm[2 * TB];
    #pragma GCC unroll 8
    for (int i = 0; i < NR * NT; i++) {
        acc[i] = _mm512_setzero_ps();
        accm[i] = _mm256_setzero_ps();
    }
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *b[2];
        __m128i smv[2];
        __m512i sc16[2], sumi[2 * TB];
        #pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            b[r] = w[r].d + 144 * ib;
            prefetch_ahead(b[r], 3);
            uint32_t sm[4];
            kq_scale_bytes(b[r], sm);
            smv[r] = _mm_loadu_si128((const __m128i *)sm);  /* sc[0..7], mn[0..7] */
            sc16[r] = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(smv[r]));
        }
        #pragma GCC unroll 8
        for (int i = 0; i < NR * NT; i++) sumi[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++)
            #pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(b[r] + 16 + 32 * g));
                const __m512i v = _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), m4);
                const __m512i scg = _mm512_permutexvar_epi16(perm[g], sc16[r]);
                #pragma GCC unroll 8
                for (int t = 0; t < NT; t++) {
                    const __m512i xq = _mm512_loadu_si512((const void *)(a->qk + (m0 + t) * K + 256 * ib + 64 * g));
                    sumi[r * NT + t] = _mm512_dpwssd_epi32(sumi[r * NT + t], _mm512_maddubs_epi16(v, xq), scg);
                }
            }
        #pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            const float dd = F16(b[r]), dmin = F16(b[r] + 2);
            const __m256i w16 = SFX(q4k_mins16)(smv[r]);
            #pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const int64_t m = m0 + t;
                const float dk = a->dk[m * nb + ib];
                const __m256i bs = _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(a->bk + m * (K / 16) +
                                                                                               16 * ib)));
                acc[r * NT + t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r * NT + t]), _mm512_set1_ps(dd * dk),
                                                  acc[r * NT + t]);
                accm[r * NT + t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(bs), _mm256_set1_ps(dmin * dk),
                                                    accm[r * NT + t]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NR * NT; i++) res[i] = _mm512_reduce_add_ps(acc[i]) + SFX(hsum8)(accm[i]);
}

/* ---- 16 tokens in the lanes (level 2, a step of >= LANE_MIN tokens): the activation of a tile of 16 tokens is
 * interleaved once per tile ([K/4][16] groups of 4 bytes, token i in lane i), then each weight row is decoded once per
 * block and each 4-byte group of its codes broadcast against the tile: one vpdpbusd makes 64 products for 16 tokens,
 * and each block's scales are applied once for all of them. */
/* the Q8_K activation of tokens m0 .. m0 + n - 1 (n <= 16; lanes from n on are zero) as the lanes read it, in t:
 * xr [K/4][16] int32 (4 codes), bs [K/32][16] float (sum of the 32 codes), dk [K/256][16] float */
static void SFX(tile_q8k)(const qact *a, int64_t K, int64_t m0, int n, float *t) {
    int32_t *xr = (int32_t *)t;
    float *bs = t + K * LANES / 4, *dk = bs + K / 32 * LANES;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const __m512i stride = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)K));
    for (int64_t k4 = 0; k4 < K / 4; k4++)
        _mm512_store_si512((void *)(xr + k4 * LANES), _mm512_mask_i32gather_epi32(
            _mm512_setzero_si512(), live, stride, (const void *)(a->qk + m0 * K + 4 * k4), 1));
    for (int64_t c = 0; c < K / 32; c++)
        for (int i = 0; i < LANES; i++) {
            bs[c * LANES + i] = 0.0f;
            if (i < n)
                bs[c * LANES + i] = (float)(a->bk[(m0 + i) * (K / 16) + 2 * c] + a->bk[(m0 + i) * (K / 16) + 2 * c + 1]);
        }
    for (int64_t ib = 0; ib < K / 256; ib++)
        for (int i = 0; i < LANES; i++) dk[ib * LANES + i] = i < n ? a->dk[(m0 + i) * (K / 256) + ib] : 0.0f;
}

/* the Q8 activation (per 32 inputs) of tokens m0 .. m0 + n - 1 as the lanes read it, in t: xu [K/4][16] int32
 * (4 codes + 128 as unsigned bytes; lanes from n on hold 128s, a zero input), dx [K/32][16] float (0 past n) */
static void SFX(tile_q8)(const qact *a, int64_t K, int64_t m0, int n, float *t) {
    int32_t *xu = (int32_t *)t;
    float *dx = t + K * LANES / 4;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const __m512i stride = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)K)), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t k4 = 0; k4 < K / 4; k4++)
        _mm512_store_si512((void *)(xu + k4 * LANES), _mm512_xor_si512(flip, _mm512_mask_i32gather_epi32(
            _mm512_setzero_si512(), live, stride, (const void *)(a->q + m0 * K + 4 * k4), 1)));
    for (int64_t c = 0; c < K / 32; c++)
        for (int i = 0; i < LANES; i++) dx[c * LANES + i] = i < n ? a->d[(m0 + i) * (K / 32) + c] : 0.0f;
}

/* out[(s * NR + r) * 16 + i] = Q8_0 row w[r] . token i of tile s (tile_q8; tiles TILE_FLOATS(K) floats apart),
 * r < NR, s < NS: per block, sum (x + 128) w by vpdpbusd less 128 sum(w), times the block's scale and each token's
 * dx in float32. A block's codes are read once for the NS tiles, an activation load serves the NR rows. */
static inline __attribute__((always_inline)) void SFX(q8_0_dot16)(const qrow *w, const int NR, const float *tiles,
                                                                    const int NS, int64_t K, float *out) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int64_t tf = TILE_FLOATS(K);
    __m512 acc[NS_MAX][RB_MAX];
    for (int s = 0; s < NS; s++)
        for (int r = 0; r < NR; r++) acc[s][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K / 32; c++) {
        int32_t cw[RB_MAX][8], wsum[RB_MAX];
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = w[r].d + 34 * c;
            if ((c & 1) == 0) prefetch_ahead(b, 1);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2));
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(v, flip), _mm256_setzero_si256());
            const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            wsum[r] = (int32_t)(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
            _mm256_storeu_si256((__m256i *)cw[r], v);
        }
        for (int s = 0; s < NS; s++) {
            const int32_t *x = (const int32_t *)(tiles + s * tf) + 8 * c * LANES;
            const float *dx = tiles + s * tf + K * LANES / 4;
            __m512i s0[RB_MAX], s1[RB_MAX];
            for (int r = 0; r < NR; r++) {
                s0[r] = _mm512_set1_epi32(-128 * wsum[r]);
                s1[r] = _mm512_setzero_si512();
            }
            for (int u = 0; u < 8; u += 2) {
                const __m512i x0 = _mm512_load_si512((const void *)(x + u * LANES));
                const __m512i x1 = _mm512_load_si512((const void *)(x + (u + 1) * LANES));
                for (int r = 0; r < NR; r++) {
                    s0[r] = _mm512_dpbusd_epi32(s0[r], x0, _mm512_set1_epi32(cw[r][u]));
                    s1[r] = _mm512_dpbusd_epi32(s1[r], x1, _mm512_set1_epi32(cw[r][u + 1]));
                }
            }
            const __m512 d = _mm512_load_ps(dx + c * LANES);
            for (int r = 0; r < NR; r++)
                acc[s][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r])),
                                            _mm512_mul_ps(d, _mm512_set1_ps(F16(w[r].d + 34 * c))), acc[s][r]);
        }
    }
    for (int s = 0; s < NS; s++)
        for (int r = 0; r < NR; r++) _mm512_storeu_ps(out + (s * NR + r) * LANES, acc[s][r]);
}

/* out[(s * NR + r) * 16 + i] = Q4_K row w[r] . token i of tile s (tile_q8k), r < NR, s < NS, the same sums as
 * kdot_nt (the sub-block scales applied in float32). A block's codes are decoded once for the NS tiles, an
 * activation load serves the NR rows. */
static inline __attribute__((always_inline)) void SFX(q4k_dot16)(const qrow *w, const int NR, const float *tiles,
                                                                   const int NS, int64_t K, float *out) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const int64_t tf = TILE_FLOATS(K);
    __m512 acc[NS_MAX][RB_MAX];
    for (int s = 0; s < NS; s++)
        for (int r = 0; r < NR; r++) acc[s][r] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < K / 256; ib++) {
        uint32_t sm[RB_MAX][4];
        int32_t codes[RB_MAX][64];
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = w[r].d + 144 * ib;
            prefetch_ahead(b, 3);
            kq_scale_bytes(b, sm[r]);
            for (int g = 0; g < 4; g++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * g));
                _mm256_storeu_si256((__m256i *)(codes[r] + 16 * g), _mm256_and_si256(q, m4));
                _mm256_storeu_si256((__m256i *)(codes[r] + 16 * g + 8), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            }
        }
        for (int s = 0; s < NS; s++) {
            const int32_t *x = (const int32_t *)(tiles + s * tf) + ib * 64 * LANES;
            const float *bs = tiles + s * tf + K * LANES / 4, *dk = bs + K / 32 * LANES;
            __m512 accb[RB_MAX], accm[RB_MAX];
            for (int r = 0; r < NR; r++) accb[r] = accm[r] = _mm512_setzero_ps();
            for (int j = 0; j < 8; j++) {
                __m512i s0[RB_MAX], s1[RB_MAX];
                for (int r = 0; r < NR; r++) s0[r] = s1[r] = _mm512_setzero_si512();
                for (int u = 0; u < 8; u += 2) {
                    const __m512i x0 = _mm512_load_si512((const void *)(x + (8 * j + u) * LANES));
                    const __m512i x1 = _mm512_load_si512((const void *)(x + (8 * j + u + 1) * LANES));
                    for (int r = 0; r < NR; r++) {
                        s0[r] = _mm512_dpbusd_epi32(s0[r], _mm512_set1_epi32(codes[r][8 * j + u]), x0);
                        s1[r] = _mm512_dpbusd_epi32(s1[r], _mm512_set1_epi32(codes[r][8 * j + u + 1]), x1);
                    }
                }
                const __m512 bsj = _mm512_load_ps(bs + (8 * ib + j) * LANES);
                for (int r = 0; r < NR; r++) {
                    const uint8_t *sc = (const uint8_t *)sm[r];
                    accb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r])),
                                              _mm512_set1_ps((float)sc[j]), accb[r]);
                    accm[r] = _mm512_fmadd_ps(bsj, _mm512_set1_ps((float)sc[8 + j]), accm[r]);
                }
            }
            const __m512 d = _mm512_load_ps(dk + ib * LANES);
            for (int r = 0; r < NR; r++) {
                const uint8_t *b = w[r].d + 144 * ib;
                acc[s][r] = _mm512_fmadd_ps(accb[r], _mm512_mul_ps(d, _mm512_set1_ps(F16(b))), acc[s][r]);
                acc[s][r] = _mm512_fnmadd_ps(accm[r], _mm512_mul_ps(d, _mm512_set1_ps(F16(b + 2))), acc[s][r]);
            }
        }
    }
    for (int s = 0; s < NS; s++)
        for (int r = 0; r < NR; r++) _mm512_storeu_ps(out + (s * NR + r) * LANES, acc[s][r]);
}

/* rows (nr of them) against tiles (ns of them) with a kernel's blocking: full blocks take the compile-time sizes */
#define LANE_DOT(FN, RBK, NSK, w, nr, ts, ns, K, out)                                                          \
    do {                                                                                                       \
        if ((nr) == (RBK) && (ns) == (NSK)) FN(w, RBK, ts, NSK, K, out);                                       \
        else if ((nr) == (RBK)) FN(w, RBK, ts, 1, K, out);                                                     \
        else if ((ns) == (NSK)) FN(w, 1, ts, NSK, K, out);                                                     \
        else FN(w, 1, ts, 1, K, out);                                                                          \
    } while (0)

/* rows [r0, r1) of a Q4_K (6) or Q8_0 (5) projection against the lane tiles at tiles (TILE_FLOATS(K) apart;
 * tile s holds tokens t0 + 16 s .., nx in all): the kind's block of rows and tiles a pass while they last, then one */
static void SFX(tile_rows)(const qproj *q, const uint8_t *base, int64_t r0, int64_t r1, int64_t K, const float *tiles,
                           int64_t t0, int64_t nx, float *y, int64_t ldy, const float *scale) {
    float out[NS_MAX * RB_MAX * LANES];
    const int q4k = q->kind == 6, rb = q4k ? Q4K_RB : Q8_RB, nsb = q4k ? Q4K_NS : Q8_NS;
    const int64_t nsub = (nx + LANES - 1) / LANES;
    for (int64_t r = r0; r < r1;) {
        const int nr = r1 - r >= rb ? rb : 1;
        qrow w[RB_MAX];
        for (int i = 0; i < nr; i++) w[i] = qrow_of(q, base, r + i, K);
        for (int64_t s = 0; s < nsub;) {
            const int ns = nsub - s >= nsb ? nsb : 1;
            const float *ts = tiles + s * TILE_FLOATS(K);
            if (q4k) LANE_DOT(SFX(q4k_dot16), Q4K_RB, Q4K_NS, w, nr, ts, ns, K, out);
            else LANE_DOT(SFX(q8_0_dot16), Q8_RB, Q8_NS, w, nr, ts, ns, K, out);
            for (int si = 0; si < ns; si++) {
                const int64_t m = t0 + (s + si) * LANES;
                const int n = (int)(t0 + nx - m < LANES ? t0 + nx - m : LANES);
                for (int i = 0; i < nr; i++) {
                    const float *o = out + (si * nr + i) * LANES;
                    for (int t = 0; t < n; t++) y[(m + t) * ldy + r + i] = scale ? o[t] * scale[m + t] : o[t];
                }
            }
            s += ns;
        }
        r += nr;
    }
}
#undef LANE_DOT
#endif

#if ISA_LEVEL == 2
/* res[t] = Q8_0 row w . token (m0 + t)'s Q8 activation on 512-bit registers, two blocks (64 inputs) a step: the
 * activation made unsigned (x + 128) against the codes as stored (dpbusd), less 128 * the codes' sums (once per step
 * for all tokens), times each block's scale * dx (d8) in float32; exact integers, so the same sums as a signed dot.
 * K % 64 == 0. */
static inline __attribute__((always_inline)) void SFX(q8_0_dot512)(const qrow *w, int64_t K, const qact *a,
                                                                     int64_t m0, const int NT, float *res) {
    const int64_t nc = K / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TB];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c += 2) {
        const uint8_t *b = w->d + 34 * c;
        prefetch_ahead(b, 2);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
        /* (x + 128) . v - 128 * sum(v) per 4 inputs: the activation unsigned, the codes as stored */
        const __m512i base = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, v));
        const __m512 sw = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(F16(b))),
                                                              _mm256_castps_pd(_mm256_set1_ps(F16(b + 34))), 1));
        for (int t = 0; t < NT; t++) {
            const int64_t m = m0 + t;
            const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(a->q + m * K + 32 * c)), flip);
            const __m512 sc = _mm512_mul_ps(sw, _mm512_loadu_ps(a->d8 + m * (K / 4) + 8 * c));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(base, xu, v)), sc, acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) res[t] = _mm512_reduce_add_ps(acc[t]);
}
#endif

/* res[t] = K-quant row w (KIND 6 Q4_K, 7 Q5_K, 8 Q6_K) . token (m0 + t)'s Q8_K activation, t < NT, as ggml's
 * vec_dot_q*_K_q8_K: per block of 256, the codes times the activation's in int16 pairs, times the integer sub-block
 * scales in int32, summed in int32 over the block; then d * dk times that, less dmin * dk times the mins times the
 * activation's sums per 32 (Q4_K, Q5_K). Q6_K's codes are read unsigned (q + 32) and 32 times its scales times the
 * activation's sums per 16 are taken off. Each chunk's codes are decoded once for the NT tokens. */
static inline __attribute__((always_inline)) void SFX(kdot_nt)(const qrow *w, const int KIND, int64_t K,
                                                                 const qact *a, int64_t m0, const int NT, float *res) {
    const int64_t nb = K / 256;
#if ISA_LEVEL == 2
    if (KIND == 6) {
        SFX(q4k_dot512)(w, 1, K, a, m0, NT, res);
        return;
    }
#endif
#if ISA_LEVEL >= 1
    __m256 acc[TB];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *b = w->d + BLOCK_BYTES[KIND] * ib;
        prefetch_ahead(b, 3);
        __m256i sumi[TB];
        for (int t = 0; t < NT; t++) sumi[t] = _mm256_setzero_si256();
        uint32_t sm[4];
        if (KIND != 8) kq_scale_bytes(b, sm);
        const uint8_t *sc8 = KIND == 8 ? b + 192 : (const uint8_t *)sm;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i v = SFX(kq_codes)(b, KIND, j);
            __m256i scj;
            if (KIND == 8) {
                v = _mm256_add_epi8(v, _mm256_set1_epi8(32));
                scj = _mm256_set_m128i(_mm_set1_epi16((int8_t)sc8[2 * j + 1]), _mm_set1_epi16((int8_t)sc8[2 * j]));
            } else {
                scj = _mm256_set1_epi16(sc8[j]);
            }
            for (int t = 0; t < NT; t++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->qk + (m0 + t) * K + 256 * ib + 32 * j));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(v, xq), scj));
            }
        }
        const float dd = F16(KIND == 8 ? b + 208 : b), dmin = KIND == 8 ? 0.0f : F16(b + 2);
        /* the sums per 16 of the activation against the scales (Q6_K) or the mins, each of a 32-chunk's twice */
        const __m256i w16 = KIND == 8 ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)))
                                      : _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(sc8 + 8)),
                                                                              _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3,
                                                                                           2, 2, 1, 1, 0, 0)));
        for (int t = 0; t < NT; t++) {
            const int64_t m = m0 + t;
            const float dk = a->dk[m * nb + ib];
            const __m256i bs = _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(a->bk + m * (K / 16) +
                                                                                           16 * ib)));
            if (KIND == 8) {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[t], _mm256_slli_epi32(bs, 5))),
                                         _mm256_set1_ps(dd * dk), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(dd * dk), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(bs), _mm256_set1_ps(dmin * dk), acc[t]);
            }
        }
    }
    for (int t = 0; t < NT; t++) res[t] = SFX(hsum8)(acc[t]);
#else
    for (int t = 0; t < NT; t++) {
        const int64_t m = m0 + t;
        const int8_t *xq = a->qk + m * K;
        float r = 0.0f;
        for (int64_t ib = 0; ib < nb; ib++) {
            const uint8_t *b = w->d + BLOCK_BYTES[KIND] * ib;
            uint32_t sm[4];
            if (KIND != 8) kq_scale_bytes(b, sm);
            const uint8_t *sc8 = KIND == 8 ? b + 192 : (const uint8_t *)sm;
            int32_t isum = 0, ioff = 0;
            for (int j = 0; j < 8; j++) {
                const SFX(cod) v = SFX(kq_codes)(b, KIND, j);
                for (int i = 0; i < 32; i++) {
                    const int32_t sc = KIND == 8 ? (int8_t)sc8[2 * j + i / 16] : sc8[j];
                    isum += sc * (KIND == 8 ? v.v[i] + 32 : v.v[i]) * xq[256 * ib + 32 * j + i];
                }
            }
            for (int h = 0; h < 16; h++)
                ioff += (KIND == 8 ? (int8_t)sc8[h] : sc8[8 + h / 2]) * a->bk[m * (K / 16) + 16 * ib + h];
            const float dk = a->dk[m * nb + ib];
            if (KIND == 8) r += (float)(isum - 32 * ioff) * (F16(b + 208) * dk);
            else r += (float)isum * (F16(b) * dk) - (float)ioff * (F16(b + 2) * dk);
        }
        res[t] = r;
    }
#endif
}

/* res[t] = integer-kind row w . token (m0 + t)'s Q8 activation, t < NT; KIND a constant (1..3 group kinds, 5 Q8_0,
 * 6..8 K-quants) so each caller is specialised. Each chunk's codes are decoded once for the NT tokens and dotted in
 * int32 (sum v * xq per 4 inputs), times s * dx in float32; the offsets o add o * (sum of x) per 16 or 32 inputs.
 * Scales: a K-quant block's once per block; a group kind's row once into tab (K / 8 floats: per 16 inputs s, then o). */
static inline __attribute__((always_inline)) void SFX(qdot_nt)(const qproj *q, const qrow *w, const int KIND,
                                                                 int64_t K, const qact *a, int64_t m0, const int NT,
                                                                 float *tab, float *res) {
    const int64_t nc = K / 32;
    float off[TB] = {0, 0, 0, 0};
    SFX(acc) acc[2 * TB];
    for (int t = 0; t < 2 * NT; t++) acc[t] = ACC_ZERO();
    if (KIND >= 6) {
        SFX(kdot_nt)(w, KIND, K, a, m0, NT, res);
        return;
    }
#if ISA_LEVEL == 2
    if (KIND == 5 && nc % 2 == 0) {
        SFX(q8_0_dot512)(w, K, a, m0, NT, res);
        return;
    }
#endif
    if (KIND == 5) {
        for (int64_t c = 0; c < nc; c++) {  /* even and odd chunks in the two accumulators */
            const uint8_t *b = w->d + 34 * c;
            const float s = F16(b);
            SFX(qstep)(SFX(q8_0_codes)(b), SV_ONE(&s), a, K, m0, c, NT, 0, 0, acc);
            if (++c == nc) break;
            const float s1 = F16(b + 34);
            SFX(qstep)(SFX(q8_0_codes)(b + 34), SV_ONE(&s1), a, K, m0, c, NT, 0, 1, acc);
        }
    } else {
        group_scales(q, w, K, tab, tab + K / 16);
        for (int64_t c = 0; c < nc; c++) {
            SFX(qstep)(SFX(group_codes)(q, w, KIND, c), SV_TWO(tab + 2 * c), a, K, m0, c, NT, 0, 0, acc);
            if (++c == nc) break;
            SFX(qstep)(SFX(group_codes)(q, w, KIND, c), SV_TWO(tab + 2 * c), a, K, m0, c, NT, 0, 1, acc);
        }
        if (q->has_mins) SFX(fdot_f32)(tab + K / 16, a->s16 + m0 * (K / 16), K / 16, NT, K / 16, off);
    }
    for (int t = 0; t < NT; t++) res[t] = ACC_SUM(acc[2 * t], acc[2 * t + 1]) + off[t];
}

#define QDOT_CASES(KIND)                                                                                      \
    case 8 * KIND + 1: SFX(qdot_nt)(q, &w, KIND, K, a, m0, 1, tab, res); break;                                \
    case 8 * KIND + 2: SFX(qdot_nt)(q, &w, KIND, K, a, m0, 2, tab, res); break;                                \
    case 8 * KIND + 3: SFX(qdot_nt)(q, &w, KIND, K, a, m0, 3, tab, res); break;                                \
    case 8 * KIND + 4: SFX(qdot_nt)(q, &w, KIND, K, a, m0, 4, tab, res); break;

/* res[t] = integer-kind row r . token (m0 + t)'s Q8 activation, t < nt (<= TB); K a multiple of 32; tab: K / 8 floats
 * of scratch */
static void SFX(qdot)(const qproj *q, const uint8_t *base, int64_t r, int64_t K, const qact *a, int64_t m0, int nt,
                      float *tab, float *res) {
    const qrow w = qrow_of(q, base, r, K);
    switch (8 * w.kind + nt) {
        QDOT_CASES(1) QDOT_CASES(2) QDOT_CASES(3) QDOT_CASES(5) QDOT_CASES(6) QDOT_CASES(7) QDOT_CASES(8)
    default: break;
    }
}
#undef QDOT_CASES

/* out[0:K] = row r decoded as the dot products read it, w = v * s + o in float32 (two roundings, no fma); tab: K / 8
 * floats of scratch */
static void SFX(dequant_row)(const qproj *q, const uint8_t *base, int64_t r, int64_t K, float *tab, float *out) {
    const qrow w = qrow_of(q, base, r, K);
    const int64_t kind = w.kind;
    float ss[16] __attribute__((aligned(32))), so[8] __attribute__((aligned(32)));
    if (kind <= 3) group_scales(q, &w, K, tab, tab + K / 16);
    for (int64_t c = 0; c < K / 32; c++) {
        const int j = (int)(c & 7);
        const uint8_t *b = w.d + (kind >= 6 ? BLOCK_BYTES[kind] * (c >> 3) : 34 * c);
        if (kind >= 6 && j == 0) SFX(kq_scales)(b, (int)kind, ss, so);
        SFX(cod) cv;
        float s[2], o[2] = {0.0f, 0.0f};
        if (kind >= 6) {
            cv = kind == 6 ? SFX(kq_codes)(b, 6, j) : kind == 7 ? SFX(kq_codes)(b, 7, j) : SFX(kq_codes)(b, 8, j);
            for (int i = 0; i < 2; i++) {
                s[i] = kind == 8 ? ss[2 * j + i] : ss[j];
                o[i] = kind == 8 ? 0.0f : so[j];
            }
        } else if (kind == 5) {
            cv = SFX(q8_0_codes)(b);
            s[0] = s[1] = F16(b);
        } else {
            cv = kind == 1 ? SFX(group_codes)(q, &w, 1, c) : kind == 2 ? SFX(group_codes)(q, &w, 2, c)
                                                                       : SFX(group_codes)(q, &w, 3, c);
            for (int i = 0; i < 2; i++) {
                s[i] = tab[2 * c + i];
                o[i] = tab[K / 16 + 2 * c + i];
            }
        }
        int8_t v[32];
        CODES_STORE(v, cv);
        for (int i = 0; i < 32; i++) {
            volatile float p = (float)v[i] * s[i / 16];
            out[32 * c + i] = p + o[i / 16];
        }
    }
}
#undef F16
#undef SV_ONE
#undef SV_TWO
#undef ACC_ZERO
#undef ACC_SUM
#undef CODES_STORE
#undef OFF8

/* fp8 e4m3 row r -> f[0:K] float32 (value times its group's scale); K and the group multiples of 8 */
static void SFX(decode_fp8)(const qproj *q, const uint8_t *base, int64_t r, int64_t K, float *f) {
    const int64_t g = q->group, G = K / g;
    const uint8_t *d = base + q->off_data + r * K;
    const float rs = row_scale(q, base, r);
    for (int64_t j = 0; j < G; j++) {
        const float s = load_scale(base + q->off_scales, r * G + j, q->sdtype) * rs;
#if ISA_LEVEL >= 1
        /* e4m3 -> float16 bits (sign to bit 15, exponent|mantissa << 7) = value * 2^-8; the 2^8 goes in the scale */
        const __m256 vs = _mm256_set1_ps(s * 256.0f);
        int64_t i = j * g;
#if ISA_LEVEL == 2
        for (; i + 16 <= (j + 1) * g; i += 16) {
            __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(d + i)));
            __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
            __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
            _mm512_storeu_ps(f + i, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sgn)), _mm512_set1_ps(s * 256.0f)));
        }
#endif
        for (; i < (j + 1) * g; i += 8) {
            __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(d + i)));
            __m128i mag = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7);
            __m128i sgn = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
            _mm256_storeu_ps(f + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sgn)), vs));
        }
#else
        for (int64_t i = j * g; i < (j + 1) * g; i++) f[i] = e4m3_lut[d[i]] * s;
#endif
    }
}

/* ---- rows [r0, r1) of one projection, dotted with nx tokens ------------------------------------------ */
/* y[t * ldy + r] = (row r . token t) * scale[t] (scale may be NULL); a: the tokens (float and, for integer kinds,
 * Q8), from token m0 of the activation on; f: K floats of scratch (an fp8 row decoded). Tokens go in tiles of TT, each
 * passed over by every row of the range, so a long step's activations are read from cache, not memory, per row. */
static void SFX(rows)(const qproj *q, const uint8_t *base, int64_t r0, int64_t r1, int64_t K, const act *a,
                      int64_t m0, int64_t nx, float *y, int64_t ldy, const float *scale, float *f) {
    float res[TB];
    const int fam = kind_family(q->kind);
    const float *x = a->x + m0 * a->ldx;
    for (int64_t tt = 0; tt < nx; tt += TT) {
        const int64_t te = tt + TT < nx ? tt + TT : nx;
#if ISA_LEVEL == 2
        if ((q->kind == 6 || q->kind == 5) && te - tt >= LANE_MIN) {  /* Q4_K, Q8_0: 16 tokens a pass, in lanes */
            for (int64_t t0 = tt; t0 < te; t0 += LANES) {
                const int n = (int)(te - t0 < LANES ? te - t0 : LANES);
                float *tile = f + K + (t0 - tt) / LANES * TILE_FLOATS(K);
                if (q->kind == 6) SFX(tile_q8k)(&a->q, K, m0 + t0, n, tile);
                else SFX(tile_q8)(&a->q, K, m0 + t0, n, tile);
            }
            SFX(tile_rows)(q, base, r0, r1, K, f + K, tt, te - tt, y, ldy, scale);
            continue;
        }
#endif
        int64_t r = r0;
#if ISA_LEVEL == 2
        if (q->kind == 6 && te - tt == 1 && K <= SHORT_ROW)   /* one token, short Q4_K rows: two at a time */
            for (; r + 1 < r1; r += 2) {
                const qrow w2[2] = {qrow_of(q, base, r, K), qrow_of(q, base, r + 1, K)};
                SFX(q4k_dot512)(w2, 2, K, &a->q, m0 + tt, 1, res);
                for (int i = 0; i < 2; i++) y[tt * ldy + r + i] = scale ? res[i] * scale[tt] : res[i];
            }
#endif
        for (; r < r1; r++) {
            if (q->kind == 4) SFX(decode_fp8)(q, base, r, K, f);
            for (int64_t t0 = tt; t0 < te; t0 += TB) {
                const int nt = (int)(te - t0 < TB ? te - t0 : TB);
                if (fam == FAM_INT) SFX(qdot)(q, base, r, K, &a->q, m0 + t0, nt, f, res);
                else if (q->kind == 4) SFX(fdot_f32)(f, x + t0 * a->ldx, a->ldx, nt, K, res);
                else if (q->kind == KIND_BF16)
                    SFX(fdot_bf16)((const uint16_t *)(base + q->off_data) + r * K, x + t0 * a->ldx, a->ldx, nt, K,
                                   res);
                else SFX(fdot_f32)((const float *)(base + q->off_data) + r * K, x + t0 * a->ldx, a->ldx, nt, K, res);
                for (int t = 0; t < nt; t++) y[(t0 + t) * ldy + r] = scale ? res[t] * scale[t0 + t] : res[t];
            }
        }
    }
}

