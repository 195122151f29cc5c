/* forerun's matrix products of many positions on Intel AMX (the tile
 * registers and their int8 dot products, TDPBUSD/TDPBSSD), for the builds
 * compiled with FR_AMX (see build.py).  Everything else in such a build is
 * the AVX512-VNNI build: the same weight layouts, the same quantized
 * activations, the same results bit for bit.
 *
 * A tile product multiplies 16 weight rows by 16 positions over 32 values
 * (one group) in one instruction: an exact int32 sum per (row, position),
 * as the vpdpbusd passes compute it lane by lane.  Each group's sums then
 * go through the very float operations avx2_int_products.c runs, in the
 * same order per (row, position): a sum times the activations' scale, then
 * fused with the weights' scale (4-bit: and the minimum times the scaled
 * activation sum; 6-bit: per half group of 16, with the weights' values less
 * 32 summed directly, signed), accumulated in 8 lanes by the group's place
 * in its block of 256, and the 8 lanes summed as sum_lanes sums them.  So a
 * position's result is the same whether 1 position (the vpdpbusd passes) or
 * 500 (these) are fed: forerun's row invariance holds across the switch.
 *
 * Layout work.  The weights stay in the build's layout (row groups of 4,
 * values in the chunk layout); a thread unpacks 16 rows (4 row groups) at a
 * time into bytes in natural order per group (an 8 x 8 transpose of 4-byte
 * pieces per block), with their scales as floats, and runs every position
 * against them.  The activations are repacked once per call into the
 * tiles' order (for each 16 positions and group: 8 rows of 16 x 4 bytes).
 * Both costs are paid once per 16 rows or once per call, so many positions
 * amortize them; a few positions run faster in the vpdpbusd passes, which
 * is why the products take this path only from fr_amx_rows() positions up.
 *
 * The tile registers need the kernel's permission (arch_prctl), asked for
 * once per process; where it is refused the products run the vpdpbusd
 * passes, with the same results. */

#ifdef FR_AMX

#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AVX512VL__) || !defined(__AVX512BW__)
#error "the AMX products are built on the AVX512-VNNI build's layout (row groups of 4)"
#endif

#define GROUP 32
#define BLOCK 256
#define UNIT 32
#define ROWS 4           /* the layout's row group (the AVX512 builds') */
#define TM 16            /* weight rows per tile */
#define TN 16            /* positions per tile */
#define TILE_BYTES 512   /* 16 x 32 weight bytes, or 8 x 64 activation bytes */

/* Positions from which the products take the tiles (fr_set_amx_rows
 * changes it; benchmarks/products_ab.py --build amx measures where they
 * start to pay).  On a Xeon with AMX (2 threads, 16 to 128 positions of the
 * 1.5B's 8960 x 1536 and 1536 x 8960 products) the tiles took 0.69 to 0.80
 * of the vpdpbusd passes' time at 128 positions, 0.85 to 0.95 at 64 and
 * 0.98 to 1.30 at 32: the unpacking of 16 rows is paid once for all the
 * positions, and the float steps of every group cost what they cost in the
 * passes.  With the lanes run one by one (run_tile), over a whole step's
 * products (28 layers and the LM head, --build amx --tile-rows 1): 0.90 of
 * the passes' time at 128 positions, 1.03 at 64, 1.09 at 48, 1.24 at 32. */
static int amx_rows = 64;

int fr_amx_rows(void) { return amx_rows; }
void fr_set_amx_rows(int rows) { amx_rows = rows > 1 ? rows : 1; }

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void request_amx(void) {
    amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Whether this process may use the tile registers (asked once). */
int fr_amx_ready(void) {
    pthread_once(&amx_once, request_amx);
    return amx_permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles 0 and 1: sums (16 x 16 int32); 2 and 6: weights (16 rows of 32
 * values, 6-bit: of a half group's 16); 3 and 7: activations (8 rows of 16
 * positions x 4 values, 6-bit: 4 rows). */
static void configure_tiles(int half_groups) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16; c.colsb[0] = c.colsb[1] = 64;
    c.rows[2] = c.rows[6] = 16; c.colsb[2] = c.colsb[6] = half_groups ? 16 : 32;
    c.rows[3] = c.rows[7] = half_groups ? 4 : 8; c.colsb[3] = c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* One small tile product checked against the same sums in scalar code:
 * 1 where the tiles compute here, 0 where the OS refuses them, -1 where
 * they compute wrongly.  Run in a process of its own before a process
 * uses the tiles (self_check.check_tiles_in_a_process): a machine that
 * advertises AMX but faults on it ends that process, not the user's. */
int fr_amx_probe(void) {
    if (!fr_amx_ready()) return 0;
    static uint8_t w[16 * 32] __attribute__((aligned(64)));
    static int8_t x[8 * 64] __attribute__((aligned(64)));
    static int32_t out[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) w[i] = (uint8_t)(i * 7 % 16);
    for (int i = 0; i < 8 * 64; i++) x[i] = (int8_t)(i * 13 % 255 - 127);
    configure_tiles(0);
    _tile_zero(0);
    _tile_loadd(2, w, 32);
    _tile_loadd(3, x, 64);
    _tile_dpbusd(0, 2, 3);
    _tile_stored(0, out, 64);
    _tile_release();
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            int32_t want = 0;
            for (int k = 0; k < 32; k++) want += w[32 * m + k] * x[64 * (k / 4) + 4 * n + k % 4];
            if (out[16 * m + n] != want) return -1;
        }
    return 1;
}

/* 8 x 8 four-byte pieces transposed: c[i] holds chunk i (piece L: values
 * 4i..4i+3 of group L); g[L] then holds group L's 32 values in order. */
static inline void transpose_chunks(const __m256i c[8], __m256i g[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(c[i], c[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(c[i], c[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        g[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        g[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* Store a block's 8 groups of one weight row into the tile buffer w
 * ([ng][16 rows][32]) at row `row`. */
static inline void store_groups(const __m256i c[8], uint8_t *w, int b, int row) {
    __m256i g[8];
    transpose_chunks(c, g);
    for (int L = 0; L < 8; L++)
        _mm256_store_si256((__m256i *)(w + (size_t)(8 * b + L) * TILE_BYTES + UNIT * row), g[L]);
}

/* The activations in the tiles' order.  a: [T, Kp] int8 in the chunk
 * layout; bp: [Tp / 16][ng][8][16][4] where bp[tt][g][i][t] holds values
 * 4i..4i+3 of group g of position 16 tt + t (zeros past T).  d and ds:
 * [Tp / 16][ng][16], the groups' scales and scaled sums (ds may be NULL). */
static void pack_activations(const int8_t *a, const float *sa, const float *sasum, int T,
                             int Kp, int Tp, uint8_t *bp, float *d, float *ds, int threads) {
    const int ng = Kp / GROUP, tiles = Tp / TN;
#pragma omp parallel for num_threads(threads) schedule(static) if (tiles > 1)
    for (int tt = 0; tt < tiles; tt++) {
        const int valid = T - tt * TN < TN ? T - tt * TN : TN;
        const __mmask16 live = (__mmask16)((1u << valid) - 1);
        const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(Kp / 4));
        /* (position t's bytes lie t * Kp on: index t * Kp / 4, scale 4) */
        const int8_t *at = a + (size_t)tt * TN * Kp;
        for (int g = 0; g < ng; g++) {
            const int b = g / 8, L = g % 8;
            uint8_t *out = bp + ((size_t)tt * ng + g) * TILE_BYTES;
            for (int i = 0; i < 8; i++) {
                const __m512i v = _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), live, rows,
                    (const void *)(at + (size_t)b * BLOCK + 32 * i + 4 * L), 4);
                _mm512_store_si512((void *)(out + 64 * i), v);
            }
            float *dt = d + ((size_t)tt * ng + g) * TN;
            float *dst = ds ? ds + ((size_t)tt * ng + g) * TN : NULL;
            for (int t = 0; t < TN; t++) {
                dt[t] = t < valid ? sa[(size_t)(tt * TN + t) * ng + g] : 0.0f;
                if (dst) dst[t] = t < valid ? sasum[(size_t)(tt * TN + t) * ng + g] : 0.0f;
            }
        }
    }
}

/* The 8 lanes of acc ([16 rows][8][16 positions]) summed as sum_lanes does
 * (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))), times scale[row]
 * when scale is given, into y[t * N + n0 + row] for the valid rows and
 * positions: 16 rows of a position in one store (a gather across the
 * rows' sums), not 256 scalar stores 4N bytes apart. */
static void write_rows(const __m512 *acc, const float *scale, int n0, int rows, int t0,
                       int positions, float *y, int N) {
    float out[TM * TN] __attribute__((aligned(64)));     /* [row][position] */
    for (int r = 0; r < TM; r++) {
        const __m512 *l = acc + 8 * r;
        __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]),
                                               _mm512_add_ps(l[2], l[6])),
                                 _mm512_add_ps(_mm512_add_ps(l[1], l[5]),
                                               _mm512_add_ps(l[3], l[7])));
        if (scale && r < rows) s = _mm512_mul_ps(_mm512_set1_ps(scale[n0 + r]), s);
        _mm512_store_ps(out + TN * r, s);
    }
    /* Position t's 16 rows are column t of out: one gather, one store. */
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(TN));
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    for (int t = 0; t < positions; t++)
        _mm512_mask_storeu_ps(y + (size_t)(t0 + t) * N + n0, live,
                              _mm512_i32gather_ps(column, out + t, 4));
}

/* One thread's buffers: 16 rows' weights unpacked ([ng][16][32]), their
 * per-group float scales ([ng][2][16]: 4-bit scale and minimum, 6-bit the
 * two halves' scales), the sums of two units and the accumulators of 16
 * rows x 8 lanes x 16 positions. */
typedef struct {
    uint8_t *w;
    float *scales;
    int32_t *sums;
    __m512 *acc;
} buffers;

static int allocate(buffers *m, int ng) {
    m->w = aligned_alloc(64, (size_t)ng * TILE_BYTES);
    m->scales = aligned_alloc(64, (size_t)ng * 2 * TM * sizeof(float));
    m->sums = aligned_alloc(64, 2 * TM * TN * sizeof(int32_t));
    m->acc = aligned_alloc(64, (size_t)TM * 8 * sizeof(__m512));
    return m->w && m->scales && m->sums && m->acc ? 0 : -1;
}

static void release(buffers *m) {
    free(m->w); free(m->scales); free(m->sums); free(m->acc);
}

enum kind { Q4, Q8, Q6 };

/* Row `row` of m past the matrix (its row groups end at Np): zero weights
 * and scales, so its sums are 0 and no byte past the matrix is read. */
static void zero_row(buffers *m, int ng, int row) {
    for (int g = 0; g < ng; g++) {
        memset(m->w + (size_t)g * TILE_BYTES + UNIT * row, 0, UNIT);
        m->scales[(2 * g) * TM + row] = m->scales[(2 * g + 1) * TM + row] = 0.0f;
    }
}

/* Rows n0.. (a multiple of 16, row groups past Np zero) unpacked into m. */
static void unpack_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *min, int Np,
                      int Kp, int n0, buffers *m) {
    const int ng = Kp / GROUP, nb = Kp / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int row = 0; row < TM; row++) {
        const int n = n0 + row, r = row % ROWS;
        if (n >= Np) {
            zero_row(m, ng, row);
            continue;
        }
        const uint8_t *base = q + (size_t)(n - r) * (Kp / 2);
        const uint16_t *sbase = scale + (size_t)(n - r) * ng, *mbase = min + (size_t)(n - r) * ng;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = base + (size_t)b * 128 * ROWS;
            __m256i c[8];
            for (int p = 0; p < 4; p++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * p + r)));
                c[2 * p] = _mm256_and_si256(packed, nibble);
                c[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            }
            store_groups(c, m->w, b, row);
            float sc[8], mn[8];
            _mm256_storeu_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)(sbase + (size_t)b * 8 * ROWS + 8 * r))));
            _mm256_storeu_ps(mn, _mm256_cvtph_ps(_mm_loadu_si128(
                (const __m128i *)(mbase + (size_t)b * 8 * ROWS + 8 * r))));
            for (int L = 0; L < 8; L++) {
                m->scales[(2 * (8 * b + L)) * TM + row] = sc[L];
                m->scales[(2 * (8 * b + L) + 1) * TM + row] = mn[L];
            }
        }
    }
}

static void unpack_q8(const int8_t *q, int Np, int Kp, int n0, buffers *m) {
    const int ng = Kp / GROUP, nb = Kp / BLOCK;
    for (int row = 0; row < TM; row++) {
        const int n = n0 + row, r = row % ROWS;
        if (n >= Np) {
            zero_row(m, ng, row);
            continue;
        }
        const int8_t *base = q + (size_t)(n - r) * Kp;
        for (int b = 0; b < nb; b++) {
            const int8_t *qb = base + (size_t)b * 256 * ROWS;
            __m256i c[8];
            for (int i = 0; i < 8; i++)
                c[i] = _mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * i + r)));
            store_groups(c, m->w, b, row);
        }
    }
}

/* 6-bit: the values less 32 (signed), and per half group d times its int8
 * scale, rounded as the vpdpbusd passes round it. */
static void unpack_q6(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *d,
                      int Np, int Kp, int n0, buffers *m) {
    const int ng = Kp / GROUP, nb = Kp / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30),
                  offset = _mm256_set1_epi8(32);
    for (int row = 0; row < TM; row++) {
        const int n = n0 + row, r = row % ROWS;
        if (n >= Np) {
            zero_row(m, ng, row);
            continue;
        }
        const uint8_t *lbase = ql + (size_t)(n - r) * (Kp / 2), *hbase = qh + (size_t)(n - r) * (Kp / 4);
        const int8_t *sbase = sc + (size_t)(n - r) * (Kp / 16);
        const float *dbase = d + (size_t)(n - r) * nb;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = lbase + (size_t)b * 128 * ROWS, *hb = hbase + (size_t)b * 64 * ROWS;
            __m256i c[8];
            for (int h = 0; h < 2; h++) {
                const __m256i hv = _mm256_loadu_si256((const __m256i *)(hb + UNIT * (ROWS * h + r)));
                for (int p = 2 * h; p < 2 * h + 2; p++) {
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(qb + UNIT * (ROWS * p + r)));
                    const __m256i h0 = p % 2 == 0 ? _mm256_slli_epi16(hv, 4) : hv;
                    const __m256i h1 = p % 2 == 0 ? _mm256_slli_epi16(hv, 2) : _mm256_srli_epi16(hv, 2);
                    c[2 * p] = _mm256_sub_epi8(_mm256_or_si256(
                        _mm256_and_si256(packed, nibble), _mm256_and_si256(h0, high)), offset);
                    c[2 * p + 1] = _mm256_sub_epi8(_mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                        _mm256_and_si256(h1, high)), offset);
                }
            }
            store_groups(c, m->w, b, row);
            const __m256 dw = _mm256_set1_ps(dbase[(size_t)b * ROWS + r]);
            for (int h = 0; h < 2; h++) {
                float s[8];
                _mm256_storeu_ps(s, _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(sbase + (size_t)b * 16 * ROWS + 16 * r + 8 * h))))));
                for (int L = 0; L < 8; L++) m->scales[(2 * (8 * b + L) + h) * TM + row] = s[L];
            }
        }
    }
}

/* One unit's float steps (a group's, or a half group's for 6-bit weights)
 * on its sums (16 rows x 16 positions, in memory), into its lane's
 * accumulator of every row (acc[row]): as the vpdpbusd passes run them. */
static inline __attribute__((always_inline)) void q4_steps(
        const int32_t *sums, const float *scales, __m512 d, __m512 ds, __m512 *acc) {
#pragma GCC unroll 16
    for (int row = 0; row < TM; row++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums + TN * row)));
        __m512 a = acc[row];
        a = _mm512_fmadd_ps(_mm512_mul_ps(dot, d), _mm512_set1_ps(scales[row]), a);
        a = _mm512_fmadd_ps(_mm512_set1_ps(scales[TM + row]), ds, a);
        acc[row] = a;
    }
}

static inline __attribute__((always_inline)) void q8_steps(
        const int32_t *sums, __m512 d, __m512 *acc) {
#pragma GCC unroll 16
    for (int row = 0; row < TM; row++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums + TN * row)));
        acc[row] = _mm512_fmadd_ps(dot, d, acc[row]);
    }
}

static inline __attribute__((always_inline)) void q6_steps(
        const int32_t *sums, const float *scales, __m512 d, __m512 *acc) {
#pragma GCC unroll 16
    for (int row = 0; row < TM; row++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums + TN * row)));
        acc[row] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(scales[row])), d, acc[row]);
    }
}

/* One tile of 16 positions (tt) against the unpacked rows in m: every
 * unit's tile product (a group's, or for 6-bit weights a half group's),
 * then its float steps.  The units run lane by lane (groups L, L + 8,
 * L + 16, ... for L = 0..7), so that one lane's 16 accumulators stay in
 * registers until the lane ends; each lane still adds its groups in block
 * order, as the vpdpbusd passes add them, so the results are the same bit
 * for bit.  The products run ahead: unit i + 1's is issued before the float
 * steps of unit i - 1, whose sums were stored an iteration earlier, so the
 * tile unit, the stores and the float steps overlap. */
static void run_tile(enum kind kind, const buffers *m, const uint8_t *bp, const float *d,
                     const float *ds, int ng, int tt) {
    const uint8_t *bt = bp + (size_t)tt * ng * TILE_BYTES;
    const float *dt = d + (size_t)tt * ng * TN, *dst = ds ? ds + (size_t)tt * ng * TN : NULL;
    int32_t *s0 = m->sums, *s1 = m->sums + TM * TN;
    const int halves = kind == Q6, units = halves ? 2 * ng : ng, nb = ng / 8;
    const int per_lane = units / 8;
    __m512 racc[TM];
    for (int r = 0; r < TM; r++) racc[r] = _mm512_setzero_ps();
    /* Unit i of the sequence: lane by lane, block by block within a lane. */
#define UNIT_OF(i) (halves ? 2 * (8 * (((i) / 2) % nb) + ((i) / 2) / nb) + (i) % 2 \
                           : 8 * ((i) % nb) + (i) / nb)
#define ISSUE(C, A, B, i)                                                        \
    do {                                                                         \
        const int u_ = UNIT_OF(i);                                               \
        const int g_ = halves ? u_ / 2 : u_, h_ = halves ? u_ % 2 : 0;           \
        _tile_zero(C);                                                           \
        _tile_loadd(A, m->w + (size_t)g_ * TILE_BYTES + 16 * h_, UNIT);         \
        _tile_loadd(B, bt + (size_t)g_ * TILE_BYTES + 256 * h_, 64);            \
        if (kind == Q4) _tile_dpbusd(C, A, B); else _tile_dpbssd(C, A, B);      \
    } while (0)
#define STEPS(sums, i)                                                           \
    do {                                                                         \
        const int u_ = UNIT_OF(i);                                               \
        const int g_ = halves ? u_ / 2 : u_;                                     \
        const __m512 dv = _mm512_load_ps(dt + (size_t)g_ * TN);                  \
        if (kind == Q4)                                                          \
            q4_steps(sums, m->scales + (size_t)(2 * g_) * TM, dv,                \
                     _mm512_load_ps(dst + (size_t)g_ * TN), racc);               \
        else if (kind == Q8)                                                     \
            q8_steps(sums, dv, racc);                                            \
        else                                                                     \
            q6_steps(sums, m->scales + (size_t)u_ * TM, dv, racc);               \
        if (((i) + 1) % per_lane == 0) {                                         \
            const int L_ = g_ % 8;                                               \
            for (int r = 0; r < TM; r++) {                                       \
                m->acc[8 * r + L_] = racc[r];                                    \
                racc[r] = _mm512_setzero_ps();                                   \
            }                                                                    \
        }                                                                        \
    } while (0)
    ISSUE(0, 2, 3, 0);
    for (int i = 0; i < units; i += 2) {       /* units is even (ng: a multiple of 8) */
        _tile_stored(0, s0, 64);
        ISSUE(1, 6, 7, i + 1);
        if (i > 0) STEPS(s1, i - 1);
        _tile_stored(1, s1, 64);
        if (i + 2 < units) ISSUE(0, 2, 3, i + 2);
        STEPS(s0, i);
    }
    STEPS(s1, units - 1);
#undef UNIT_OF
#undef ISSUE
#undef STEPS
}

/* The product of every position against rows 0..N-1, 16 rows a thread at a
 * time; returns -1 (nothing written) where the tiles or memory can't be had. */
static int amx_matmul(enum kind kind, const void *q, const void *qh, const void *s1,
                      const void *s2, int N, int Kp, const int8_t *a, const float *sa,
                      const float *sasum, int T, float *y, int threads) {
    if (!fr_amx_ready()) return -1;
    const int ng = Kp / GROUP, Tp = (T + TN - 1) / TN * TN, tiles = Tp / TN;
    const int Np = (N + ROWS - 1) / ROWS * ROWS, ntiles = (N + TM - 1) / TM;
    uint8_t *bp = aligned_alloc(64, (size_t)tiles * ng * TILE_BYTES);
    float *d = aligned_alloc(64, (size_t)tiles * ng * TN * sizeof(float));
    float *ds = kind == Q4 ? aligned_alloc(64, (size_t)tiles * ng * TN * sizeof(float)) : NULL;
    int failed = !bp || !d || (kind == Q4 && !ds);
    if (!failed) {
        pack_activations(a, sa, kind == Q4 ? sasum : NULL, T, Kp, Tp, bp, d, ds, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            /* Every thread reaches the loop (a work-sharing construct), even
               one whose buffers could not be had: it then takes no rows. */
            buffers m;
            const int ok = allocate(&m, ng) == 0;
            if (ok) configure_tiles(kind == Q6); else failed = 1;
#pragma omp for schedule(static)
            for (int nt = 0; nt < ntiles; nt++) {
                if (!ok) continue;
                const int n0 = nt * TM, rows = N - n0 < TM ? N - n0 : TM;
                if (kind == Q4)
                    unpack_q4(q, s1, s2, Np, Kp, n0, &m);
                else if (kind == Q8)
                    unpack_q8(q, Np, Kp, n0, &m);
                else
                    unpack_q6(q, qh, s1, s2, Np, Kp, n0, &m);
                for (int tt = 0; tt < tiles; tt++) {
                    run_tile(kind, &m, bp, d, ds, ng, tt);
                    const int positions = T - tt * TN < TN ? T - tt * TN : TN;
                    write_rows(m.acc, kind == Q8 ? (const float *)s1 : NULL, n0, rows, tt * TN,
                               positions, y, N);
                }
            }
            if (ok) _tile_release();
            release(&m);
        }
    }
    free(bp); free(d); free(ds);
    return failed ? -1 : 0;
}

int fr_amx_q4_matmul(const uint8_t *q, const uint16_t *scale, const uint16_t *min, int N,
                     int Kp, const int8_t *a, const float *sa, const float *sasum, int T,
                     float *y, int threads) {
    return amx_matmul(Q4, q, NULL, scale, min, N, Kp, a, sa, sasum, T, y, threads);
}

int fr_amx_q8_matmul(const int8_t *q, const float *scale, int N, int Kp, const int8_t *a,
                     const float *sa, int T, float *y, int threads) {
    return amx_matmul(Q8, q, NULL, scale, NULL, N, Kp, a, sa, NULL, T, y, threads);
}

int fr_amx_q6_matmul(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const float *d,
                     int N, int Kp, const int8_t *a, const float *sa, int T, float *y,
                     int threads) {
    return amx_matmul(Q6, ql, qh, sc, d, N, Kp, a, sa, NULL, T, y, threads);
}

#endif
