/* forerun's native per-position operations of a decoder layer, for x86-64
 * CPUs with AVX2 and FMA: RMSNorm, SiLU-gated products, and RoPE with the
 * KV-cache write and attention in one call.
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

/* e^x for 8 floats (Cephes' polynomial; relative error about 2e-7).
 * Inputs are clamped to [-87.3, 88.3]; e^-87.3 is 1e-38. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654475f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

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

/* One decoder layer's attention for T fed positions, at cache slots
 * start .. start+T-1.
 *
 * qkv:    [T, (H + 2 KV) D], the fused projection's output (bias added);
 *         its query and key parts are rotated in place.
 * cos, sin: [T, D], the angles of each position.
 * keys, values: the layer's cache, [KV, capacity, D]; the rotated keys and
 *         the values of the fed positions are written to their slots.
 * mask:   NULL (position t sees slots 0 .. start+t) or [T, start+T] bytes,
 *         nonzero where position t sees the slot.
 * out:    [T, H D], softmax(q k / sqrt(D)) v per head; query head h reads
 *         key head h / (H / KV).
 * Returns 1 where no scratch memory could be had, else 0. */
int fr_attention(float *qkv, int T, int H, int KV, int D, const float *cos, const float *sin,
                 float *keys, float *values, int capacity, int start, const uint8_t *mask,
                 float *out, int threads) {
    const int width = (H + 2 * KV) * D, end = start + T, per_kv = H / KV;
    for (int t = 0; t < T; t++) {
        float *row = qkv + (size_t)t * width;
        for (int h = 0; h < H + KV; h++)
            rotate(row + (size_t)h * D, cos + (size_t)t * D, sin + (size_t)t * D, D);
        for (int g = 0; g < KV; g++) {
            memcpy(keys + ((size_t)g * capacity + start + t) * D, row + (size_t)(H + g) * D,
                   sizeof(float) * D);
            memcpy(values + ((size_t)g * capacity + start + t) * D,
                   row + (size_t)(H + KV + g) * D, sizeof(float) * D);
        }
    }
    const float scale = 1.0f / sqrtf((float)D);
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && T * KV > 1)
    {
        /* Per task: the visible slots, and per head its scores. */
        int *slots = malloc(sizeof(int) * (size_t)end);
        float *scores = malloc(sizeof(float) * (size_t)end * per_kv);
        if (!slots || !scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int task = 0; task < T * KV; task++) {
            if (!slots || !scores) continue;
            const int t = task / KV, g = task % KV;
            int n = 0;
            if (mask) {
                const uint8_t *m = mask + (size_t)t * end;
                for (int s = 0; s < end; s++) if (m[s]) slots[n++] = s;
            } else {
                for (int s = 0; s <= start + t; s++) slots[n++] = s;
            }
            const float *kg = keys + (size_t)g * capacity * D;
            const float *vg = values + (size_t)g * capacity * D;
            const float *q0 = qkv + (size_t)t * width + (size_t)g * per_kv * D;
            float *o0 = out + (size_t)t * H * D + (size_t)g * per_kv * D;
            for (int j = 0; j < n; j++) {
                const float *k = kg + (size_t)slots[j] * D;
                for (int h = 0; h < per_kv; h++)
                    scores[(size_t)h * end + j] = dot(q0 + (size_t)h * D, k, D) * scale;
            }
            for (int h = 0; h < per_kv; h++) {
                float *p = scores + (size_t)h * end;
                float top = -INFINITY;
                for (int j = 0; j < n; j++) top = p[j] > top ? p[j] : top;
                __m256 acc = _mm256_setzero_ps(), vtop = _mm256_set1_ps(top);
                int j = 0;
                for (; j + 8 <= n; j += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vtop));
                    _mm256_storeu_ps(p + j, e);
                    acc = _mm256_add_ps(acc, e);
                }
                float total = hsum8(acc);
                for (; j < n; j++) { p[j] = exp1(p[j] - top); total += p[j]; }
                const float inv = 1.0f / total;
                for (j = 0; j < n; j++) p[j] *= inv;
                memset(o0 + (size_t)h * D, 0, sizeof(float) * D);
            }
            for (int j = 0; j < n; j++) {
                const float *v = vg + (size_t)slots[j] * D;
                for (int h = 0; h < per_kv; h++) {
                    float *o = o0 + (size_t)h * D;
                    const __m256 w = _mm256_set1_ps(scores[(size_t)h * end + j]);
                    int d = 0;
                    for (; d + 8 <= D; d += 8)
                        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d),
                                                                _mm256_loadu_ps(o + d)));
                    for (; d < D; d++) o[d] += scores[(size_t)h * end + j] * v[d];
                }
            }
        }
        free(slots);
        free(scores);
    }
    return failed;
}
