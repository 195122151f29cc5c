/* forerun's native matrix products for 4-bit and 8-bit weights on x86-64
 * CPUs with AVX2, FMA and F16C.
 *
 * y[t, n] = sum_k x[t, k] * W[n, k] for a few rows t (a decoding step, a
 * verification) or many (a prompt block).  The activations are quantized
 * to int8 in groups of 32 (one float scale per group, absmax / 127), and
 * the products of weights and activations are summed in integers, 32 at a
 * time (vpmaddubsw), the way llama.cpp's CPU kernels do it.
 *
 * Every output y[t, n] is computed by the same instructions in the same
 * order whatever the number of rows T and wherever row t sits among them:
 * a row's activations are quantized on their own, and the sums over k run
 * in a fixed order per (t, n).  So a position's result is bit-identical
 * whether it is fed alone or with others (forerun's row invariance, which
 * greedy speculative decoding needs to stay token-identical).
 *
 * Layout.  The input dimension is padded to a multiple of 256 (8 groups);
 * padded weights and activations are zero.  8-bit matrices in a build of
 * one-row groups (the AVX2 and AVX-VNNI builds) may end in a half block
 * instead (Kp a multiple of 128: see HALF), so that a hidden size of 640
 * (Gemma 3 270M) or 896 (Qwen2.5 0.5B) is not read as 768 or 1,024.
 * Within each block of 8 groups, the 256 values are stored in 8 chunks:
 * chunk i holds, for each group L,
 * its values 4i..4i+3 at bytes 4L..4L+3 of the chunk (32 bytes for int8
 * activations and weights).  So one vpmaddubsw + vpmaddwd sums 4 products
 * of each of 8 groups into an int32 lane per group, and after the 8 chunks
 * lane L holds the integer dot product of group L: no horizontal sums.
 * 4-bit weights pack chunks 2p and 2p+1 into 32 bytes: byte j holds byte
 * j of chunk 2p in its low nibble and of chunk 2p+1 in its high nibble, so
 * one load, two ands and a shift give 64 values.
 *
 * 4-bit:  W[n, k] = scale[n, g] * q[n, k] + min[n, g], q in 0..15, scale
 *         and min as IEEE half floats, g = k / 32.
 * 6-bit:  W[n, k] = d[n, b] * sc[n, h] * (q[n, k] - 32), q in 0..63, an int8
 *         scale per half group h (16 values) and a float d per block b of
 *         256: a GGUF Q6_K block's own values.  The low 4 bits of q are
 *         packed as 4-bit weights are; the high 2 bits of chunks 4r..4r+3
 *         share 32 bytes r of the block (chunk 4r + i in bits 2i, 2i+1), so
 *         a shift and an and put them at bits 4-5.  The half groups' scales
 *         of a block are stored as the 8 first halves (chunks 0-3), then
 *         the 8 second halves (chunks 4-7).
 * 8-bit:  W[n, k] = scale[n] * q[n, k], q in -128..127, float scale.
 *
 * Row groups.  The output rows are padded to a multiple of ROWS (this
 * build's row group, fr_row_group(): 4 in the AVX512-VNNI build, 1 in the
 * AVX2 one) with zero weights, and each group stores its blocks
 * interleaved: block b of each of its rows in turn, then block b + 1 (every
 * per-block array: scales, minimums, the 6-bit d; the 8-bit row scales stay
 * one per row).  The values themselves (packed 4-bit values, 6-bit high
 * bits, 8-bit values) are interleaved finer, UNIT (32) bytes of each row in
 * turn, so that rows r and r + 1's 32 bytes of a chunk pair sit together
 * (see WIDE below).  A pass runs a group's rows together, so each
 * activation load serves ROWS rows and the weights are read as one stream.
 * Read as 4 streams a row apart, 4 rows ran slower than one (an AMD Zen 4,
 * 2 threads: 0.75 against 0.37 ms for 17920 x 1536 4-bit weights and one
 * position); interleaved, the AVX512-VNNI build's products of a 1.5B's
 * step cost 1.14 to 1.31 times one position's for 4, where one row a pass
 * cost 1.37 to 1.48.  AVX2's 16 vector registers can't hold 4 rows' sums
 * for several positions: 4-row groups made its build 4% slower at one
 * position and 15% at 5 there, so it keeps one.
 *
 * Dot-product instructions.  Built with FR_DPBUSD defined (as
 * `-DFR_DPBUSD=512` with -mavx512vnni -mavx512vl, or `-DFR_DPBUSD=256` with
 * -mavxvnni), the sums of products use vpdpbusd, which multiplies 4 pairs of
 * bytes and adds them to an int32 lane in one instruction, instead of
 * vpmaddubsw, int16 adds and vpmaddwd.  Every product sum is exact either
 * way (the int16 sums of the AVX2 path never saturate, and vpdpbusd does
 * not saturate), and the float arithmetic after it is the same, so both
 * builds give bit-identical results.  `-DFR_DPBUSD=0` builds the vpdpbusd
 * code with an AVX2 stand-in for the instruction, which is how a machine
 * without VNNI tests that code.
 *
 * 512-bit registers (WIDE: the AVX512-VNNI build).  Each pass loads rows r
 * and r + 1's 32 bytes of a chunk (a 4-bit chunk pair) as one 512-bit
 * register, [row r | row r + 1], and sums its products with the chunk's 32
 * activation bytes broadcast to both halves: one 512-bit vpdpbusd does the
 * work of two 256-bit ones, and a sum register's 16 lanes are the two rows'
 * 8 groups, so the float arithmetic runs on two rows at once with no
 * shuffle (their scales are adjacent in a row group, and the activations'
 * scales are broadcast as the bytes are).  Integer sums are exact, and each
 * float lane gets the same operations in the same order as in the 256-bit
 * passes, so the results are the AVX2 build's bit for bit.  On a Xeon (2
 * threads, the products of a 1.5B's step) these passes ran 8 positions in
 * 0.66 of the time of the earlier 512-bit passes (which paired a chunk's
 * low and high nibbles in one register and added the halves after each
 * block) and 16 to 128 positions in 0.69, one position as fast.  On an AMD
 * EPYC Zen 5 those earlier passes had run the 4-bit products 1.7 to 1.8
 * times as fast as the 256-bit ones at 128 positions.  A row group's outputs
 * leave through store_sums_wide: each row's 8 lanes summed in sum_lanes'
 * order, 4 rows by 4 positions in a few shuffles (on a Zen 4 the products
 * of a 1.5B's step at 8 positions took 0.95 of the time of sum_lanes for
 * each output).
 */

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define BLOCK 256        /* 8 groups */
#define ROW_CHUNK 16     /* output rows a thread takes at a time (whole row groups) */
/* Weight rows per row group, run together (FR_ROWS overrides it: the tests
 * build the AVX2 stand-in for vpdpbusd with 4, so that every machine checks
 * those passes).  Running a group's rows one or two at a time reads its
 * interleaved blocks as strided streams, which ran 1.1 to 1.35 times slower
 * on a Zen 4. */
#if defined(FR_ROWS)
#define ROWS FR_ROWS
#elif defined(__AVX512VL__)
#define ROWS 4
#else
#define ROWS 1
#endif
/* Bytes ahead of the 4-bit weights being read that a pass prefetches (a
 * group of 4 rows streams 4 times as many bytes a block); 8-bit weights
 * twice as far, 6-bit high bits half as far, as the one-row kernels did. */
#define PREFETCH (ROWS == 1 ? 2048 : 4096)
/* The bytes of a row's values that sit together in a row group: block b's
 * values of a group's rows go unit by unit, row after row (see Row groups). */
#define UNIT 32
/* The inputs an 8-bit matrix may be padded to a multiple of in this build
 * (fr_k_unit()): half a block where a row group is one row (q8_group reads
 * a last half block of 4 groups, 128 bytes: chunk i of group L's 4 values
 * at bytes 16 i + 4 L), a whole block otherwise.  4- and 6-bit matrices are
 * always padded to whole blocks (a GGUF's K-quants come in blocks of 256). */
#define HALF (ROWS == 1 ? 128 : BLOCK)

#ifdef FR_DPBUSD
#if FR_DPBUSD == 512
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif FR_DPBUSD == 256
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else   /* the AVX2 stand-in: exact while a pair of products fits an int16 */
#define DPBUSD(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16( \
    _mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#ifdef FR_AMX
#define FR_DPBUSD_KIND 1024    /* AMX tiles for many positions, vpdpbusd for few */
#else
#define FR_DPBUSD_KIND FR_DPBUSD
#endif
#else
#define FR_DPBUSD_KIND -1
#endif

#if defined(FR_DPBUSD) && FR_DPBUSD == 512 && defined(__AVX512F__) && ROWS == 4 \
    && !defined(FR_NO_WIDE)
#define WIDE 1
#else
#define WIDE 0
#endif

/* Most activation rows a pass runs against a row group: each weight load
 * serves them all.  The 512-bit passes hold ROWS / 2 x TILE integer sums
 * (two rows a register) and as many float accumulators: 8 positions fit the
 * 32 registers but for the accumulators, which are touched once per block.
 * On a Xeon (AVX512-VNNI, 2 threads) the products of a 1.5B's step at 8
 * positions cost 1.42 times one position's in passes of 8, 1.75 times in
 * passes of up to 6.  The 256-bit passes keep 6: their sums fill 16 (AVX2)
 * registers sooner, and no AVX2-only machine measured more.  FR_TILE
 * overrides it. */
#ifdef FR_TILE
#define TILE FR_TILE
#elif WIDE
#define TILE 8
#else
#define TILE 6
#endif
#if TILE < 1 || TILE > 8 || (ROWS != 1 && ROWS != 4)
#error "TILE must be 1 to 8 (the passes' cases), ROWS 1 or 4"
#endif

int fr_abi_version(void) { return 9; }

#ifdef FR_AMX
/* The tile products of amx_int_products.c: from fr_amx_rows() positions up,
 * with the same results as the passes below; each returns -1 (nothing
 * written) where the tiles can't be had, and the passes run instead. */
int fr_amx_rows(void);
int fr_amx_q4_matmul(const uint8_t *q, const uint16_t *scale, const uint16_t *min, int N,
                     int Kp, const int8_t *a, const float *sa, const float *sasum, int T,
                     float *y, int threads);
int fr_amx_q8_matmul(const int8_t *q, const float *scale, int N, int Kp, const int8_t *a,
                     const float *sa, int T, float *y, int threads);
int fr_amx_q6_matmul(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *d,
                     int N, int Kp, const int8_t *a, const float *sa, int T, float *y,
                     int threads);
#define TILES(T) ((T) >= fr_amx_rows())
#else
#define TILES(T) 0
#endif

/* The rows of this build's row groups: its layout of every matrix. */
int fr_row_group(void) { return ROWS; }

/* What an 8-bit matrix's inputs are padded to a multiple of (HALF). */
int fr_k_unit(void) { return HALF; }

/* How this build sums products: -1 vpmaddubsw (AVX2), 0 the vpdpbusd code
 * with its AVX2 stand-in, 256 AVX-VNNI, 512 AVX512-VNNI, 1024 AMX tiles for
 * many positions with AVX512-VNNI for few. */
int fr_dot_instruction(void) { return FR_DPBUSD_KIND; }

/* One group of 32 values (k0 + 32 <= K) into the chunk layout at ab:
 * the same arithmetic as the scalar tail below, 8 lanes at a time
 * (max is exact in any order; x * inv is one float multiply either way;
 * vcvtps2dq rounds half to even, as nearbyintf does).  A group holding a
 * NaN gets a NaN scale, so the products it enters are NaN (and the
 * engine's check of the logits refuses them) instead of a number. */
static inline void quantize_group(const float *x, int8_t *ab, int stride, float *d_out,
                                  float *dsum_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);   /* a NaN is skipped */
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
        sum = _mm256_add_epi32(sum, q[j]);
    }
    /* 32 int32 -> 32 int8 in order (packs work within 128-bit lanes). */
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    int32_t quads[8];
    _mm256_storeu_si256((__m256i *)quads, b);
    for (int c = 0; c < 8; c++) memcpy(ab + stride * c, &quads[c], 4);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const float d = _mm256_movemask_ps(nan) ? NAN : amax / 127.0f;
    *d_out = d;
    *dsum_out = d * (float)_mm_cvtsi128_si32(s4);
}

/* One row: x [K] float32 -> a [Kp] int8 in the chunk layout, sa and sasum
 * [Kp / 32].  A last half block (Kp a multiple of 128 only, see HALF) is in
 * the half block's chunk layout. */
static void quantize_row(const float *xr, int K, int Kp, int8_t *ar, float *sar,
                         float *sasumr) {
    const int ng = Kp / GROUP, full = Kp / BLOCK * 8;
    for (int g = 0; g < ng; g++) {
        int8_t *ab = ar + (size_t)(g / 8) * BLOCK + 4 * (g % 8);
        const int stride = g < full ? 32 : 16;
        const int k0 = g * GROUP;
        if (k0 + GROUP <= K) {
            quantize_group(xr + k0, ab, stride, sar + g, sasumr + g);
            continue;
        }
        float amax = 0.0f;
        int nan = 0;
        for (int i = 0; i < GROUP && k0 + i < K; i++) {
            const float v = fabsf(xr[k0 + i]);
            amax = v > amax ? v : amax;
            nan |= isnan(v);
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < GROUP; i++) {
            const float r = k0 + i < K ? nearbyintf(xr[k0 + i] * inv) : 0.0f;
            const int v = isnan(r) ? 0 : (int)r;
            ab[stride * (i / 4) + i % 4] = (int8_t)v;
            sum += v;
        }
        const float d = nan ? NAN : amax / 127.0f;
        sar[g] = d;
        sasumr[g] = d * (float)sum;
    }
}

/* x: [T, K] float32 (row stride K).  a: [T, Kp] int8 in the chunk layout;
 * sa, sasum: [T, Kp / 32] float32, the scale of each group and the scale
 * times the sum of the group's int8 values.  Kp is K rounded up to 256.
 * Each row on its own, so a row's result does not depend on the others. */
static void quantize_rows(const float *x, int T, int K, int Kp, int8_t *a, float *sa,
                          float *sasum, int threads) {
    const int ng = Kp / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
    for (int t = 0; t < T; t++)
        quantize_row(x + (size_t)t * K, K, Kp, a + (size_t)t * Kp, sa + (size_t)t * ng,
                     sasum + (size_t)t * ng);
}

void fr_quantize_rows(const float *x, int T, int K, int Kp, int8_t *a, float *sa,
                      float *sasum) {
    quantize_rows(x, T, K, Kp, a, sa, sasum, 1);
}

static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The sums of byte products each row kernel runs, one definition per
 * instruction set (u: unsigned weights, x: signed int8 activations; the
 * AVX2 forms use the caller's `ones`, int16 1s):
 * - SUMS1(s, u, x): the int32 lanes s plus the sums of their 4 products u * x
 *   (8-bit weights: a pair of products is at most 2 * 128 * 127 = 32512, no
 *   int16 saturation);
 * - SUMS2(s, w0, x0, w1, x1): the same for two sets of products (6-bit
 *   weights: two pairs at most 2 * 2 * 63 * 127 = 32004);
 * - Q4_SUMS(s, w0, x0, w1, x1) and Q4_DOT(s): a 4-bit row's running sums
 *   over one block, and those sums as int32 group sums.  With vpdpbusd they
 *   are int32 from the start; with AVX2 they are int16 sums of 8 vpmaddubsw
 *   results, each at most 8 * 2 * 15 * 127 = 30480 in magnitude (no
 *   overflow), paired into int32 by Q4_DOT. */
#ifdef DPBUSD
#define SUMS1(s, u, x) DPBUSD(s, u, x)
#define SUMS2(s, w0, x0, w1, x1) DPBUSD(DPBUSD(s, w0, x0), w1, x1)
#define Q4_SUMS(s, w0, x0, w1, x1) SUMS2(s, w0, x0, w1, x1)
#define Q4_DOT(s) (s)
#else
#define SUMS1(s, u, x) _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones))
#define SUMS2(s, w0, x0, w1, x1) _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16( \
    _mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)), ones))
#define Q4_SUMS(s, w0, x0, w1, x1) _mm256_add_epi16(s, _mm256_add_epi16( \
    _mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)))
#define Q4_DOT(s) _mm256_madd_epi16(s, ones)
#endif

/* Prefetch the lines of the `bytes` from p, `ahead` bytes ahead. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, int bytes,
                                                                 int ahead) {
    for (int i = 0; i < bytes; i += 64)
        _mm_prefetch((const char *)p + ahead + i, _MM_HINT_T0);
}

/* One row group of 4-bit weights (q: its Kp / 256 blocks of ROWS x 128
 * bytes; scale, min: ROWS x 8 half floats per block) against TT (1..TILE) activation
 * rows; y[t * N + r] for the group's first `valid` rows. */
static inline __attribute__((always_inline)) void q4_group(
        const uint8_t *q, const uint16_t *scale, const uint16_t *min, int ng,
        const int8_t *a, const float *sa, const float *sasum, int Kp, int TT, int valid,
        float *y, int N) {
    __m256 acc[ROWS][TILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int g0 = 0; g0 < ng; g0 += 8) {
        const uint8_t *qb = q + (size_t)g0 * 16 * ROWS;          /* ROWS x 128 bytes */
        const int8_t *ab = a + (size_t)g0 * GROUP;
        prefetch_ahead(qb, 128 * ROWS, PREFETCH);
        __m256i sums[ROWS][TILE];
        for (int r = 0; r < ROWS; r++)
            for (int t = 0; t < TT; t++) sums[r][t] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i w0[ROWS], w1[ROWS];
            for (int r = 0; r < ROWS; r++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * p + r)));
                w0[r] = _mm256_and_si256(packed, nibble);
                w1[r] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            }
            for (int t = 0; t < TT; t++) {
                const int8_t *at = ab + (size_t)t * Kp + 64 * p;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)at);
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(at + 32));
                /* Load once for the group's rows: left alone, gcc folds the
                   load into each row's product, loading it ROWS times. */
                if (ROWS > 1) __asm__("" : "+x"(x0), "+x"(x1));
                for (int r = 0; r < ROWS; r++) {
                    sums[r][t] = Q4_SUMS(sums[r][t], w0[r], x0, w1[r], x1);
                    /* Keep the sum in a register: without this gcc reorders
                       the sums of a tile's rows and spills the products to
                       the stack, which cost a third of the speed of
                       verifying 4 positions. */
                    __asm__("" : "+x"(sums[r][t]));
                }
            }
        }
        const uint16_t *sb = scale + (size_t)g0 * ROWS, *mb = min + (size_t)g0 * ROWS;
        for (int r = 0; r < ROWS; r++) {
            const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8 * r)));
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mb + 8 * r)));
            for (int t = 0; t < TT; t++) {
                const __m256 dot = _mm256_cvtepi32_ps(Q4_DOT(sums[r][t]));
                const __m256 d = _mm256_loadu_ps(sa + (size_t)t * ng + g0);
                const __m256 ds = _mm256_loadu_ps(sasum + (size_t)t * ng + g0);
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dot, d), sc, acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(mn, ds, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < valid; r++)
        for (int t = 0; t < TT; t++) y[(size_t)t * N + r] = sum_lanes(acc[r][t]);
    (void)ones;
}

#if WIDE
/* [lo | hi] as one 512-bit register. */
static inline __m512 pair_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                               _mm256_castps_pd(hi), 1));
}

/* 8 floats in both halves (a load and a broadcast: no shuffle port). */
static inline __m512 bcast_ps(__m256 v) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
}

/* The outputs of a row group of 4 rows at nt (1..4) positions, from their
 * float sums: a[t] = [row 0 | row 1] and b[t] = [row 2 | row 3] at position
 * t, 8 lanes a row.  Each output is its row's 8 lanes summed as sum_lanes
 * sums them, the same additions of the same values ((v0 + v4) + (v2 + v6),
 * (v1 + v5) + (v3 + v7), then those two), so the same float; times
 * scale[r] after it where scale is given (8-bit rows), as the 256-bit
 * passes multiply.  y[t * N + r] for r < valid.  16 outputs take about 20
 * shuffles and additions here, where sum_lanes takes 6 each (the
 * passes' last step at 8 positions, a few percent of a 1.5B's step). */
static inline __attribute__((always_inline)) void store_sums_wide(
        const __m512 *a, const __m512 *b, int nt, int valid, const float *scale, float *y,
        int N) {
    /* per position, 128-bit lane r: row r's (v0 + v4, v1 + v5, v2 + v6, v3 + v7) */
    __m512 p[4];
    for (int t = 0; t < 4; t++)
        p[t] = t < nt ? _mm512_add_ps(_mm512_shuffle_f32x4(a[t], b[t], 0x88),
                                      _mm512_shuffle_f32x4(a[t], b[t], 0xDD))
                      : p[0];
    /* lane r: ((v0 + v4) + (v2 + v6), (v1 + v5) + (v3 + v7)) of positions 0, 1 (2, 3) */
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x44),
                                     _mm512_shuffle_ps(p[0], p[1], 0xEE));
    const __m512 u23 = nt > 2 ? _mm512_add_ps(_mm512_shuffle_ps(p[2], p[3], 0x44),
                                              _mm512_shuffle_ps(p[2], p[3], 0xEE))
                              : u01;
    /* lane r: row r's outputs at positions 0..3; then lane t: position t's rows 0..3 */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x88),
                                   _mm512_shuffle_ps(u01, u23, 0xDD));
    __m512 out = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
    if (scale) out = _mm512_mul_ps(out, _mm512_broadcast_f32x4(_mm_loadu_ps(scale)));
    const __m128 rows[4] = {_mm512_castps512_ps128(out), _mm512_extractf32x4_ps(out, 1),
                            _mm512_extractf32x4_ps(out, 2), _mm512_extractf32x4_ps(out, 3)};
    for (int t = 0; t < nt; t++) {
        if (valid == 4)
            _mm_storeu_ps(y + (size_t)t * N, rows[t]);
        else
            _mm_mask_storeu_ps(y + (size_t)t * N, (__mmask8)((1u << valid) - 1), rows[t]);
    }
}

/* store_sums_wide over the TT positions of a row group's acc[2][TILE]. */
#define STORE_SUMS_WIDE(acc, TT, valid, scale, y, N)                            \
    for (int t0 = 0; t0 < (TT); t0 += 4)                                        \
        store_sums_wide((acc)[0] + t0, (acc)[1] + t0, (TT) - t0 < 4 ? (TT) - t0 : 4, (valid), \
                        (scale), (y) + (size_t)t0 * (N), (N))

/* The products of a chunk pair (4-bit, or two 6-bit chunks) added to the
 * sums of TT activation rows: for each row pair i, w0[i] holds both rows'
 * chunk 2p and w1[i] their chunk 2p + 1, against the chunks' 32 activation
 * bytes each (at a + t * Kp and 32 bytes on) broadcast to both halves. */
static inline __attribute__((always_inline)) void pair_sums_wide(
        __m512i sums[ROWS / 2][TILE], const __m512i *w0, const __m512i *w1, const int8_t *a,
        int Kp, int TT) {
    for (int t = 0; t < TT; t++) {
        const int8_t *at = a + (size_t)t * Kp;
        __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)at));
        __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(at + 32)));
        __asm__("" : "+v"(x0), "+v"(x1));       /* as in q4_group */
        for (int i = 0; i < ROWS / 2; i++) {
            sums[i][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[i][t], w0[i], x0),
                                             w1[i], x1);
            __asm__("" : "+v"(sums[i][t]));    /* as in q4_group */
        }
    }
}

/* q4_group in 512-bit registers, with the same results (see WIDE above):
 * rows 2i and 2i + 1's 32 bytes of a chunk pair are adjacent (UNIT), so one
 * 512-bit load gives [row 2i | row 2i + 1], and its low and high nibbles are
 * chunks 2p and 2p + 1 of both rows, against the 32 activation bytes of
 * each chunk in both halves.  A sum register's lanes are then the two rows'
 * 8 groups: the float arithmetic runs on them as they are. */
static inline __attribute__((always_inline)) void q4_group_wide(
        const uint8_t *q, const uint16_t *scale, const uint16_t *min, int ng,
        const int8_t *a, const float *sa, const float *sasum, int Kp, int TT, int valid,
        float *y, int N) {
    __m512 acc[ROWS / 2][TILE];
    for (int i = 0; i < ROWS / 2; i++)
        for (int t = 0; t < TT; t++) acc[i][t] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int g0 = 0; g0 < ng; g0 += 8) {
        const uint8_t *qb = q + (size_t)g0 * 16 * ROWS;          /* ROWS x 128 bytes */
        const int8_t *ab = a + (size_t)g0 * GROUP;
        prefetch_ahead(qb, 128 * ROWS, PREFETCH);
        __m512i sums[ROWS / 2][TILE];
        for (int i = 0; i < ROWS / 2; i++)
            for (int t = 0; t < TT; t++) sums[i][t] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i w0[ROWS / 2], w1[ROWS / 2];
            for (int i = 0; i < ROWS / 2; i++) {
                const __m512i packed = _mm512_loadu_si512((const void *)(qb + UNIT * (ROWS * p + 2 * i)));
                w0[i] = _mm512_and_si512(packed, nibble);
                w1[i] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            }
            pair_sums_wide(sums, w0, w1, ab + 64 * p, Kp, TT);
        }
        /* Rows r and r + 1's 8 half-float scales and minimums are adjacent. */
        const uint16_t *sb = scale + (size_t)g0 * ROWS, *mb = min + (size_t)g0 * ROWS;
        __m512 sc[ROWS / 2], mn[ROWS / 2];
        for (int i = 0; i < ROWS / 2; i++) {
            sc[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 16 * i)));
            mn[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mb + 16 * i)));
        }
        for (int t = 0; t < TT; t++) {
            const __m512 d = bcast_ps(_mm256_loadu_ps(sa + (size_t)t * ng + g0));
            const __m512 ds = bcast_ps(_mm256_loadu_ps(sasum + (size_t)t * ng + g0));
            for (int i = 0; i < ROWS / 2; i++) {
                const __m512 dot = _mm512_cvtepi32_ps(sums[i][t]);
                acc[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(dot, d), sc[i], acc[i][t]);
                acc[i][t] = _mm512_fmadd_ps(mn[i], ds, acc[i][t]);
            }
        }
    }
    STORE_SUMS_WIDE(acc, TT, valid, NULL, y, N);
}
#endif

/* One row group of 8-bit weights (q: its Kp / 256 blocks of ROWS x 256
 * bytes; scale: its ROWS row scales) against TT (1..TILE) activation rows;
 * y[t * N + r] for the group's first `valid` rows. */
static inline __attribute__((always_inline)) void q8_group(
        const int8_t *q, const float *scale, int ng, const int8_t *a, const float *sa, int Kp,
        int TT, int valid, float *y, int N) {
    __m256 acc[ROWS][TILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    int g0 = 0;
    for (; g0 + 8 <= ng; g0 += 8) {
        const int8_t *qb = q + (size_t)g0 * GROUP * ROWS;         /* ROWS x 256 bytes */
        const int8_t *ab = a + (size_t)g0 * GROUP;
        prefetch_ahead(qb, 256 * ROWS, 2 * PREFETCH);
        __m256i s32[ROWS][TILE];
        for (int r = 0; r < ROWS; r++)
            for (int t = 0; t < TT; t++) s32[r][t] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            __m256i w[ROWS], wabs[ROWS];
            for (int r = 0; r < ROWS; r++) {
                w[r] = _mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * i + r)));
                wabs[r] = _mm256_sign_epi8(w[r], w[r]);  /* -128 stays 128 unsigned */
            }
            for (int t = 0; t < TT; t++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(ab + (size_t)t * Kp + 32 * i));
                if (ROWS > 1) __asm__("" : "+x"(x));      /* as in q4_group */
                for (int r = 0; r < ROWS; r++) {
                    s32[r][t] = SUMS1(s32[r][t], wabs[r], _mm256_sign_epi8(x, w[r]));
                    __asm__("" : "+x"(s32[r][t]));      /* as in q4_group */
                }
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int t = 0; t < TT; t++)
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r][t]),
                                            _mm256_loadu_ps(sa + (size_t)t * ng + g0),
                                            acc[r][t]);
    }
#if ROWS == 1
    if (g0 < ng) {
        /* The half block (see HALF): each 32 bytes hold chunks 2i (groups
           0-3 in lanes 0-3) and 2i + 1 (lanes 4-7); a group's sum is its two
           lanes' (integers: exact).  Lanes 4-7 then get +0 times a scale of
           +0, as a whole block's zero-padded groups do, so the results are
           those of the same matrix padded to 256, bit for bit. */
        const int8_t *qb = q + (size_t)g0 * GROUP, *ab = a + (size_t)g0 * GROUP;
        __m256i s32[TILE];
        for (int t = 0; t < TT; t++) s32[t] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qb + 32 * i));
            const __m256i wabs = _mm256_sign_epi8(w, w);
            for (int t = 0; t < TT; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(ab + (size_t)t * Kp
                                                                       + 32 * i));
                s32[t] = SUMS1(s32[t], wabs, _mm256_sign_epi8(x, w));
            }
        }
        for (int t = 0; t < TT; t++) {
            const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(s32[t]),
                                               _mm256_extracti128_si256(s32[t], 1));
            const __m256 d = _mm256_insertf128_ps(_mm256_setzero_ps(),
                                                  _mm_loadu_ps(sa + (size_t)t * ng + g0), 0);
            acc[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_inserti128_si256(
                _mm256_setzero_si256(), half, 0)), d, acc[0][t]);
        }
    }
#endif
    for (int r = 0; r < valid; r++)
        for (int t = 0; t < TT; t++) y[(size_t)t * N + r] = scale[r] * sum_lanes(acc[r][t]);
    (void)ones;
}

/* Half-group sums of int8 activations, times 32 (the 6-bit weights' offset):
 * hs [T, 2 * ng]; for block b, hs[16 b .. 16 b + 7] are the first halves
 * (chunks 0-3) of its 8 groups, hs[16 b + 8 ..] the second halves. */
static void half_sums(const int8_t *a, int T, int Kp, int32_t *hs) {
    const int nb = Kp / BLOCK;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < nb; b++) {
            const int8_t *ab = a + (size_t)t * Kp + (size_t)b * BLOCK;
            __m256i half[2];
            for (int h = 0; h < 2; h++) {
                __m256i s = _mm256_setzero_si256();
                for (int i = 4 * h; i < 4 * h + 4; i++)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        ones8, _mm256_loadu_si256((const __m256i *)(ab + 32 * i))), ones16));
                half[h] = _mm256_slli_epi32(s, 5);
            }
            int32_t *out = hs + (size_t)t * 2 * (Kp / GROUP) + 16 * b;
            _mm256_storeu_si256((__m256i *)out, half[0]);
            _mm256_storeu_si256((__m256i *)(out + 8), half[1]);
        }
    }
}

/* Chunks 2p and 2p+1 of a 6-bit block as unsigned bytes (0..63), from a
 * row's 32 bytes of low bits (packed) and 32 bytes of high bits (hv). */
static inline __attribute__((always_inline)) void q6_chunks(
        __m256i packed, __m256i hv, int p, __m256i *w0, __m256i *w1) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    /* chunk 4r + i keeps its high bits at 2i: move them to bit 4 (the and
       drops what a 16-bit shift carries over from the neighbouring byte) */
    const __m256i h0 = p % 2 == 0 ? _mm256_slli_epi16(hv, 4) : hv;
    const __m256i h1 = p % 2 == 0 ? _mm256_slli_epi16(hv, 2) : _mm256_srli_epi16(hv, 2);
    *w0 = _mm256_or_si256(_mm256_and_si256(packed, nibble), _mm256_and_si256(h0, high));
    *w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                          _mm256_and_si256(h1, high));
}

/* One row group of 6-bit weights (ql: its Kp / 256 blocks of ROWS x 128
 * bytes of low bits; qh: ROWS x 64 bytes of high bits; sc: ROWS x 16 int8
 * scales; dw: ROWS floats per block) against TT (1..TILE) activation rows;
 * y[t * N + r] for the group's first `valid` rows. */
static inline __attribute__((always_inline)) void q6_group(
        const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *dw, int ng,
        const int8_t *a, const float *sa, const int32_t *hs, int Kp, int TT, int valid,
        float *y, int N) {
    __m256 acc[ROWS][TILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g0 = 0; g0 < ng; g0 += 8) {
        const int b = g0 / 8;
        const uint8_t *qb = ql + (size_t)b * 128 * ROWS, *hb = qh + (size_t)b * 64 * ROWS;
        prefetch_ahead(qb, 128 * ROWS, PREFETCH);
        prefetch_ahead(hb, 64 * ROWS, PREFETCH / 2);
        /* Unrolled, so that p % 2 is known in each copy: left as loops, gcc
           tested it at run time and q6_chunks' shifts went through a branch
           and register copies (the 6-bit products of a prompt block ran 1.25
           to 1.35 times slower on a Zen 3). */
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {          /* first halves, then second halves */
            __m256i hv[ROWS], s32[ROWS][TILE];
            for (int r = 0; r < ROWS; r++) {
                hv[r] = _mm256_loadu_si256((const __m256i *)(hb + UNIT * (ROWS * h + r)));
                for (int t = 0; t < TT; t++) s32[r][t] = _mm256_setzero_si256();
            }
            #pragma GCC unroll 2
            for (int p = 2 * h; p < 2 * h + 2; p++) {
                __m256i w0[ROWS], w1[ROWS];
                for (int r = 0; r < ROWS; r++)
                    q6_chunks(_mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * p + r))),
                              hv[r], p, &w0[r], &w1[r]);
                for (int t = 0; t < TT; t++) {
                    const int8_t *at = a + (size_t)t * Kp + (size_t)b * BLOCK + 64 * p;
                    __m256i x0 = _mm256_loadu_si256((const __m256i *)at);
                    __m256i x1 = _mm256_loadu_si256((const __m256i *)(at + 32));
                    if (ROWS > 1) __asm__("" : "+x"(x0), "+x"(x1));   /* as in q4_group */
                    for (int r = 0; r < ROWS; r++) {
                        s32[r][t] = SUMS2(s32[r][t], w0[r], x0, w1[r], x1);
                        __asm__("" : "+x"(s32[r][t]));  /* as in q4_group */
                    }
                }
            }
            for (int r = 0; r < ROWS; r++) {
                const __m256 scale = _mm256_mul_ps(
                    _mm256_set1_ps(dw[(size_t)b * ROWS + r]),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        (const __m128i *)(sc + (size_t)b * 16 * ROWS + 16 * r + 8 * h)))));
                for (int t = 0; t < TT; t++) {
                    const __m256i offset = _mm256_loadu_si256(
                        (const __m256i *)(hs + (size_t)t * 2 * ng + 2 * g0 + 8 * h));
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(s32[r][t], offset));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dot, scale),
                                                _mm256_loadu_ps(sa + (size_t)t * ng + g0),
                                                acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < valid; r++)
        for (int t = 0; t < TT; t++) y[(size_t)t * N + r] = sum_lanes(acc[r][t]);
    (void)ones;
}

#if WIDE
/* q6_chunks on [row 2i | row 2i + 1] (see q4_group_wide). */
static inline __attribute__((always_inline)) void q6_chunks_wide(
        __m512i packed, __m512i hv, int p, __m512i *w0, __m512i *w1) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    const __m512i h0 = p % 2 == 0 ? _mm512_slli_epi16(hv, 4) : hv;
    const __m512i h1 = p % 2 == 0 ? _mm512_slli_epi16(hv, 2) : _mm512_srli_epi16(hv, 2);
    /* (x & nibble) | (h & ~nibble) in one vpternlogd, h cut to bits 4-5
       first: the same bytes as q6_chunks' and, and, or, in one op less */
    *w0 = _mm512_ternarylogic_epi32(packed, _mm512_and_si512(h0, high), nibble, 0xE4);
    *w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), _mm512_and_si512(h1, high),
                                    nibble, 0xE4);
}

/* q6_group in 512-bit registers, with the same results (see WIDE above),
 * two rows a register as in q4_group_wide. */
static inline __attribute__((always_inline)) void q6_group_wide(
        const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *dw, int ng,
        const int8_t *a, const float *sa, const int32_t *hs, int Kp, int TT, int valid,
        float *y, int N) {
    __m512 acc[ROWS / 2][TILE];
    for (int i = 0; i < ROWS / 2; i++)
        for (int t = 0; t < TT; t++) acc[i][t] = _mm512_setzero_ps();
    for (int g0 = 0; g0 < ng; g0 += 8) {
        const int b = g0 / 8;
        const uint8_t *qb = ql + (size_t)b * 128 * ROWS, *hb = qh + (size_t)b * 64 * ROWS;
        prefetch_ahead(qb, 128 * ROWS, PREFETCH);
        prefetch_ahead(hb, 64 * ROWS, PREFETCH / 2);
        /* Unrolled as in q6_group: left as loops, gcc tested p % 2 at run
           time here too (the 6-bit products ran 1.12 times slower on a
           Zen 4, 2 threads). */
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {          /* first halves, then second halves */
            __m512i hv[ROWS / 2], sums[ROWS / 2][TILE];
            for (int i = 0; i < ROWS / 2; i++) {
                hv[i] = _mm512_loadu_si512((const void *)(hb + UNIT * (ROWS * h + 2 * i)));
                for (int t = 0; t < TT; t++) sums[i][t] = _mm512_setzero_si512();
            }
            #pragma GCC unroll 2
            for (int p = 2 * h; p < 2 * h + 2; p++) {
                __m512i w0[ROWS / 2], w1[ROWS / 2];
                for (int i = 0; i < ROWS / 2; i++)
                    q6_chunks_wide(_mm512_loadu_si512((const void *)(qb + UNIT * (ROWS * p + 2 * i))),
                                   hv[i], p, &w0[i], &w1[i]);
                pair_sums_wide(sums, w0, w1, a + (size_t)b * BLOCK + 64 * p, Kp, TT);
            }
            /* [row r | row r + 1]'s scales: d times the half groups' int8s. */
            __m512 scale[ROWS / 2];
            for (int i = 0; i < ROWS / 2; i++) {
                const int8_t *s0 = sc + (size_t)b * 16 * ROWS + 32 * i + 8 * h;
                const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)s0),
                                                        _mm_loadl_epi64((const __m128i *)(s0 + 16)));
                scale[i] = _mm512_mul_ps(pair_ps(_mm256_set1_ps(dw[(size_t)b * ROWS + 2 * i]),
                                                 _mm256_set1_ps(dw[(size_t)b * ROWS + 2 * i + 1])),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both)));
            }
            for (int t = 0; t < TT; t++) {
                const __m512i offset = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    (const __m256i *)(hs + (size_t)t * 2 * ng + 2 * g0 + 8 * h)));
                const __m512 d = bcast_ps(_mm256_loadu_ps(sa + (size_t)t * ng + g0));
                for (int i = 0; i < ROWS / 2; i++) {
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[i][t], offset));
                    acc[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(dot, scale[i]), d, acc[i][t]);
                }
            }
        }
    }
    STORE_SUMS_WIDE(acc, TT, valid, NULL, y, N);
}
#define Q4_GROUP q4_group_wide
#define Q6_GROUP q6_group_wide
#else
#define Q4_GROUP q4_group
#define Q6_GROUP q6_group
#endif

#if WIDE && defined(__AVX512BW__)
/* q8_group in 512-bit registers, with the same results (see WIDE above):
 * a chunk of rows 2i and 2i + 1 in one register (adjacent, as in
 * q4_group_wide), against the chunk's 32 activation bytes in both halves.
 * There is no 512-bit vpsignb: the weights' magnitudes are vpabsb's (-128
 * stays 128 unsigned, as vpsignb leaves it) and the activations are negated
 * where the weight is negative; where it is 0 the product is 0 either way. */
static inline __attribute__((always_inline)) void q8_group_wide(
        const int8_t *q, const float *scale, int ng, const int8_t *a, const float *sa, int Kp,
        int TT, int valid, float *y, int N) {
    __m512 acc[ROWS / 2][TILE];
    for (int i = 0; i < ROWS / 2; i++)
        for (int t = 0; t < TT; t++) acc[i][t] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int g0 = 0; g0 < ng; g0 += 8) {
        const int8_t *qb = q + (size_t)g0 * GROUP * ROWS;         /* ROWS x 256 bytes */
        const int8_t *ab = a + (size_t)g0 * GROUP;
        prefetch_ahead(qb, 256 * ROWS, 2 * PREFETCH);
        __m512i sums[ROWS / 2][TILE];
        for (int i = 0; i < ROWS / 2; i++)
            for (int t = 0; t < TT; t++) sums[i][t] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i wabs[ROWS / 2];
            __mmask64 negative[ROWS / 2];
            for (int i = 0; i < ROWS / 2; i++) {
                const __m512i w = _mm512_loadu_si512((const void *)(qb + UNIT * (ROWS * c + 2 * i)));
                wabs[i] = _mm512_abs_epi8(w);
                negative[i] = _mm512_movepi8_mask(w);
            }
            for (int t = 0; t < TT; t++) {
                __m512i x = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(ab + (size_t)t * Kp + 32 * c)));
                __asm__("" : "+v"(x));                  /* as in q4_group */
                for (int i = 0; i < ROWS / 2; i++) {
                    sums[i][t] = _mm512_dpbusd_epi32(
                        sums[i][t], wabs[i], _mm512_mask_sub_epi8(x, negative[i], zero, x));
                    __asm__("" : "+v"(sums[i][t]));    /* as in q4_group */
                }
            }
        }
        for (int t = 0; t < TT; t++) {
            const __m512 d = bcast_ps(_mm256_loadu_ps(sa + (size_t)t * ng + g0));
            for (int i = 0; i < ROWS / 2; i++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][t]), d, acc[i][t]);
        }
    }
    STORE_SUMS_WIDE(acc, TT, valid, scale, y, N);
}
#define Q8_GROUP q8_group_wide
#else
#define Q8_GROUP q8_group
#endif

/* The row groups of output rows n0..n1 (n0 a multiple of ROWS) against every
 * activation row, in passes of at most TILE activation rows, of even sizes:
 * CALL(n, t0, TT, valid)
 * runs the group of rows n.. with a constant TT (the cases above TILE are
 * never taken). */
#define FOR_TILES(CALL)                                                         \
    const int passes = (T + TILE - 1) / TILE;                                   \
    for (int i = 0, t0 = 0; i < passes; t0 += T / passes + (i < T % passes), i++) { \
        /* passes of even sizes: 7 positions as 4 + 3, not 6 + 1 */            \
        const int TT = T / passes + (i < T % passes);                          \
        for (int n = n0; n < n1; n += ROWS) {                                   \
            const int valid = N - n < ROWS ? N - n : ROWS;                      \
            switch (TT) {                                                       \
                case 8: CALL(n, t0, TILE < 8 ? TILE : 8, valid); break;         \
                case 7: CALL(n, t0, TILE < 7 ? TILE : 7, valid); break;         \
                case 6: CALL(n, t0, TILE < 6 ? TILE : 6, valid); break;         \
                case 5: CALL(n, t0, TILE < 5 ? TILE : 5, valid); break;         \
                case 4: CALL(n, t0, TILE < 4 ? TILE : 4, valid); break;         \
                case 3: CALL(n, t0, TILE < 3 ? TILE : 3, valid); break;         \
                case 2: CALL(n, t0, TILE < 2 ? TILE : 2, valid); break;         \
                default: CALL(n, t0, 1, valid); break;                          \
            }                                                                   \
        }                                                                       \
    }
#define FOR_CHUNKS                                                              \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")          \
    for (int c = 0; c < (N + ROW_CHUNK - 1) / ROW_CHUNK; c++)

/* q: [Np, Kp / 2] packed nibbles; scale, min: [Np, Kp / 32] half floats, in
 * row groups (Np: N rounded up to 4); a, sa, sasum from fr_quantize_rows;
 * y: [T, N] float32. */
void fr_q4_matmul(const uint8_t *q, const uint16_t *scale, const uint16_t *min, int N,
                  int Kp, const int8_t *a, const float *sa, const float *sasum, int T,
                  float *y, int threads) {
    const int ng = Kp / GROUP;
#ifdef FR_AMX
    if (TILES(T) && fr_amx_q4_matmul(q, scale, min, N, Kp, a, sa, sasum, T, y, threads) == 0)
        return;
#endif
    FOR_CHUNKS {
        const int n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
#define Q4_CALL(n, t0, TT_, valid)                                              \
    Q4_GROUP(q + (size_t)n * (Kp / 2), scale + (size_t)n * ng, min + (size_t)n * ng, ng, \
             a + (size_t)t0 * Kp, sa + (size_t)t0 * ng, sasum + (size_t)t0 * ng, Kp, TT_, \
             valid, y + (size_t)t0 * N + n, N)
        FOR_TILES(Q4_CALL)
    }
}

/* q: [Np, Kp] int8 in the chunk layout, in row groups; scale: [Np] float32. */
void fr_q8_matmul(const int8_t *q, const float *scale, int N, int Kp, const int8_t *a,
                  const float *sa, int T, float *y, int threads) {
    const int ng = Kp / GROUP;
#ifdef FR_AMX
    if (TILES(T) && fr_amx_q8_matmul(q, scale, N, Kp, a, sa, T, y, threads) == 0) return;
#endif
    FOR_CHUNKS {
        const int n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
#define Q8_CALL(n, t0, TT_, valid)                                              \
    Q8_GROUP(q + (size_t)n * Kp, scale + n, ng, a + (size_t)t0 * Kp, sa + (size_t)t0 * ng, \
             Kp, TT_, valid, y + (size_t)t0 * N + n, N)
        FOR_TILES(Q8_CALL)
    }
}

/* ql: [Np, Kp / 2] packed low nibbles; qh: [Np, Kp / 4] high bits; sc:
 * [Np, Kp / 16] int8 half-group scales; d: [Np, Kp / 256] float32, in row
 * groups; a, sa from fr_quantize_rows, hs from half_sums; y: [T, N] float32. */
static void q6_matmul(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *d,
                      int N, int Kp, const int8_t *a, const float *sa, const int32_t *hs,
                      int T, float *y, int threads) {
    const int ng = Kp / GROUP;
    FOR_CHUNKS {
        const int n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
#define Q6_CALL(n, t0, TT_, valid)                                              \
    Q6_GROUP(ql + (size_t)n * (Kp / 2), qh + (size_t)n * (Kp / 4), sc + (size_t)n * (Kp / 16), \
             d + (size_t)n * (Kp / BLOCK), ng, a + (size_t)t0 * Kp, sa + (size_t)t0 * ng, \
             hs + (size_t)t0 * 2 * ng, Kp, TT_, valid, y + (size_t)t0 * N + n, N)
        FOR_TILES(Q6_CALL)
    }
}

/* A layer's whole product in one call: x [T, K] float32 quantized into
 * scratch memory of this call's own (so concurrent callers share nothing),
 * then multiplied.  Returns 0, or -1 when the scratch can't be allocated. */
static int scratch(int T, int Kp, int8_t **a, float **sa, float **sasum) {
    const size_t groups = (size_t)T * (Kp / GROUP);
    /* On whole cache lines: with malloc's 16 bytes, every other 32-byte load
       of the activations crossed two lines (a prompt block's 4-bit products
       ran 1.07 to 1.14 times slower on a Zen 3). */
    *a = aligned_alloc(64, ((size_t)T * Kp + 63) / 64 * 64);
    *sa = malloc(groups * sizeof(float));
    *sasum = malloc(groups * sizeof(float));
    if (*a && *sa && *sasum) return 0;
    free(*a); free(*sa); free(*sasum);
    return -1;
}

int fr_q4_linear(const float *x, int T, int K, int Kp, const uint8_t *q,
                 const uint16_t *scale, const uint16_t *min, int N, float *y, int threads) {
    int8_t *a; float *sa, *sasum;
    if (Kp % BLOCK) return -2;
    if (scratch(T, Kp, &a, &sa, &sasum)) return -1;
    quantize_rows(x, T, K, Kp, a, sa, sasum, threads);
    fr_q4_matmul(q, scale, min, N, Kp, a, sa, sasum, T, y, threads);
    free(a); free(sa); free(sasum);
    return 0;
}

int fr_q8_linear(const float *x, int T, int K, int Kp, const int8_t *q, const float *scale,
                 int N, float *y, int threads) {
    int8_t *a; float *sa, *sasum;
    if (Kp % HALF) return -2;
    if (scratch(T, Kp, &a, &sa, &sasum)) return -1;
    quantize_rows(x, T, K, Kp, a, sa, sasum, threads);
    fr_q8_matmul(q, scale, N, Kp, a, sa, T, y, threads);
    free(a); free(sa); free(sasum);
    return 0;
}

int fr_q6_linear(const float *x, int T, int K, int Kp, const uint8_t *ql, const uint8_t *qh,
                 const int8_t *sc, const float *d, int N, float *y, int threads) {
    int8_t *a; float *sa, *sasum;
    if (Kp % BLOCK) return -2;
    if (scratch(T, Kp, &a, &sa, &sasum)) return -1;
    int32_t *hs = malloc((size_t)T * 2 * (Kp / GROUP) * sizeof(int32_t));
    if (!hs) { free(a); free(sa); free(sasum); return -1; }
    quantize_rows(x, T, K, Kp, a, sa, sasum, threads);
#ifdef FR_AMX
    if (TILES(T) && fr_amx_q6_matmul(ql, qh, sc, d, N, Kp, a, sa, T, y, threads) == 0) {
        free(a); free(sa); free(sasum); free(hs);
        return 0;
    }
#endif
    half_sums(a, T, Kp, hs);
    q6_matmul(ql, qh, sc, d, N, Kp, a, sa, hs, T, y, threads);
    free(a); free(sa); free(sasum); free(hs);
    return 0;
}
