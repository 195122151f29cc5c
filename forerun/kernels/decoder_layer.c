/* One decoder layer of a pre-norm transformer (Qwen2, Llama, Qwen3,
 * Gemma 3) in one call: what the engine's layer loop runs operation by
 * operation for a one-position step or a verification (the layer
 * operations of avx2_layer_ops.c, the products of avx2_int_products.c),
 * chained here without returning to Python between them.
 *
 *     h = rms_norm(x, attn_norm)
 *     qkv = h Wqkv (+ bias)
 *     [each query and key head rms_norm'ed (Qwen3, Gemma 3); queries scaled]
 *     rotated, the keys and values cached, attended
 *     o = attention Wo (+ bias)     [o = rms_norm(o, post_attn_norm): Gemma 3]
 *     x += o
 *     h = rms_norm(x, mlp_norm)
 *     m = act(h Wgate (+ bias)) * (h Wup (+ bias)) Wdown (+ bias)
 *                                   act: SiLU, or the tanh GELU (Gemma 3)
 *                                   [m = rms_norm(m, post_mlp_norm): Gemma 3]
 *     x += m
 *
 * The same functions run on the same values in the same order as the
 * operation-by-operation loop (a bias and a residual are float additions,
 * as torch's are; the query scale a float multiplication, as torch's is),
 * so the results are the same to the bit; what it saves is the interpreter
 * and the dispatch around them: about 36 operator calls a layer, a
 * one-position step of a 28-layer 1.5B taking 1,019 of them (about 6 ms of
 * a 71 ms step on a 2-core Zen 3).
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int fr_q4_linear(const float *x, int T, int K, int Kp, const uint8_t *q,
                 const uint16_t *scale, const uint16_t *min, int N, float *y, int threads);
int fr_q6_linear(const float *x, int T, int K, int Kp, const uint8_t *ql, const uint8_t *qh,
                 const int8_t *sc, const float *d, int N, float *y, int threads);
int fr_q8_linear(const float *x, int T, int K, int Kp, const int8_t *q, const float *scale,
                 int N, float *y, int threads);
void fr_rms_norm(const float *x, int T, int H, const float *w, float eps, float *y);
void fr_silu_mul(const float *gu, int T, int I, float *y);
void fr_gelu_tanh_mul(const float *gu, int T, int I, float *y);
int fr_attention(float *qkv, int T, int H, int KV, int D, const float *cos, const float *sin,
                 void *keys, void *values, int half, int capacity, int start,
                 const uint8_t *mask, float *out, int threads);

/* A matrix in one of the native layouts (forerun/engines/native_linear.py):
 * format 4 (w0..w2: values, scale, minimum), 6 (w0..w3: low, high, scale,
 * d) or 8 (w0, w1: values, scale); n output rows, k inputs padded to kp. */
typedef struct {
    int32_t format, n, k, kp;
    const void *w0, *w1, *w2, *w3;
} fr_matrix;

/* A layer's product: the outputs of up to FR_PARTS matrices side by side
 * (a GGUF's q/k/v whose kinds differ: 4-bit q and k, a 6-bit v), then a
 * bias over all of them. */
#define FR_PARTS 4
typedef struct {
    fr_matrix part[FR_PARTS];
    int32_t parts, n;
    const float *bias; /* [n], or NULL */
} fr_product;

/* 0, 1 where no scratch memory could be had, 2 for a matrix it can't read
   (a format it doesn't know, or padded columns its kernels don't take). */
static int part_product(const fr_matrix *m, const float *x, int T, float *y, int threads) {
    int r;
    switch (m->format) {
    case 4:
        r = fr_q4_linear(x, T, m->k, m->kp, m->w0, m->w1, m->w2, m->n, y, threads);
        break;
    case 6:
        r = fr_q6_linear(x, T, m->k, m->kp, m->w0, m->w1, m->w2, m->w3, m->n, y, threads);
        break;
    case 8:
        r = fr_q8_linear(x, T, m->k, m->kp, m->w0, m->w1, m->n, y, threads);
        break;
    default:
        return 2;
    }
    return r == -2 ? 2 : r ? 1 : 0;
}

/* y [T, n] = x [T, k] W (+ bias).  Returns 0, 1 where no scratch memory
   could be had, 2 for a format it doesn't know. */
static int product(const fr_product *p, const float *x, int T, float *y, int threads) {
    int failed;
    if (p->parts < 1 || p->parts > FR_PARTS) return 2;
    if (p->parts == 1 || T == 1) {
        /* one row: each part's outputs are a slice of it */
        for (int i = 0, at = 0; i < p->parts; at += p->part[i].n, i++)
            if ((failed = part_product(&p->part[i], x, T, y + at, threads))) return failed;
    } else {
        for (int i = 0, at = 0; i < p->parts; at += p->part[i].n, i++) {
            const int n = p->part[i].n;
            float *part = malloc(sizeof(float) * (size_t)T * n);
            if (!part) return 1;
            if ((failed = part_product(&p->part[i], x, T, part, threads))) {
                free(part);
                return failed;
            }
            for (int t = 0; t < T; t++)
                memcpy(y + (size_t)t * p->n + at, part + (size_t)t * n, sizeof(float) * n);
            free(part);
        }
    }
    if (p->bias)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < p->n; i++) y[(size_t)t * p->n + i] += p->bias[i];
    return 0;
}

/* Below this many positions a layer's row-wise steps (norms, sums) run on
   the calling thread alone: a parallel region costs more than they do. */
#define FR_SPLIT_ROWS 8

/* x [T, H] += y [T, H] */
static void add_to(float *x, const float *y, int T, int H, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= FR_SPLIT_ROWS)
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) x[(size_t)t * H + i] += y[(size_t)t * H + i];
}

/* fr_rms_norm of each row, the rows shared among the threads (each row
   alone: the same values on any count) */
static void norm_rows(const float *x, int T, int H, const float *w, float eps, float *y,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= FR_SPLIT_ROWS)
    for (int t = 0; t < T; t++) fr_rms_norm(x + (size_t)t * H, 1, H, w, eps, y + (size_t)t * H);
}

/* Scratch floats fr_decoder_layer needs for T positions. */
size_t fr_decoder_layer_scratch(int T, int H, int heads, int kv, int D, int I) {
    return (size_t)T * ((size_t)H + (size_t)(heads + 2 * kv) * D + (size_t)heads * D
                        + 3 * (size_t)I);
}

/* A sequence's rows of a forward: the next `rows` positions, appended at
 * slot `start` of its cache (keys and values [layers, kv, capacity, D],
 * float32, or float16 where `half` is nonzero), seeing the slots its mask
 * says (NULL: causal, as fr_attention takes it). */
typedef struct {
    int32_t rows, start, capacity;
    void *keys, *values;
    const uint8_t *mask;
    int32_t half;
} fr_span;

/* What a layer adds to the Qwen2/Llama layer (NULL: nothing): query and
 * key norms ([D] each, applied to every head, both or neither), a factor
 * the queries are multiplied by before RoPE (1: none), norms of the
 * attention's and the feed-forward block's outputs before they join the
 * residual stream ([H], or NULL), and the gate's activation. */
enum { FR_SILU = 0, FR_GELU_TANH = 1 };
typedef struct {
    const float *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    float query_factor;
    int32_t activation;
} fr_layer_extras;

/* Layer `layer` for T positions whose residual stream is x [T, H]
 * (updated in place), of the sequences `spans` (their rows in order,
 * adding up to T): each position attends over its own sequence's cache
 * only.  qkv, o, gate_up, down: its products ([heads + 2 kv] D x H,
 * H x heads D, 2I x H, H x I).  cos, sin: [T, D], each position's RoPE
 * angles.  extras: what the architecture adds (NULL: nothing).  scratch:
 * fr_decoder_layer_scratch floats.  Returns 0, 1 where no memory could be
 * had, 2 for a matrix format or an activation it doesn't know (x is then
 * partly updated: the caller raises). */
int fr_decoder_layer(float *x, int T, int H, const float *attn_norm, const float *mlp_norm,
                     float eps, const fr_product *qkv, const fr_product *o,
                     const fr_product *gate_up, const fr_product *down, int heads, int kv, int D,
                     const float *cos, const float *sin, int layer, const fr_span *spans,
                     int nspans, const fr_layer_extras *extras, float *scratch, int threads) {
    const int I = gate_up->n / 2, width = (heads + 2 * kv) * D;
    float *h = scratch;                                       /* [T, H] */
    float *q = h + (size_t)T * H;                             /* [T, (heads + 2 kv) D] */
    float *attn = q + (size_t)T * width;                      /* [T, heads D] */
    float *gu = attn + (size_t)T * heads * D;                 /* [T, 2I] */
    float *act = gu + (size_t)T * 2 * I;                      /* [T, I] */
    const fr_layer_extras none = {NULL, NULL, NULL, NULL, 1.0f, FR_SILU};
    const fr_layer_extras *e = extras ? extras : &none;
    int failed;
    if (e->activation != FR_SILU && e->activation != FR_GELU_TANH) return 2;
    norm_rows(x, T, H, attn_norm, eps, h, threads);
    if ((failed = product(qkv, h, T, q, threads))) return failed;
    for (int t = 0; t < T; t++) {
        float *row = q + (size_t)t * width;       /* heads queries, then kv keys */
        if (e->q_norm && e->k_norm) {             /* in place: a row is read, then written */
            fr_rms_norm(row, heads, D, e->q_norm, eps, row);
            fr_rms_norm(row + (size_t)heads * D, kv, D, e->k_norm, eps, row + (size_t)heads * D);
        }
        if (e->query_factor != 1.0f)
            for (int i = 0; i < heads * D; i++) row[i] *= e->query_factor;
    }
    for (int i = 0, row = 0; i < nspans; row += spans[i].rows, i++) {
        const fr_span *s = &spans[i];
        const size_t at = (s->half ? 2 : 4) * (size_t)layer * kv * s->capacity * D;
        if (fr_attention(q + (size_t)row * width, s->rows, heads, kv, D, cos + (size_t)row * D,
                         sin + (size_t)row * D, (char *)s->keys + at, (char *)s->values + at,
                         s->half, s->capacity, s->start, s->mask,
                         attn + (size_t)row * heads * D, threads))
            return 1;
    }
    if ((failed = product(o, attn, T, h, threads))) return failed;
    if (e->post_attn_norm) norm_rows(h, T, H, e->post_attn_norm, eps, h, threads);
    add_to(x, h, T, H, threads);
    norm_rows(x, T, H, mlp_norm, eps, h, threads);
    if ((failed = product(gate_up, h, T, gu, threads))) return failed;
    {
        /* each row alone: the same values on any thread count */
        void (*activate)(const float *, int, int, float *) =
            e->activation == FR_SILU ? fr_silu_mul : fr_gelu_tanh_mul;
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
        for (int t = 0; t < T; t++)
            activate(gu + (size_t)t * 2 * I, 1, I, act + (size_t)t * I);
    }
    if ((failed = product(down, act, T, h, threads))) return failed;
    if (e->post_mlp_norm) norm_rows(h, T, H, e->post_mlp_norm, eps, h, threads);
    add_to(x, h, T, H, threads);
    return 0;
}
