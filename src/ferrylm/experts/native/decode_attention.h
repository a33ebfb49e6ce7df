/* Decode attention over a paged KV pool, read in place, for one instruction set: included by expert_gemv.c after
 * isa_kernels.h (its SFX, ISA_LEVEL and vector macros). One task is a range of one sequence's positions, every
 * query head, ATT_CHUNK positions at a time (the next chunk's rows prefetched), with the running max / sum of the
 * online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). The entry point,
 * ferry_decode_attention, is compiled once, with the plain level. This is the vector macros' last user: it undefines
 * them at its end. */

#define ATT_CHUNK 32

#if ISA_LEVEL >= 1
/* e^x lane-wise for x <= 0 (x < -87 gives 0): x = n ln2 + r, e^r by its degree-6 Taylor polynomial (|r| <= ln2 / 2:
 * relative error < 2e-7), times 2^n through the exponent bits */
static inline SFX(vf) SFX(vexp)(SFX(vf) x) {
#if ISA_LEVEL == 2
    x = _mm512_max_ps(x, VSET1(-87.0f));
    const __m512 n = _mm512_roundscale_ps(VMUL(x, VSET1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
#else
    x = _mm256_max_ps(x, VSET1(-87.0f));
    const __m256 n = _mm256_round_ps(VMUL(x, VSET1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const SFX(vf) r = VFMA(n, VSET1(-0.693145752f), VFMA(n, VSET1(-1.42860677e-6f), x));
    SFX(vf) p = VSET1(1.0f / 720);
    const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = VFMA(p, r, VSET1(c[i]));
#if ISA_LEVEL == 2
    return VMUL(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                                           _mm512_set1_epi32(127)), 23)));
#else
    return VMUL(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                           _mm256_set1_epi32(127)), 23)));
#endif
}
#endif

/* s[j] = exp(s[j] - m) for j < n, in place; returns their sum */
static float SFX(exp_sum)(float *s, int n, float m) {
    float sum = 0.0f;
    int j = 0;
#if ISA_LEVEL >= 1
    SFX(vf) acc = VZERO();
    for (; j + VW <= n; j += VW) {
        const SFX(vf) p = SFX(vexp)(VADD(VLOAD(s + j), VSET1(-m)));
        VSTORE(s + j, p);
        acc = VADD(acc, p);
    }
    sum = VSUM(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

/* acc[0:d] = acc * c + sum_j p[j] * rows[j][0:d], j < n (rows float32 or bf16): each lane block of acc kept in a
 * register across the rows */
static void SFX(pv_rows)(float *acc, float c, const float *p, const char *const *rows, int n, int kv_bf16,
                         int64_t d) {
    int64_t i = 0;
#if ISA_LEVEL >= 1
    for (; i + VW <= d; i += VW) {
        SFX(vf) a = VMUL(VSET1(c), VLOAD(acc + i));
        for (int j = 0; j < n; j++)
            a = VFMA(VSET1(p[j]), kv_bf16 ? VLOAD_BF16((const uint16_t *)rows[j] + i)
                                          : VLOAD((const float *)rows[j] + i), a);
        VSTORE(acc + i, a);
    }
#endif
    for (; i < d; i++) {
        float a = acc[i] * c;
        for (int j = 0; j < n; j++)
            a += p[j] * (kv_bf16 ? bf16_to_f32(((const uint16_t *)rows[j])[i]) : ((const float *)rows[j])[i]);
        acc[i] = a;
    }
}

#if ISA_LEVEL == 2
/* the 16 sums of a[0..15] (each 16 lanes) as one register, lane j = sum of a[j]: a transpose-and-add tree */
static inline __m512 SFX(sum16)(__m512 *a) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

/* s[g * ATT_CHUNK + j] = scale * q_g . row j, 16 float32 rows (D % 16 == 0), every query head g < G */
static void SFX(qk16)(const float *q, const float *const *rows, int64_t G, int64_t D, float scale, float *s) {
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 qv = _mm512_loadu_ps(qg + i);
            for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[j] + i), acc[j]);
        }
        _mm512_storeu_ps(s + g * ATT_CHUNK, _mm512_mul_ps(SFX(sum16)(acc), _mm512_set1_ps(scale)));
    }
}
#endif

/* prefetch position slot's K and V rows (all KV heads: row_bytes each) */
static inline void SFX(prefetch_kv)(const void *k, const void *v, int64_t slot, int64_t row_bytes) {
#ifdef FERRY_X86
    for (int64_t o = 0; o < row_bytes; o += 64) {
        _mm_prefetch((const char *)k + slot * row_bytes + o, _MM_HINT_T0);
        _mm_prefetch((const char *)v + slot * row_bytes + o, _MM_HINT_T0);
    }
#else
    (void)k;
    (void)v;
    (void)slot;
    (void)row_bytes;
#endif
}

/* s[g * ATT_CHUNK + j] = scale * q_g . key row j (rows kr[0:c], g < G), 16 rows at a time where the ISA has it */
static void SFX(scores)(const float *q, const char *const *kr, int c, int kv_bf16, int64_t G, int64_t D, float scale,
                        float *s) {
    int jd = 0;
#if ISA_LEVEL == 2
    if (!kv_bf16 && D % 16 == 0)
        for (; jd + 16 <= c; jd += 16) SFX(qk16)(q, (const float *const *)(kr + jd), G, D, scale, s + jd);
#endif
    for (int j = jd; j < c; j++) {
        float dots[TB];
        for (int64_t g = 0; g < G; g += TB) {  /* TB query heads a pass over the key row */
            const int nt = (int)(G - g < TB ? G - g : TB);
            if (kv_bf16) SFX(fdot_bf16)((const uint16_t *)kr[j], q + g * D, D, nt, D, dots);
            else SFX(fdot_f32)((const float *)kr[j], q + g * D, D, nt, D, dots);
            for (int t = 0; t < nt; t++) s[(g + t) * ATT_CHUNK + j] = dots[t] * scale;
        }
    }
}

/* One task: a sequence's Hq = hkv * G query heads q [Hq, D] against its positions [j0, j1) (pool rows slots[j]),
 * every KV head, CHUNK positions at a time (a position's K (V) rows of all heads lie together: read in order).
 * Leaves the online softmax's state: m [Hq] (running max), l [Hq] (sum of e^(s - m)), acc [Hq, D] (sum of
 * e^(s - m) v); scratch s: G * ATT_CHUNK floats. */
static void SFX(attend_range)(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *slots,
                               int64_t j0, int64_t j1, int64_t hkv, int64_t G, int64_t D, float scale, float *m,
                               float *l, float *acc, float *s) {
    const int64_t es = kv_bf16 ? 2 : 4, hb = D * es, row = hkv * hb;
    for (int64_t i = 0; i < hkv * G; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(hkv * G * D));
    for (int64_t c0 = j0; c0 < j1; c0 += ATT_CHUNK) {
        const int c = (int)(j1 - c0 < ATT_CHUNK ? j1 - c0 : ATT_CHUNK);
        for (int j = 0; j < c && c0 + ATT_CHUNK + j < j1; j++) SFX(prefetch_kv)(k, v, slots[c0 + ATT_CHUNK + j], row);
        for (int64_t h = 0; h < hkv; h++) {
            const char *kr[ATT_CHUNK], *vr[ATT_CHUNK];
            for (int j = 0; j < c; j++) {
                kr[j] = (const char *)k + slots[c0 + j] * row + h * hb;
                vr[j] = (const char *)v + slots[c0 + j] * row + h * hb;
            }
            const float *qh = q + h * G * D;
            SFX(scores)(qh, kr, c, kv_bf16, G, D, scale, s);
            for (int64_t g = 0; g < G; g++) {
                const int64_t i = h * G + g;
                float *sg = s + g * ATT_CHUNK, mx = m[i];
                for (int j = 0; j < c; j++) mx = sg[j] > mx ? sg[j] : mx;
                const float corr = expf(m[i] - mx);  /* 0 on the first chunk (m = -inf) */
                l[i] = l[i] * corr + SFX(exp_sum)(sg, c, mx);
                m[i] = mx;
                SFX(pv_rows)(acc + i * D, corr, sg, vr, c, kv_bf16, D);
            }
        }
    }
}

#if ISA_LEVEL == 0  /* the entry point, once: the plain level is included last, after the vector ones */
typedef void (*attend_fn)(const float *, const void *, const void *, int, const int64_t *, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float *, float *, float *, float *);
#ifdef FERRY_X86
static const attend_fn ATTEND[3] = {attend_range_c, attend_range_avx2, attend_range_avx512};
#else
static const attend_fn ATTEND[3] = {attend_range_c, NULL, NULL};
#endif
static int isa_ok(int isa);

/* Decode attention over a paged KV pool (decode_attention.h), read in place: out [B, Hq, D] float32 = per sequence b
 * softmax(scale * q_b k^T) v over its lens[b] positions, whose pool rows are slots[b * lds : b * lds + lens[b]];
 * q [B, Hq, D] float32; pools k, v [S, Hkv, D] float32 (kv_bf16 0) or bf16 (1); Hq a multiple of Hkv (GQA: query
 * head i reads KV head i / (Hq / Hkv)). A sequence's positions are split into parts of at least ATT_PART (enough
 * parts for the threads when the batch is small), each part a task; the parts' softmax states are merged
 * (flash-decoding). */
#define ATT_PART 64
int ferry_decode_attention(int isa, int nthreads, const float *q, const void *k, const void *v, int kv_bf16,
                           const int64_t *slots, int64_t lds, const int64_t *lens, int64_t B, int64_t Hq, int64_t Hkv,
                           int64_t D, float scale, float *out) {
    if (B <= 0 || Hkv <= 0 || Hq <= 0 || Hq % Hkv || D <= 0 || nthreads < 1 || (kv_bf16 != 0 && kv_bf16 != 1))
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > lds) return -1;
    if (!isa_ok(isa)) return -2;
    const int64_t G = Hq / Hkv, want = (2 * nthreads + B - 1) / B;  /* parts per sequence wanted */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));  /* each sequence's first task */
    if (!first) return -3;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t most = (lens[b] + ATT_PART - 1) / ATT_PART;
        first[b + 1] = first[b] + (want < most ? want : most);
    }
    const int64_t ntask = first[B], state = Hq * (D + 2);
    float *part = (float *)malloc(sizeof(float) * (size_t)(ntask * state));
    float *work = (float *)malloc(sizeof(float) * (size_t)(G * ATT_CHUNK * nthreads));
    if (!part || !work) {
        free(first);
        free(part);
        free(work);
        return -3;
    }
    const attend_fn attend = ATTEND[isa];
#pragma omp parallel num_threads(nthreads)
    {
        float *s = work + G * ATT_CHUNK * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntask; t++) {
            int64_t b = 0;
            while (first[b + 1] <= t) b++;
            const int64_t np = first[b + 1] - first[b], p = t - first[b];
            const int64_t j0 = lens[b] * p / np, j1 = lens[b] * (p + 1) / np;
            float *st = part + t * state;
            attend(q + b * Hq * D, k, v, kv_bf16, slots + b * lds, j0, j1, Hkv, G, D, scale, st, st + Hq,
                   st + 2 * Hq, s);
        }
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < B * Hq; bi++) {  /* merge the parts of (sequence b, query head i) */
            const int64_t b = bi / Hq, i = bi % Hq;
            float mx = -INFINITY, l = 0.0f, *o = out + bi * D;
            for (int64_t t = first[b]; t < first[b + 1]; t++) mx = part[t * state + i] > mx ? part[t * state + i] : mx;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int64_t t = first[b]; t < first[b + 1]; t++) {
                const float *st = part + t * state, w = expf(st[i] - mx);
                l += st[Hq + i] * w;
                for (int64_t d = 0; d < D; d++) o[d] += st[2 * Hq + i * D + d] * w;
            }
            for (int64_t d = 0; d < D; d++) o[d] = l > 0.0f ? o[d] / l : 0.0f;
        }
    }
    free(first);
    free(part);
    free(work);
    return 0;
}
#endif

#undef VW
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VSUM
#undef VSTORE
#undef VSET1
#undef VADD
#undef VMUL
#undef VLOAD_BF16
