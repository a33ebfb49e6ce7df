/* Row kernels of one instruction set, included once per set by expert_gemv.c, which defines before including:
 *   SFX(name)  the name with the set's suffix (name##_avx512, name##_avx2, name##_c)
 *   ISA_LEVEL  2: AVX-512 F/BW/VL/VNNI, 1: AVX2 + FMA + F16C, 0: plain C
 * and compiles the include under that target (so -O3 auto-vectorizes the plain loops for it too).
 *
 * Integer kinds (int4, int8, fp4, Q8_0, Q4_K, Q5_K, Q6_K): a weight row is decoded into a rowbuf (int8 values v,
 * a float32 scale and offset per 16 inputs: w = v * s + o), then dotted with every token's Q8 activation (int8
 * codes, a float32 scale per 32 inputs, float32 sums per 16): sum_16 (v * xq) in int32, times s * dx, plus
 * o * sum_16(x). Float kinds (bf16, f32, fp8): float32 activations; fp8 rows decoded to float32 first.
 */

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
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
    _mm256_loadu_si256((const __m256i *)(p))), 16))
#elif ISA_LEVEL == 1
#define VW 8
typedef __m256 SFX(vf);
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSUM(v) SFX(hsum8)(v)
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

/* res[t] = decoded row rb . token (m0 + t)'s Q8 activation without the offsets, t < NT; inlined per constant NT
 * so the accumulators stay in registers */
static inline __attribute__((always_inline)) void SFX(idot_nt)(const rowbuf *rb, int64_t K, const qact *a,
                                                                  int64_t m0, const int NT, float *res) {
    const int64_t nc = K / 32;
#if ISA_LEVEL >= 1
    __m256 acc[TB];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(rb->v + 32 * c)), av = _mm256_abs_epi8(v);
        const __m256 sw = _mm256_loadu_ps(rb->sx + 8 * c);  /* lanes 0-3: the first 16 inputs' scale */
        for (int t = 0; t < NT; t++) {
            const int64_t m = m0 + t;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + 32 * c));
            const __m256i p = SFX(dot4)(av, _mm256_sign_epi8(xq, v));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sw, _mm256_set1_ps(a->d[m * nc + c])),
                                     acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) res[t] = SFX(hsum8)(acc[t]);
#else
    for (int t = 0; t < NT; t++) {
        const int64_t m = m0 + t;
        float s = 0.0f;
        for (int64_t h = 0; h < 2 * nc; h++) {
            int32_t acc = 0;
            for (int i = 0; i < 16; i++) acc += (int32_t)rb->v[16 * h + i] * a->q[m * K + 16 * h + i];
            s += (float)acc * (rb->sx[4 * h] * a->d[m * nc + h / 2]);
        }
        res[t] = s;
    }
#endif
}

/* res[t] = decoded row rb . token (m0 + t)'s Q8 activation, t < nt (<= TB); K a multiple of 32 */
static void SFX(idot)(const rowbuf *rb, int64_t K, const qact *a, int64_t m0, int nt, float *res) {
    switch (nt) {
    case 1: SFX(idot_nt)(rb, K, a, m0, 1, res); break;
    case 2: SFX(idot_nt)(rb, K, a, m0, 2, res); break;
    case 3: SFX(idot_nt)(rb, K, a, m0, 3, res); break;
    default: SFX(idot_nt)(rb, K, a, m0, 4, res); break;
    }
    float off[TB];
    SFX(fdot_f32)(rb->o, a->s16 + m0 * (K / 16), K / 16, nt, K / 16, off);
    for (int t = 0; t < nt; t++) res[t] += off[t];
}

/* ---- decoders: one weight row -> rowbuf (integer kinds) or float32 (fp8) --------------------------------- */
#if ISA_LEVEL >= 1
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
#endif

static void SFX(decode_q8_0)(const uint8_t *d, int64_t K, rowbuf *rb) {
    for (int64_t b = 0; b < K / 32; b++, d += 34) {
        const float s = f16_at(d);
        memcpy(rb->v + 32 * b, d + 2, 32);
        put_scale(rb, 2 * b, s, 0.0f);
        put_scale(rb, 2 * b + 1, s, 0.0f);
    }
}

/* Q4_K (kind 6) or Q5_K (kind 7): 8 sub-blocks of 32, w = d * sc * q - dmin * mn */
static void SFX(decode_q45_k)(int64_t kind, const uint8_t *d, int64_t K, rowbuf *rb) {
    const int64_t bb = kind == 6 ? 144 : 176;
    for (int64_t b = 0; b < K / 256; b++, d += bb) {
        const float dd = f16_at(d), dmin = f16_at(d + 2);
        const uint8_t *qs = d + (kind == 6 ? 16 : 48), *qh = d + 16;
        int8_t *v = rb->v + 256 * b;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(d + 4, j, &sc, &mn);
            put_scale(rb, 16 * b + 2 * j, dd * (float)sc, -(dmin * (float)mn));
            put_scale(rb, 16 * b + 2 * j + 1, dd * (float)sc, -(dmin * (float)mn));
            const uint8_t *c = qs + 32 * (j >> 1);
            const int shift = 4 * (j & 1);
#if ISA_LEVEL >= 1
            __m256i q = SFX(bits32)(c, shift, 15);
            if (kind == 7) q = _mm256_or_si256(q, _mm256_slli_epi16(SFX(bits32)(qh, j, 1), 4));
            _mm256_storeu_si256((__m256i *)(v + 32 * j), q);
#else
            for (int l = 0; l < 32; l++) v[32 * j + l] = (int8_t)((c[l] >> shift) & 15);
            if (kind == 7)
                for (int l = 0; l < 32; l++) v[32 * j + l] |= (int8_t)(((qh[l] >> j) & 1) << 4);
#endif
        }
    }
}

/* Q6_K: 32-input chunk c: low 4 bits from ql, high 2 from qh, minus 32; an int8 scale per 16 times d */
static void SFX(decode_q6_k)(const uint8_t *d, int64_t K, rowbuf *rb) {
    for (int64_t b = 0; b < K / 256; b++, d += 210) {
        const float dd = f16_at(d + 208);
        int8_t *v = rb->v + 256 * b;
        for (int c = 0; c < 8; c++) {
            const int h = c >> 2, q = c & 3;
            const uint8_t *ql = d + 64 * h + 32 * (q & 1), *qh = d + 128 + 32 * h;
#if ISA_LEVEL >= 1
            const __m256i lo = SFX(bits32)(ql, 4 * (q >> 1), 15), hi = SFX(bits32)(qh, 2 * q, 3);
            _mm256_storeu_si256((__m256i *)(v + 32 * c), _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                                                                         _mm256_set1_epi8(32)));
#else
            for (int l = 0; l < 32; l++)
                v[32 * c + l] = (int8_t)((((ql[l] >> (4 * (q >> 1))) & 15) | (((qh[l] >> (2 * q)) & 3) << 4)) - 32);
#endif
        }
        for (int s = 0; s < 16; s++) put_scale(rb, 16 * b + s, dd * (float)(int8_t)d[192 + s], 0.0f);
    }
}

/* int4 / fp4 (two codes a byte) and int8 rows with a scale (and min) per group of q->group inputs */
static void SFX(decode_group)(const qproj *q, const uint8_t *base, int64_t r, int64_t K, rowbuf *rb) {
    const int64_t g = q->group, G = K / g, four = q->kind == 1 || q->kind == 3;
    const uint8_t *d = base + q->off_data + r * (four ? K / 2 : K);
    const float rs = row_scale(q, base, r) * (q->kind == 3 ? 0.5f : 1.0f);  /* fp4: v holds 2 * e2m1 */
    for (int64_t j = 0; j < G; j++) {
        const float s = load_scale(base + q->off_scales, r * G + j, q->sdtype) * rs;
        const float m = q->has_mins ? load_scale(base + q->off_mins, r * G + j, q->sdtype) : 0.0f;
        const float o = q->kind == 2 && q->has_mins ? 128.0f * s - m : -m;
        for (int64_t h = 0; h < g / 16; h++) put_scale(rb, (j * g) / 16 + h, s, o);
    }
    int8_t *v = rb->v;
    if (q->kind == 2) {
        for (int64_t i = 0; i < K; i++) v[i] = (int8_t)(d[i] ^ 0x80);  /* u - 128 */
        return;
    }
#if ISA_LEVEL >= 1
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2));
    const __m256i z = _mm256_set1_epi8(q->has_mins ? 0 : 8);
    for (int64_t i = 0; i < K; i += 32) {
        const __m256i u = SFX(nibbles32)(d + i / 2);
        _mm256_storeu_si256((__m256i *)(v + i), q->kind == 3 ? _mm256_shuffle_epi8(lut, u) : _mm256_sub_epi8(u, z));
    }
#else
    const int8_t z = q->has_mins ? 0 : 8;
    for (int64_t i = 0; i < K / 2; i++) {
        v[2 * i] = q->kind == 3 ? E2M1_X2[d[i] & 15] : (int8_t)((d[i] & 15) - z);
        v[2 * i + 1] = q->kind == 3 ? E2M1_X2[d[i] >> 4] : (int8_t)((d[i] >> 4) - z);
    }
#endif
}

static void SFX(decode_row)(const qproj *q, const uint8_t *base, int64_t r, int64_t K, rowbuf *rb) {
    int64_t kind = q->kind;
    const uint8_t *d = base + q->off_data;
    if (kind == 9) {  /* kmix: this expert's kind from its tag byte, rows padded to the widest kind */
        kind = base[q->off_scales];
        d += r * (K / 256) * BLOCK_BYTES[q->sdtype];
    } else if (kind >= 5) {
        d += r * (K / q->group) * BLOCK_BYTES[kind];
    }
    if (kind == 5) SFX(decode_q8_0)(d, K, rb);
    else if (kind == 6 || kind == 7) SFX(decode_q45_k)(kind, d, K, rb);
    else if (kind == 8) SFX(decode_q6_k)(d, K, rb);
    else SFX(decode_group)(q, base, r, K, rb);
}

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
 * Q8), from token m0 of the activation on. */
static void SFX(rows)(const qproj *q, const uint8_t *base, int64_t r0, int64_t r1, int64_t K, const act *a,
                      int64_t m0, int64_t nx, float *y, int64_t ldy, const float *scale, rowbuf *rb) {
    float res[TB];
    const int fam = kind_family(q->kind);
    const float *x = a->x + m0 * a->ldx;
    for (int64_t r = r0; r < r1; r++) {
        if (fam == FAM_INT) SFX(decode_row)(q, base, r, K, rb);
        else if (q->kind == 4) SFX(decode_fp8)(q, base, r, K, rb->f);
        for (int64_t t0 = 0; t0 < nx; t0 += TB) {
            const int nt = (int)(nx - t0 < TB ? nx - t0 : TB);
            if (fam == FAM_INT) SFX(idot)(rb, K, &a->q, m0 + t0, nt, res);
            else if (q->kind == 4) SFX(fdot_f32)(rb->f, x + t0 * a->ldx, a->ldx, nt, K, res);
            else if (q->kind == KIND_BF16)
                SFX(fdot_bf16)((const uint16_t *)(base + q->off_data) + r * K, x + t0 * a->ldx, a->ldx, nt, K, res);
            else SFX(fdot_f32)((const float *)(base + q->off_data) + r * K, x + t0 * a->ldx, a->ldx, nt, K, res);
            for (int t = 0; t < nt; t++) y[(t0 + t) * ldy + r] = scale ? res[t] * scale[t0 + t] : res[t];
        }
    }
}

#undef VW
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VSUM
#undef VLOAD_BF16
