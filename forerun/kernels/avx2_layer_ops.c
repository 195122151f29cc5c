/* forerun's native per-position operations of a decoder layer, for x86-64
 * CPUs with AVX2 and FMA: RMSNorm, SiLU- and GELU-gated products, and RoPE
 * with the KV-cache write and attention in one call.
 *
 * Why: at batch size 1 a layer's matrices take a few hundred microseconds,
 * while torch spends 2 to 5 microseconds dispatching each of the ~70 small
 * operators around them (views, casts, RoPE's halves, softmax's parts), a
 * quarter of a small model's decoding step.  These run the same arithmetic
 * in one call each, on float32 values.
 *
 * Row invariance: every output row (a position; for attention, a position
 * and a head) is computed by the same instructions in the same order
 * whatever the number of rows and the thread count: rows are never summed
 * together, and a row's sums run in a fixed order.  So a position's result
 * is bit-identical whether it is fed alone or with others.
 */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x lane by lane (Cephes' polynomial; relative error about 2e-7), for a
 * register type V (__m256 or __m512) whose intrinsics start with P and
 * whose integer cast names SI bits: each lane the same float in either.
 * Inputs are clamped to [-87.3, 88.3]; e^-87.3 is 1e-38. */
#define DEFINE_EXP(NAME, V, P, SI)                                                             \
    static inline V NAME(V x) {                                                                \
        x = P##_min_ps(x, P##_set1_ps(88.3762626647949f));                                     \
        x = P##_max_ps(x, P##_set1_ps(-87.33654475f));                                         \
        V fx = P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(0.5f));          \
        fx = P##_floor_ps(fx);                                                                 \
        x = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                   \
        x = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), x);                                \
        V y = P##_set1_ps(1.9875691500e-4f);                                                   \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                 \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                 \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)));               \
        V##i e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(fx), P##_set1_epi32(127)), 23);  \
        return P##_mul_ps(y, P##_castsi##SI##_ps(e));                                          \
    }
DEFINE_EXP(exp8, __m256, _mm256, 256)

static inline float exp1(float x) {
    float v[8] = {x}, r[8];
    _mm256_storeu_ps(r, exp8(_mm256_loadu_ps(v)));
    return r[0];
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), x and y [T, H]. */
void fr_rms_norm(const float *x, int T, int H, const float *w, float eps, float *y) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * H;
        float *yr = y + (size_t)t * H;
        const float r = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        const __m256 vr = _mm256_set1_ps(r);
        int i = 0;
        for (; i + 8 <= H; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                   _mm256_mul_ps(_mm256_loadu_ps(xr + i), vr)));
        for (; i < H; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* y[t, i] = silu(gu[t, i]) * gu[t, I + i], gu [T, 2I], y [T, I]. */
void fr_silu_mul(const float *gu, int T, int I, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I, *u = g + I;
        float *yr = y + (size_t)t * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(
                _mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) yr[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* y[t, i] = gelu(gu[t, i]) * gu[t, I + i] with the tanh GELU (Gemma's
 * GeGLU), gu [T, 2I], y [T, I].  0.5 g (1 + tanh u) is written as
 * g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): SiLU's form, on
 * the same exponential, with no cancellation (e^(-2u) is clamped: a
 * large positive g gives g, a large negative one about g e^-88). */
void fr_gelu_tanh_mul(const float *gu, int T, int I, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), cubic = _mm256_set1_ps(0.044715f);
    const __m256 scale = _mm256_set1_ps(-1.5957691216057308f);   /* -2 sqrt(2 / pi) */
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I, *u = g + I;
        float *yr = y + (size_t)t * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(cubic, _mm256_mul_ps(gv, gv)),
                                                 gv, gv);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_mul_ps(scale,
                                                                                     inner))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            const float inner = fmaf(0.044715f * (g[i] * g[i]), g[i], g[i]);
            yr[i] = g[i] / (1.0f + exp1(-1.5957691216057308f * inner)) * u[i];
        }
    }
}

/* Rotates one head's D values in place by the angles of cos/sin [D]
 * (the Hugging Face layout: the first half pairs with the second). */
static void rotate(float *x, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Attention's sums in small register blocks.  Each score and each output
 * value is summed by the same instructions in the same order as one
 * position and one head alone, slot by slot, would sum it (a key's
 * products in 8-float pieces, in order, into one register, then across it;
 * an output's terms slot by slot, in slot order): the blocks only choose
 * which sums run side by side and which loads they share.  So the results
 * do not depend on the blocking, on the number of rows fed, or on which
 * other rows share a block.
 *
 * A block of keys that a row sees whole runs as qk_four: 2 heads and 4
 * keys, 8 sums in registers, whose horizontal sums (hsum8's additions in
 * hsum8's order) are taken all at once: hsum8 alone spends three shuffles
 * a score, on a port the FMAs need.  On an AMD EPYC Zen 3 (2 threads)
 * this took a 128-row block's attention after 384 to 3,968 tokens to 0.64
 * to 0.92 of the time of 3 heads by 3 keys with hsum8 each, and one row's
 * after 1,536 and 4,096 tokens to 0.72 to 0.86 (the 1.5B's, the 0.5B's
 * and Gemma 3 270M's heads), the results the same to the bit. */
#define QK_HEADS 3    /* query heads whose scores one qk_block sums */
#define QK_SLOTS 4    /* keys one block reads */
#define QK_AHEAD 24   /* slots ahead of a block whose keys it asks for */
/* Where the keys and values read ahead go: the L2 cache (T1), not the L1
 * (T0).  On an AMD EPYC Zen 4 (2 threads, the 28 layers' caches of a 1.5B,
 * one row, alternated) T0 read the cache at 10 to 15 GB/s, the attention's
 * arithmetic and its reads taking turns, and T1 at 17 to 23: one row's
 * attention after 1,536 tokens in 0.62 to 0.91 of the time (median 0.66),
 * after 4,000 in 0.65, after 512 in 0.80; within a whole step of the model
 * (benchmarks/attention_ab.py) in 0.82, and 8 rows' in 0.91.  Reading 2 to
 * 5 times further ahead with T0 changed nothing. */
#define CACHE_AHEAD _MM_HINT_T1
#define PV_HEADS 2    /* heads whose outputs one block sums */
#define PV_CHUNKS 4   /* 8-float pieces of each output one block keeps in registers */
#define PV_SLOTS 16   /* slots whose values one pass over the outputs adds */
/* A chunk of WIDE_ROWS rows or more (a prompt block, a verification) sums
 * its values in wider blocks: more heads, fewer pieces, more slots a pass.
 * The outputs' sums run in the same order either way (slot by slot), so the
 * results are the same to the bit; the wide blocks share each value's load
 * between 6 heads, where a single row's step, which reads its values from
 * memory once, ran no faster with them (an AMD EPYC Zen 3, 2 threads, the
 * 28 layers of a 1.5B after 1,024 tokens: a prompt block of 128 rows in
 * 0.82 to 0.87 of the time, one row 0.97 to 1.01). */
#define PV_WIDE_HEADS 6
#define PV_WIDE_CHUNKS 2
#define PV_WIDE_SLOTS 32
#define WIDE_ROWS 4
#define ROWS 16       /* rows that share their reads of the cache */

static inline int imin(int a, int b) { return a < b ? a : b; }

/* The cache holds float32 keys and values, or float16 ones (half != 0):
 * half the bytes for a step to read, each converted to float32 exactly as
 * it is read (a float16 is a float32 too), so the arithmetic is the same
 * whichever it holds.  A compile-time constant in every inlined caller:
 * each of fr_attention's two paths is compiled for its own. */
#define ALWAYS static inline __attribute__((always_inline))
ALWAYS __m256 load8(const void *p, size_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}
ALWAYS float load1(const void *p, size_t i, int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
/* Element i of a cache row's keys or values. */
ALWAYS const void *at(const void *p, size_t i, int half) {
    return (const char *)p + (half ? 2 : 4) * i;
}
/* n floats of src into a cache: copied, or rounded to the nearest float16
 * (ties to even, as torch's conversion rounds). */
static void store(void *dst, const float *src, int n, int half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = dst;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* s[h * stride + j] = (q_h . k_j) * scale for NH heads q_h = q + h D and
 * NS consecutive cache rows k_j = k + j D. */
ALWAYS void qk_block(const float *q, const void *k, int D, int NH, int NS, float scale,
                     float *s, int stride, int half) {
    __m256 acc[QK_HEADS][QK_SLOTS];
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < NS; j++) acc[h][j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= D; i += 8) {
        __m256 kv[QK_SLOTS];
        for (int j = 0; j < NS; j++) kv[j] = load8(k, (size_t)j * D + i, half);
        for (int h = 0; h < NH; h++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)h * D + i);
            for (int j = 0; j < NS; j++) acc[h][j] = _mm256_fmadd_ps(qv, kv[j], acc[h][j]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < NS; j++) {
            float sum = hsum8(acc[h][j]);
            for (int r = i; r < D; r++)   /* (an fma in either cache's code) */
                sum = fmaf(q[(size_t)h * D + r], load1(k, (size_t)j * D + r, half), sum);
            s[(size_t)h * stride + j] = sum * scale;
        }
}

ALWAYS void qk_sums(const float *q, const void *k, int D, int nh, int ns, float scale, float *s,
                   int stride, int half) {
#define QK(NH, NS) case NH * 8 + NS: qk_block(q, k, D, NH, NS, scale, s, stride, half); break;
    switch (nh * 8 + ns) {
        QK(1, 1) QK(1, 2) QK(1, 3) QK(1, 4) QK(2, 1) QK(2, 2) QK(2, 3) QK(2, 4)
        QK(3, 1) QK(3, 2) QK(3, 3) QK(3, 4)
    }
#undef QK
}

/* The horizontal sums of 8 registers, lane i of the result r[i]'s: each
 * summed as hsum8 sums it, the same additions of the same values ((v0 + v4)
 * + (v2 + v6), (v1 + v5) + (v3 + v7), then those two), so the same floats,
 * with a few shuffles for all 8 where hsum8 takes three for each. */
static inline __m256 hsum8x8(const __m256 r[8]) {
    /* v_i + v_(i+4): [r0 | r4], [r1 | r5], [r2 | r6], [r3 | r7] */
    const __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(r[0], r[4], 0x20),
                                   _mm256_permute2f128_ps(r[0], r[4], 0x31));
    const __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(r[1], r[5], 0x20),
                                   _mm256_permute2f128_ps(r[1], r[5], 0x31));
    const __m256 c = _mm256_add_ps(_mm256_permute2f128_ps(r[2], r[6], 0x20),
                                   _mm256_permute2f128_ps(r[2], r[6], 0x31));
    const __m256 d = _mm256_add_ps(_mm256_permute2f128_ps(r[3], r[7], 0x20),
                                   _mm256_permute2f128_ps(r[3], r[7], 0x31));
    /* (s0 + s2), (s1 + s3): [r0 r0 r1 r1 | r4 r4 r5 r5], [r2 r2 r3 r3 | r6 r6 r7 r7] */
    const __m256 ab = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
    const __m256 cd = _mm256_add_ps(_mm256_shuffle_ps(c, d, 0x44), _mm256_shuffle_ps(c, d, 0xEE));
    return _mm256_hadd_ps(ab, cd);     /* [r0 r1 r2 r3 | r4 r5 r6 r7] */
}

/* qk_block for NH (1 or 2) heads and 4 keys, D a multiple of 8: each
 * score's products summed into its register as qk_block sums them, then
 * all the sums at once (hsum8x8), the same floats to the bit. */
ALWAYS void qk_four(const float *q, const void *k, int D, int NH, float scale, float *s,
                   int stride, int half) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m256 k0 = load8(k, i, half), k1 = load8(k, (size_t)D + i, half),
                     k2 = load8(k, 2 * (size_t)D + i, half),
                     k3 = load8(k, 3 * (size_t)D + i, half);
        for (int h = 0; h < NH; h++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)h * D + i);
            acc[4 * h] = _mm256_fmadd_ps(qv, k0, acc[4 * h]);
            acc[4 * h + 1] = _mm256_fmadd_ps(qv, k1, acc[4 * h + 1]);
            acc[4 * h + 2] = _mm256_fmadd_ps(qv, k2, acc[4 * h + 2]);
            acc[4 * h + 3] = _mm256_fmadd_ps(qv, k3, acc[4 * h + 3]);
        }
    }
    const __m256 sums = _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale));
    _mm_storeu_ps(s, _mm256_castps256_ps128(sums));
    if (NH == 2) _mm_storeu_ps(s + stride, _mm256_extractf128_ps(sums, 1));
}

#if defined(__AVX512F__) && !defined(FR_NO_WIDE)
/* 512-bit passes (the AVX512-VNNI and AMX builds), with the AVX2 build's
 * results to the bit: each 8-float half of a register runs what one
 * 256-bit register runs, in the same order.  A score's half pairs two query
 * heads over one key (the key's 8 floats in both halves, the two heads'
 * queries side by side: pack_pairs), summed across each half as hsum8 sums
 * it (hsum8x16); an output's 16 floats are 16 sums, each slot by slot in
 * slot order, as two 8-float pieces are.  Twice the multiply-adds an
 * instruction where the CPU runs 512-bit FMAs whole, and a key read once
 * for 6 heads rather than once for 2. */
#define ATTENTION_512 1
#define QK_PAIRS 3        /* head pairs one qk_pairs block sums (6 heads) */
#define PV16_CHUNKS 4     /* 16-float pieces of each output one pv_block16 keeps */
#define PV16_WIDE_CHUNKS 4 /* the same for WIDE_ROWS rows or more */

/* The 8 floats of a cache row at element i, in both halves. */
ALWAYS __m512 load8x2(const void *p, size_t i, int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))));
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(
        _mm256_castps_pd(_mm256_loadu_ps((const float *)p + i))));
}

/* The 16 floats of a cache row at element i. */
ALWAYS __m512 load16(const void *p, size_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* exp8 on 16 floats: each lane the same float as exp8's. */
DEFINE_EXP(exp16, __m512, _mm512, 512)

/* nh heads' queries q (q_h = q + h D, D a multiple of 8) as pairs for
 * qk_pairs: pair p's piece c (16 floats at qp + 2 p D + 16 c) is q_2p's 8
 * floats from 8 c, then q_2p+1's.  An odd last head is left out. */
static void pack_pairs(const float *q, int nh, int D, float *qp) {
    for (int p = 0; p + 1 < nh; p += 2)
        for (int i = 0; i < D; i += 8) {
            _mm256_storeu_ps(qp + (size_t)p * D + 2 * i, _mm256_loadu_ps(q + (size_t)p * D + i));
            _mm256_storeu_ps(qp + (size_t)p * D + 2 * i + 8,
                             _mm256_loadu_ps(q + (size_t)(p + 1) * D + i));
        }
}

/* hsum8x8 for 8 registers of two 8-float halves each: every half summed as
 * hsum8 sums it (lane i with i + 4, then lanes 0 + 2 and 1 + 3, then those
 * two), the 16 sums as [r0a r1a r2a r3a | r0b r1b r2b r3b | r4a r5a r6a r7a |
 * r4b r5b r6b r7b], where r_k a and r_k b are r[k]'s low and high halves'. */
static inline __m512 hsum8x16(const __m512 r[8]) {
    /* v_i + v_(i+4) of each half: quarters [r0a r0b r4a r4b], ... */
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[4], 0x88),
                                   _mm512_shuffle_f32x4(r[0], r[4], 0xDD));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(r[1], r[5], 0x88),
                                   _mm512_shuffle_f32x4(r[1], r[5], 0xDD));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[6], 0x88),
                                   _mm512_shuffle_f32x4(r[2], r[6], 0xDD));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(r[3], r[7], 0x88),
                                   _mm512_shuffle_f32x4(r[3], r[7], 0xDD));
    /* (s0 + s2), (s1 + s3) within each quarter, then their sum (hadd's). */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x44), _mm512_shuffle_ps(c, d, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xDD));
}

/* qk_four for 2 NP heads (NP pairs of pack_pairs, at most QK_PAIRS) and 4
 * keys, D a multiple of 8: the same floats to the bit. */
ALWAYS void qk_pairs(const float *qp, const void *k, int D, int NP, float scale, float *s,
                    int stride, int half) {
    __m512 acc[4 * QK_PAIRS + 4];
    for (int a = 0; a < 4 * QK_PAIRS + 4; a++) acc[a] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m512 k0 = load8x2(k, i, half), k1 = load8x2(k, (size_t)D + i, half),
                     k2 = load8x2(k, 2 * (size_t)D + i, half),
                     k3 = load8x2(k, 3 * (size_t)D + i, half);
        for (int p = 0; p < NP; p++) {
            const __m512 qv = _mm512_loadu_ps(qp + (size_t)p * 2 * D + 2 * i);
            acc[4 * p] = _mm512_fmadd_ps(qv, k0, acc[4 * p]);
            acc[4 * p + 1] = _mm512_fmadd_ps(qv, k1, acc[4 * p + 1]);
            acc[4 * p + 2] = _mm512_fmadd_ps(qv, k2, acc[4 * p + 2]);
            acc[4 * p + 3] = _mm512_fmadd_ps(qv, k3, acc[4 * p + 3]);
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int p = 0; p < NP; p += 2) {
        /* heads 2p .. 2p+3 (2p+2 and 2p+3 only where pair p+1 is there) */
        const __m512 sums = _mm512_mul_ps(hsum8x16(acc + 4 * p), vs);
        float *o = s + (size_t)(2 * p) * stride;
        _mm_storeu_ps(o, _mm512_castps512_ps128(sums));
        _mm_storeu_ps(o + stride, _mm512_extractf32x4_ps(sums, 1));
        if (p + 1 < NP) {
            _mm_storeu_ps(o + 2 * (size_t)stride, _mm512_extractf32x4_ps(sums, 2));
            _mm_storeu_ps(o + 3 * (size_t)stride, _mm512_extractf32x4_ps(sums, 3));
        }
    }
}

/* pv_block in 16-float pieces: NC of them from d0 (NH at most
 * PV_WIDE_HEADS). */
ALWAYS void pv_block16(const float *p, int stride, const void *v, int m, int D, int d0, int NH,
                      int NC, float *o, int half) {
    __m512 acc[PV_WIDE_HEADS][PV16_WIDE_CHUNKS];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++)
            acc[h][c] = _mm512_loadu_ps(o + (size_t)h * D + d0 + 16 * c);
    for (int j = 0; j < m; j++) {
        __m512 vv[PV16_WIDE_CHUNKS];
        for (int c = 0; c < NC; c++) vv[c] = load16(v, (size_t)j * D + d0 + 16 * c, half);
        for (int h = 0; h < NH; h++) {
            const __m512 w = _mm512_set1_ps(p[(size_t)h * stride + j]);
            for (int c = 0; c < NC; c++) acc[h][c] = _mm512_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++)
            _mm512_storeu_ps(o + (size_t)h * D + d0 + 16 * c, acc[h][c]);
}
#else
#define ATTENTION_512 0
#endif
/* Keys whose scores each row takes in turn, QK_SLOTS at a time: in the
 * 512-bit passes, 16, so that a row's queries are read from the L1 cache
 * for 16 keys rather than 4 (an Intel Xeon with AMX, 2 threads, one layer
 * of a 1.5B, 128 rows after 1,408 tokens: 0.90 to 0.97 of the time; 8, 32
 * and 64 keys no faster than 16).  The AVX2 build keeps 4. */
#define QK_BLOCK (ATTENTION_512 ? 16 : QK_SLOTS)

/* The scores of nh heads and ns (at most QK_SLOTS) consecutive keys into
 * s[h * stride + j]: qk_pairs where it applies (qp: the heads' queries by
 * pack_pairs, or NULL), else qk_four, else qk_block. */
ALWAYS void qk_slots(const float *q, const float *qp, const void *k, int D, int nh, int ns,
                    float scale, float *s, int stride, int half) {
    if (ns != QK_SLOTS || D % 8) {
        for (int h = 0; h < nh; h += QK_HEADS)
            qk_sums(q + (size_t)h * D, k, D, imin(QK_HEADS, nh - h), ns, scale,
                    s + (size_t)h * stride, stride, half);
        return;
    }
    int h = 0;
#if ATTENTION_512
    while (qp && nh - h >= 2) {     /* (np a constant in each call, for the registers) */
        const int np = imin(QK_PAIRS, (nh - h) / 2);
        float *o = s + (size_t)h * stride;
        const float *pairs = qp + (size_t)h * D;
        if (np == 3) qk_pairs(pairs, k, D, 3, scale, o, stride, half);
        else if (np == 2) qk_pairs(pairs, k, D, 2, scale, o, stride, half);
        else qk_pairs(pairs, k, D, 1, scale, o, stride, half);
        h += 2 * np;
    }
#else
    (void)qp;
#endif
    for (; h + 2 <= nh; h += 2)
        qk_four(q + (size_t)h * D, k, D, 2, scale, s + (size_t)h * stride, stride, half);
    if (h < nh) qk_four(q + (size_t)h * D, k, D, 1, scale, s + (size_t)h * stride, stride, half);
}

/* o_h[d0 + c] += sum over the m slots j, in order, of p[h * stride + j] v_j[d0 + c]
 * for NH heads (o_h = o + h D) and the NC 8-float pieces c from d0, v_j = v + j D. */
ALWAYS void pv_block(const float *p, int stride, const void *v, int m, int D, int d0, int NH,
                   int NC, float *o, int half) {
    __m256 acc[PV_WIDE_HEADS][PV_CHUNKS];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) acc[h][c] = _mm256_loadu_ps(o + (size_t)h * D + d0 + 8 * c);
    for (int j = 0; j < m; j++) {
        __m256 vv[PV_CHUNKS];
        for (int c = 0; c < NC; c++) vv[c] = load8(v, (size_t)j * D + d0 + 8 * c, half);
        for (int h = 0; h < NH; h++) {
            const __m256 w = _mm256_broadcast_ss(p + (size_t)h * stride + j);
            for (int c = 0; c < NC; c++) acc[h][c] = _mm256_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(o + (size_t)h * D + d0 + 8 * c, acc[h][c]);
}

/* pv_block over a whole output of nh heads (every piece: 16-float ones
 * first where the build has them, then 8-float ones, then a tail of D % 8
 * values one at a time). */
ALWAYS void pv_sums(const float *p, int stride, const void *v, int m, int D, int nh, float *o,
                   int wide, int half) {
    int d0 = 0;
#if ATTENTION_512
    while (d0 + 16 <= D) {
        const int nc = imin(wide ? PV16_WIDE_CHUNKS : PV16_CHUNKS, (D - d0) / 16);
#define PV(NH, NC) case NH * 8 + NC: pv_block16(p, stride, v, m, D, d0, NH, NC, o, half); break;
#define PVS(NH) PV(NH, 1) PV(NH, 2) PV(NH, 3) PV(NH, 4)
        switch (nh * 8 + nc) { PVS(1) PVS(2) PVS(3) PVS(4) PVS(5) PVS(6) }
#undef PVS
#undef PV
        d0 += 16 * nc;
    }
#endif
    while (d0 + 8 <= D) {
        const int nc = imin(wide ? PV_WIDE_CHUNKS : PV_CHUNKS, (D - d0) / 8);
#define PV(NH, NC) case NH * 8 + NC: pv_block(p, stride, v, m, D, d0, NH, NC, o, half); break;
        switch (nh * 8 + nc) {
            PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
            PV(3, 1) PV(3, 2) PV(4, 1) PV(4, 2) PV(5, 1) PV(5, 2) PV(6, 1) PV(6, 2)
        }
#undef PV
        d0 += 8 * nc;
    }
    for (int d = D / 8 * 8; d < D; d++)
        for (int h = 0; h < nh; h++) {
            float sum = o[(size_t)h * D + d];
            for (int j = 0; j < m; j++)
                sum = fmaf(p[(size_t)h * stride + j], load1(v, (size_t)j * D + d, half), sum);
            o[(size_t)h * D + d] = sum;
        }
}

/* Whether position t (at slot start + t) sees the slots j .. j+m-1. */
static inline int sees_all(const uint8_t *mask, int end, int start, int t, int j, int m) {
    if (!mask) return j + m - 1 <= start + t;
    const uint8_t *row = mask + (size_t)t * end + j;
    for (int i = 0; i < m; i++) if (!row[i]) return 0;
    return 1;
}

/* Whether position t sees slot j. */
static inline int sees(const uint8_t *mask, int end, int start, int t, int j) {
    return mask ? mask[(size_t)t * end + j] != 0 : j <= start + t;
}

/* [*lo, *hi): the slots that rows t0 .. t1-1 see lie in it (causal: 0 ..
 * start + t1; with a mask, from the first slot any row sees to the last).
 * A sliding window's mask leaves most of a long cache out of it: its
 * blocks are neither read nor fetched. */
static void seen_span(const uint8_t *mask, int end, int start, int t0, int t1, int *lo,
                      int *hi) {
    if (!mask) {
        *lo = 0;
        *hi = imin(start + t1, end);
        return;
    }
    int a = end, b = 0;
    for (int t = t0; t < t1; t++) {
        const uint8_t *row = mask + (size_t)t * end;
        int first = 0, last = end;
        while (first < end && !row[first]) first++;
        while (last > first && !row[last - 1]) last--;
        if (first < last) {
            a = imin(a, first);
            b = last > b ? last : b;
        }
    }
    *lo = a < b ? a : 0;
    *hi = b;
}

/* The scores of row t (st: its per_kv rows of scores, *n of them taken)
 * for the m keys from slot j0 at k, QK_SLOTS keys at a time: a row's
 * queries are read from the L1 cache for all the block's keys. */
ALWAYS void qk_row(const float *q, const float *qp, const void *k, int D, int per_kv, int m,
                  int j0, int t, int start, int end, const uint8_t *mask, float scale,
                  float *st, int *n, int half) {
    for (int i = 0; i < m; i += QK_SLOTS) {
        const int ns = imin(QK_SLOTS, m - i);
        const void *ki = at(k, (size_t)i * D, half);
        if (sees_all(mask, end, start, t, j0 + i, ns)) {
            qk_slots(q, qp, ki, D, per_kv, ns, scale, st + *n, end, half);
            *n += ns;
            continue;
        }
        for (int j = 0; j < ns; j++) {
            if (!sees(mask, end, start, t, j0 + i + j)) continue;
            qk_slots(q, qp, at(ki, (size_t)j * D, half), D, per_kv, 1, scale, st + *n, end,
                     half);
            ++*n;
        }
    }
}

/* Row t's outputs o (per_kv heads) plus its weights pt times the m values
 * from slot j0 at v, in groups of `heads` heads. */
ALWAYS void pv_row(const float *pt, const void *v, int D, int per_kv, int m, int j0, int t,
                  int start, int end, const uint8_t *mask, float *o, int *n, int heads,
                  int wide, int half) {
    if (sees_all(mask, end, start, t, j0, m)) {
        for (int h = 0; h < per_kv; h += heads)
            pv_sums(pt + (size_t)h * end + *n, end, v, m, D, imin(heads, per_kv - h),
                    o + (size_t)h * D, wide, half);
        *n += m;
        return;
    }
    for (int j = 0; j < m; j++) {
        if (!sees(mask, end, start, t, j0 + j)) continue;
        for (int h = 0; h < per_kv; h += heads)
            pv_sums(pt + (size_t)h * end + *n, end, at(v, (size_t)j * D, half), 1, D,
                    imin(heads, per_kv - h), o + (size_t)h * D, wide, half);
        ++*n;
    }
}

/* The attention of rows t0 .. t1-1 (at most ROWS) for key head g, whose
 * cache rows are kg and vg: the keys and values each row sees, in slot
 * order, read once for all the rows (so a verification of T positions reads
 * a long cache about once, not T times), in blocks of QK_BLOCK slots
 * (QK_SLOTS at a time) and PV_SLOTS (or PV_WIDE_SLOTS) slots; a piece of
 * QK_SLOTS or a block of values that a row sees only in part goes slot by
 * slot.  scores: scratch of ROWS * per_kv * end floats, seen: of ROWS
 * ints, pairs: of ROWS * per_kv * D floats (the rows' queries by
 * pack_pairs, in the 512-bit passes). */
ALWAYS void attend_rows(const float *qkv, int width, int H, int per_kv, int D, const void *kg,
                       const void *vg, int g, int t0, int t1, int start, int end,
                       const uint8_t *mask, float scale, float *scores, int *seen, float *pairs,
                       float *out, int half) {
    const size_t bytes = half ? 2 : 4;     /* an element's */
    int lo, hi;
    seen_span(mask, end, start, t0, t1, &lo, &hi);
    for (int t = t0; t < t1; t++) seen[t - t0] = 0;
#if ATTENTION_512
    const int packed = per_kv >= 2 && D % 8 == 0;
    if (packed)
        for (int t = t0; t < t1; t++)
            pack_pairs(qkv + (size_t)t * width + (size_t)g * per_kv * D, per_kv, D,
                       pairs + (size_t)(t - t0) * per_kv * D);
#else
    const int packed = 0;
    (void)pairs;
#endif
    for (int j0 = lo / QK_SLOTS * QK_SLOTS; j0 < hi; j0 += QK_BLOCK) {
        const int m = imin(QK_BLOCK, end - j0);
        const void *k = at(kg, (size_t)j0 * D, half);
        if (j0 + QK_AHEAD + m <= hi)        /* keys read later, asked for in order */
            for (size_t b = 0; b < bytes * (size_t)D * m; b += 64)
                _mm_prefetch((const char *)at(k, (size_t)QK_AHEAD * D, half) + b, CACHE_AHEAD);
        for (int t = t0; t < t1; t++)
            qk_row(qkv + (size_t)t * width + (size_t)g * per_kv * D,
                   packed ? pairs + (size_t)(t - t0) * per_kv * D : NULL, k, D, per_kv, m, j0,
                   t, start, end, mask, scale, scores + (size_t)(t - t0) * per_kv * end,
                   seen + (t - t0), half);
    }
    for (int t = t0; t < t1; t++) {
        const int n = seen[t - t0];
        for (int h = 0; h < per_kv; h++) {
            float *p = scores + ((size_t)(t - t0) * per_kv + h) * end;
            /* The largest score, 8 lanes at a time: a maximum is the same
               whatever the order it is taken in (scores are never NaN). */
            __m256 most = _mm256_set1_ps(-INFINITY);
            int j = 0;
            for (; j + 8 <= n; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(p + j));
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            half = _mm_max_ss(half, _mm_movehdup_ps(half));
            float top = _mm_cvtss_f32(half);
            for (; j < n; j++) top = p[j] > top ? p[j] : top;
            __m256 acc = _mm256_setzero_ps(), vtop = _mm256_set1_ps(top);
            j = 0;
#if ATTENTION_512
            /* 16 at a time, their halves added to the sum in order */
            for (const __m512 wtop = _mm512_set1_ps(top); j + 16 <= n; j += 16) {
                const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), wtop));
                _mm512_storeu_ps(p + j, e);
                acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
                acc = _mm256_add_ps(acc, _mm256_castpd_ps(
                    _mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
            }
#endif
            for (; j + 8 <= n; j += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vtop));
                _mm256_storeu_ps(p + j, e);
                acc = _mm256_add_ps(acc, e);
            }
            float total = hsum8(acc);
            for (; j < n; j++) { p[j] = exp1(p[j] - top); total += p[j]; }
            const float inv = 1.0f / total;
            for (j = 0; j < n; j++) p[j] *= inv;
        }
        memset(out + (size_t)t * H * D + (size_t)g * per_kv * D, 0,
               sizeof(float) * (size_t)per_kv * D);
        seen[t - t0] = 0;
    }
    const int wide = t1 - t0 >= WIDE_ROWS, heads = wide ? PV_WIDE_HEADS : PV_HEADS,
              slots = wide ? PV_WIDE_SLOTS : PV_SLOTS;
    for (int j0 = lo / slots * slots; j0 < hi; j0 += slots) {
        const int m = imin(slots, end - j0);
        const void *v = at(vg, (size_t)j0 * D, half);
        /* The next block's values, asked for in order: a block reads its
           rows a piece at a time, an order the hardware prefetcher follows
           poorly. */
        const char *next = at(v, (size_t)m * D, half);
        const int more = imin(slots, hi - j0 - m);
        const size_t ahead = more > 0 ? bytes * (size_t)D * (size_t)more : 0;
        for (size_t b = 0; b < ahead; b += 64) _mm_prefetch(next + b, CACHE_AHEAD);
        for (int t = t0; t < t1; t++)
            pv_row(scores + (size_t)(t - t0) * per_kv * end, v, D, per_kv, m, j0, t, start, end,
                   mask, out + (size_t)t * H * D + (size_t)g * per_kv * D, seen + (t - t0), heads,
                   wide, half);
    }
}

/* One decoder layer's attention for T fed positions, at cache slots
 * start .. start+T-1.
 *
 * qkv:    [T, (H + 2 KV) D], the fused projection's output (bias added);
 *         its query and key parts are rotated in place.
 * cos, sin: [T, D], the angles of each position.
 * keys, values: the layer's cache, [KV, capacity, D] float32, or float16
 *         where half is nonzero; the rotated keys and the values of the fed
 *         positions are written to their slots (rounded to float16 there).
 * mask:   NULL (position t sees slots 0 .. start+t) or [T, start+T] bytes,
 *         nonzero where position t sees the slot.
 * out:    [T, H D], softmax(q k / sqrt(D)) v per head; query head h reads
 *         key head h / (H / KV).
 * Returns 1 where no scratch memory could be had, else 0. */
int fr_attention(float *qkv, int T, int H, int KV, int D, const float *cos, const float *sin,
                 void *keys, void *values, int half, int capacity, int start,
                 const uint8_t *mask, float *out, int threads) {
    const int width = (H + 2 * KV) * D, end = start + T, per_kv = H / KV;
    /* each position's rotation and cache slots its own: shared among the
       threads for a block of positions */
    #pragma omp parallel for num_threads(threads) schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *row = qkv + (size_t)t * width;
        for (int h = 0; h < H + KV; h++)
            rotate(row + (size_t)h * D, cos + (size_t)t * D, sin + (size_t)t * D, D);
        for (int g = 0; g < KV; g++) {
            const size_t slot = ((size_t)g * capacity + start + t) * D;
            store((char *)keys + (half ? 2 : 4) * slot, row + (size_t)(H + g) * D, D, half);
            store((char *)values + (half ? 2 : 4) * slot, row + (size_t)(H + KV + g) * D, D,
                  half);
        }
    }
    const float scale = 1.0f / sqrtf((float)D);
    /* A task: one key head and its query heads, for a share of the rows
       (split between tasks so that each thread gets as many). */
    int gcd = KV, r = threads;
    while (r) { const int next = gcd % r; gcd = r; r = next; }
    const int parts = threads / gcd;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && KV * parts > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(end + D) * per_kv * ROWS);
        float *pairs = scores ? scores + (size_t)end * per_kv * ROWS : NULL;
        int *seen = malloc(sizeof(int) * ROWS);
        if (!scores || !seen) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int task = 0; task < KV * parts; task++) {
            if (!scores || !seen) continue;
            const int g = task / parts, part = task % parts;
            const int t0 = (int)((long)T * part / parts), t1 = (int)((long)T * (part + 1) / parts);
            const size_t first = (size_t)g * capacity * D;
            for (int c = t0; c < t1; c += ROWS) {
                const int c1 = imin(c + ROWS, t1);
                if (half)
                    attend_rows(qkv, width, H, per_kv, D, at(keys, first, 1),
                                at(values, first, 1), g, c, c1, start, end, mask, scale, scores,
                                seen, pairs, out, 1);
                else
                    attend_rows(qkv, width, H, per_kv, D, at(keys, first, 0),
                                at(values, first, 0), g, c, c1, start, end, mask, scale, scores,
                                seen, pairs, out, 0);
            }
        }
        free(scores);
        free(seen);
    }
    return failed;
}
