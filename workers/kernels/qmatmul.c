/* Quantized-weight linear layers: y = x @ W^T with W in 4-bit groups or int8 rows, x quantized
 * on the fly to int8 in groups of 32, integer dot products (or, for int4, x in fp32 against the
 * levels widened to fp32, the default: see "int4 x fp32 activations"; or on AVX512_BF16 builds
 * x in bf16 against the levels as bf16: see "int4 x bf16 activations").
 *
 * Built at run time by workers/kernels/build.py (cc -O3 -march=native -fopenmp -shared -fPIC,
 * or a lower ISA for the fallback tests) and called through ctypes by workers/kernels/qlinear.py.
 *
 * Why integers: at one row a linear layer reads each weight once and does one multiply-add
 * with it, so its speed is how many weights a core turns into sums per cycle. Widening 4-bit
 * levels to floats costs several instructions per 16 weights; an integer dot product of bytes
 * (AVX-512 VNNI / AVX-VNNI vpdpbusd: 32 u8 x s8 products summed into 8 int32 in one
 * instruction; AVX2's vpmaddubsw + vpmaddwd in two) takes 32 at once. llama.cpp does the same
 * (q4_1 x q8_1 dot products).
 *
 * Layouts (all contiguous, row-major):
 *   x       [M, K]       fp32 or bf16 activations (xkind)
 *   y       [M, N]       fp32 or bf16 (ykind)
 *   int4:   qs [N, K/2]  uint8: group g of row n is bytes [16g, 16g + 16); byte j holds level
 *                        32g + j in its low nibble and level 32g + j + 16 in its high one
 *           dm [N, 2, K/32] fp16: row n's group scales d, then its groups' lowest values m:
 *                        w = m + q * d
 *   int8:   w  [N, K]    int8, one scale per row: ws [N] (fp32 or bf16, skind): w = q * ws[n]
 *
 * x is quantized per group of 32 (symmetric, scale = absmax / 127) once per call; the sum of
 * each group's real values is kept for the int4 minimum's term, so
 *   int4: y[m, n] = sum_g d[n,g] * xd[m,g] * sum_i q[n,g,i] * xq[m,g,i] + m[n,g] * xs[m,g]
 *   int8: y[m, n] = ws[n] * sum_g xd[m,g] * sum_i w[n,g,i] * xq[m,g,i]
 * Each output is one row's dot product summed in a fixed order: the result of a row does not
 * depend on M, on the thread count nor on which thread ran it (bit-identical alone or batched).
 *
 * Threads: OpenMP over output columns (N), bound to torch's libgomp (see paged_decode.c).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* No a * b + c contracted into one rounding behind our back: where the compiler fuses is its
 * choice per ISA (a plain C build has no FMA to fuse into), and the fp32-activation kernels give
 * the same bits on every build. Every FMA here is written as one (intrinsics, fmaf). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "convert.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QM_AVX2 1
#else
#define QM_AVX2 0
#endif

/* The integer dot product of 32 u8 by 32 s8 into 8 int32 lanes (each the sum of 4 products) */
#if QM_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QM_ISA "avx512vnni"
#define DOT_U8S8(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif QM_AVX2 && defined(__AVXVNNI__)
#define QM_ISA "avxvnni"
#define DOT_U8S8(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#elif QM_AVX2
#define QM_ISA "avx2"
/* u8 x s8 pairs summed into int16 (vpmaddubsw saturates past 32767: the callers keep u <= 127,
 * so a pair is at most 2 * 127 * 127 = 32258), then pairs of int16 into int32 */
#define DOT_U8S8(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#else
#define QM_ISA "scalar"
#endif

enum { X_F32 = 0, X_BF16 = 1 };
#define QK 32    /* values per group */

#if QM_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---------------------------------------------------------------- activations */

/* Where value j (0..31) of group g of a row lands in its quantized row. Blocked (the int4
 * kernel's order): the row's groups are cut into blocks of BLOCK groups (then one of 2, then
 * one of 1 for what is left), and a block of b groups starting at group g0 holds, from byte
 * 32 * g0, the first 16 values of each of its groups, then the last 16 of each: the order in
 * which one load of the block's weight bytes (16 per group, value j low, j + 16 high) widens
 * into its low and its high nibbles. Else in order. */
#if QM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QM_512 1
#define BLOCK 4
#else
#define QM_512 0
#define BLOCK 2
#endif

/* block: BLOCK for the int8 activations of the int4 kernel, 2 for its bf16 ones, 1 in order */
static inline int64_t slot(int block, int64_t G, int64_t g, int j) {
    if (block <= 1) return g * QK + j;
    int64_t whole = G / block * block, g0, b;
    if (g < whole) {
        g0 = g / block * block, b = block;
    } else if (g < whole + (G - whole) / 2 * 2) {
        g0 = whole + (g - whole) / 2 * 2, b = 2;
    } else {
        g0 = g, b = 1;
    }
    return g0 * QK + (j >= 16) * b * 16 + (g - g0) * 16 + (j & 15);
}

/* x [M, K] -> xq [M, K] int8 (in slot order), xd [M, K/32] scales, xs [M, K/32] sums of the
 * real values */
static void quantize_rows(const void *x, int xkind, int64_t M, int64_t K, int block, int8_t *xq, float *xd,
                          float *xs) {
    const int64_t G = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            int64_t at = m * K + g * QK;
            int8_t *lo = xq + m * K + slot(block, G, g, 0), *hi = xq + m * K + slot(block, G, g, 16);
#if QM_AVX2
            __m256 v[4];
            for (int i = 0; i < 4; i++) {
                if (xkind == X_BF16) {
                    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + 8 * i));
                    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                } else {
                    v[i] = _mm256_loadu_ps((const float *)x + at + 8 * i);
                }
            }
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            /* int32 -> int8 (|q| <= 127: no saturation), packs work per 128-bit lane: reorder */
            __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(b));
            _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(b, 1));
#else
            float v[QK], amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < QK; i++) {
                v[i] = load_kind(x, xkind, at + i);
                sum += v[i];
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < 16; i++) {
                lo[i] = (int8_t)lrintf(v[i] * inv);
                hi[i] = (int8_t)lrintf(v[i + 16] * inv);
            }
#endif
            xd[m * G + g] = amax / 127.0f;
            xs[m * G + g] = sum;
        }
    }
}

/* ---------------------------------------------------------------- tiles
 *
 * A tile is NC output columns (n0 .. n0 + NC - 1) times MB activation rows (m0 .. m0 + MB - 1),
 * summed in one pass over the columns' weights: each weight group is loaded and widened once
 * and used for MB rows, each activation group once for NC columns, and the NC * MB sums are
 * independent chains (one accumulator would wait on its own multiply-add every group). NC and
 * MB are constants at each call (always inlined), so the compiler keeps the accumulators in
 * registers. A group's float scale (weight scale times activation scale) is computed before
 * the pass into sc, so the pass broadcasts it from memory.
 */
#define NC 4
#ifndef AHEAD
#define AHEAD 8 /* columns ahead whose weights a tile prefetches (the same bytes of a later tile) */
#endif
#define MAX_MB 4 /* the most rows any tile takes (F32_MB; the integer kernels take 2) */
/* Rows a tile of the fp32-activation kernels (int4 and int8 rows x fp32) sums at once: on
 * AVX-512's 32 registers 4 (16 accumulators, the widened weights and the scale beside them),
 * AVX2's 16 registers 2. Past two rows these kernels are bound by the multiply-adds, not the
 * bytes, and four rows a widening halves the widenings per product (batched decode, prefill) */
#if QM_512
#define F32_MB 4
#else
#define F32_MB 2
#endif
/* The int4 x fp32 tile on AVX-512: each group's 16 dequantized weights as a table, picked by
 * code (see q4f_tile) */
#define F32_512 QM_512
#define MAX_G 1024 /* groups a row may have: K <= 32768 (qlinear.MAX_K) */

/* sc, per (row, column): each group's scale, weight scale times activation scale (the int8-
 * activation tiles); the fp32 int4 tile keeps 2G a column there (scales, then minima) */
#define SC_PER_RC(G) (G)

static inline __attribute__((always_inline)) void q4_tile(const int8_t *xq, const float *xd, const float *xs,
                                                          int64_t m0, const int mb, int64_t K, const uint8_t *qs,
                                                          const uint16_t *dm, int64_t n0, const int nc, float *sc,
                                                          float out[MAX_MB][NC]) {
    const int64_t G = K / QK;
#if QM_AVX2
    /* The pass, per block of 2 groups (4 at 512 bits): one load holds the block's levels; its
     * low nibbles are g0[0..15], g1[0..15] and its high ones g0[16..31], g1[16..31], which is
     * how the activations were laid out (slot), so two dot products into one accumulator give
     * lanes 0-3 group g0's sums and 4-7 g1's: one convert and one multiply-add per 64 weights
     * (128 at 512 bits), by the lane scales [s0 x4, s1 x4] set out in sc before the pass. */
    float mins[MAX_MB][NC];
    for (int c = 0; c < nc; c++) {
        const uint16_t *d = dm + (n0 + c) * 2 * G, *mn = d + G;
        for (int64_t i = 0; i < 2 * G; i += 32) /* a later tile's scales: 64 bytes a line */
            _mm_prefetch((const char *)(d + AHEAD * 2 * G + i), _MM_HINT_T0);
        for (int r = 0; r < mb; r++) {
            const float *xdr = xd + (m0 + r) * G, *xsr = xs + (m0 + r) * G;
            float *scr = sc + (r * NC + c) * G;
            __m256 macc = _mm256_setzero_ps();
            int64_t g = 0;
            for (; g + 8 <= G; g += 8) {
                _mm256_storeu_ps(scr + g, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g))),
                                                        _mm256_loadu_ps(xdr + g)));
                macc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))),
                                       _mm256_loadu_ps(xsr + g), macc);
            }
            float mt = hsum8(macc);
            for (; g < G; g++) {
                scr[g] = f16_to_f32(d[g]) * xdr[g];
                mt += f16_to_f32(mn[g]) * xsr[g];
            }
            mins[r][c] = mt;
        }
    }
    __m256 acc[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t g = 0; /* groups done */
#if QM_512
    /* Blocks of 4 groups at 512 bits: 64 weight bytes, lanes 0-3 group 0's sums ... 12-15 group 3's */
    __m512 acc5[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc5[r][c] = _mm512_setzero_ps();
    const __m512i lo4w = _mm512_set1_epi8(0x0f);
    const __m512i spread4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (; g + 4 <= G; g += 4) {
        __m512i xlo[MAX_MB], xhi[MAX_MB];
        for (int r = 0; r < mb; r++) {
            const int8_t *xr = xq + (m0 + r) * K + g * QK;
            xlo[r] = _mm512_loadu_si512((const void *)xr);
            xhi[r] = _mm512_loadu_si512((const void *)(xr + 64));
        }
        for (int c = 0; c < nc; c++) {
            __m512i b = _mm512_loadu_si512((const void *)(qs + (n0 + c) * (K / 2) + g * 16));
            _mm_prefetch((const char *)(qs + (n0 + c + AHEAD) * (K / 2) + g * 16), _MM_HINT_T0);
            __m512i wlo = _mm512_and_si512(b, lo4w), whi = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4w);
            for (int r = 0; r < mb; r++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo, xlo[r]), whi, xhi[r]);
                acc5[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                             _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_loadu_ps(sc + (r * NC + c) * G + g))),
                                             acc5[r][c]);
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++)
            acc[r][c] = _mm256_add_ps(_mm512_castps512_ps256(acc5[r][c]), _mm512_extractf32x8_ps(acc5[r][c], 1));
#endif
    const __m256i lo4 = _mm256_set1_epi8(0x0f), spread2 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (; g + 2 <= G; g += 2) {
        __m256i xlo[MAX_MB], xhi[MAX_MB];
        for (int r = 0; r < mb; r++) {
            const int8_t *xr = xq + (m0 + r) * K + g * QK;
            xlo[r] = _mm256_loadu_si256((const __m256i *)xr);
            xhi[r] = _mm256_loadu_si256((const __m256i *)(xr + QK));
        }
        for (int c = 0; c < nc; c++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(qs + (n0 + c) * (K / 2) + g * 16));
            _mm_prefetch((const char *)(qs + (n0 + c + AHEAD) * (K / 2) + g * 16), _MM_HINT_T0);
            __m256i wlo = _mm256_and_si256(b, lo4), whi = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
            for (int r = 0; r < mb; r++) {
                __m256i dot = DOT_U8S8(DOT_U8S8(_mm256_setzero_si256(), wlo, xlo[r]), whi, xhi[r]);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(
                                                                         (const double *)(sc + (r * NC + c) * G + g)))),
                                                                     spread2),
                                            acc[r][c]);
            }
        }
    }
    if (g < G) { /* the last group alone: its 16 bytes widen to its 32 levels in order */
        const __m128i lo4h = _mm_set1_epi8(0x0f);
        for (int c = 0; c < nc; c++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(qs + (n0 + c) * (K / 2) + g * 16));
            __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4h), _mm_and_si128(b, lo4h));
            for (int r = 0; r < mb; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (m0 + r) * K + g * QK));
                __m256i dot = DOT_U8S8(_mm256_setzero_si256(), w, xv);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_broadcast_ss(sc + (r * NC + c) * G + g), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum8(acc[r][c]) + mins[r][c];
#else
    (void)sc;
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2);
            const uint16_t *d = dm + (n0 + c) * 2 * G, *mn = d + G;
            const int8_t *xr = xq + (m0 + r) * K;
            float acc = 0.0f, mt = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t dot = 0;
                for (int j = 0; j < 16; j++)
                    dot += (int32_t)(q[g * 16 + j] & 0x0f) * xr[slot(BLOCK, G, g, j)] +
                           (int32_t)(q[g * 16 + j] >> 4) * xr[slot(BLOCK, G, g, j + 16)];
                acc += (float)dot * (f16_to_f32(d[g]) * xd[(m0 + r) * G + g]);
                mt += f16_to_f32(mn[g]) * xs[(m0 + r) * G + g];
            }
            out[r][c] = acc + mt;
        }
#endif
}

static inline __attribute__((always_inline)) void q8_tile(const int8_t *xq, const float *xd, int64_t m0, const int mb,
                                                          int64_t K, const int8_t *w, const void *ws, int skind,
                                                          int64_t n0, const int nc, float out[MAX_MB][NC]) {
    const int64_t G = K / QK;
#if QM_AVX2
    __m256 acc[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i xv[MAX_MB];
        for (int r = 0; r < mb; r++) xv[r] = _mm256_loadu_si256((const __m256i *)(xq + (m0 + r) * K + g * QK));
        for (int c = 0; c < nc; c++) {
            /* u8 x s8 only: |w| as the unsigned side, x carrying w's sign (w = -128 never occurs:
             * the rows are clamped to [-127, 127]) */
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + c) * K + g * QK));
            _mm_prefetch((const char *)(w + (n0 + c + AHEAD) * K + g * QK), _MM_HINT_T0);
            __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < mb; r++) {
                __m256i dot = DOT_U8S8(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xv[r], wv));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(xd + (m0 + r) * G + g),
                                            acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum8(acc[r][c]);
#else
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) {
            const int8_t *wr = w + (n0 + c) * K;
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *x = xq + (m0 + r) * K + g * QK;
                int32_t dot = 0;
                for (int j = 0; j < QK; j++) dot += (int32_t)wr[g * QK + j] * x[j];
                acc += (float)dot * xd[(m0 + r) * G + g];
            }
            out[r][c] = acc;
        }
#endif
    for (int c = 0; c < nc; c++) {
        float s = load_kind(ws, skind, n0 + c);
        for (int r = 0; r < mb; r++) out[r][c] *= s;
    }
}

/* ---------------------------------------------------------------- int4 x bf16 activations
 *
 * Where the CPU has AVX512_BF16 (vdpbf16ps: 32 bf16 products summed in pairs into 16 fp32 lanes)
 * the int4 weights can meet the activations as they are, bf16, with no 8-bit rounding of x: the
 * quality of torch's bf16 path at a little more than the int8 kernel's cost. A level q (0..15)
 * becomes the bf16 number 128 + q by one OR (0x4300 | q: exponent 7, q in the low mantissa
 * bits), so a group's sum is d * (sum (128 + q) x - 128 sum x) + m sum x: the constant
 * (m - 128 d) * sum x of each group is added once per column, before the pass.
 *
 * Per block of 4 groups, one 64-byte load holds their levels (group i in 128-bit lane i); its
 * low and high nibbles, each interleaved with the byte 0x43 (unpacklo / unpackhi), are four
 * vectors of 32 bf16 whose lane i holds group i's levels 0-7, 8-15, 16-23, 24-31: the
 * activations are laid out in that order (bslot), so four dot products into one accumulator
 * leave group i's sums in lanes 4i..4i+3, scaled by [d0 x4, .. d3 x4]. A last pair of groups
 * goes as in the int8 kernel's pairs (zero-extended levels against g0[0..15], g1[0..15] then
 * g0[16..31], g1[16..31]), a last group alone in order.
 */
#if QM_512 && defined(__AVX512BF16__)
#define QM_BF16 1

/* Where value j of group g lands in a row of bf16 activations (see above) */
static inline int64_t bslot(int64_t G, int64_t g, int j) {
    int64_t whole = G / 4 * 4;
    if (g < whole) return (g / 4 * 4) * QK + (j / 8) * 32 + (g % 4) * 8 + (j % 8);
    if (g < whole + (G - whole) / 2 * 2) {
        int64_t g0 = whole + (g - whole) / 2 * 2;
        return g0 * QK + (j >= 16) * 32 + (g - g0) * 16 + (j & 15);
    }
    return g * QK + j;
}

/* x [M, K] -> xb [M, K] bf16 in bslot order, xs [M, K/32] the groups' sums of those bf16 values */
static void bf16_rows(const void *x, int xkind, int64_t M, int64_t K, uint16_t *xb, float *xs) {
    const int64_t G = K / QK, whole = G / 4 * 4;
    uint16_t grp[QK];
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t at = m * K + g * QK;
            if (xkind == X_BF16)
                memcpy(grp, (const uint16_t *)x + at, sizeof grp);
            else
                for (int j = 0; j < QK; j++) grp[j] = f32_to_bf16(((const float *)x)[at + j]);
            __m512 v = _mm512_add_ps(
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)grp)), 16)),
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(grp + 16))), 16)));
            xs[m * G + g] = _mm512_reduce_add_ps(v);
            uint16_t *row = xb + m * K;
            if (g < whole) /* 8 values at a time: chunk k of group g to (k, g % 4) of its block */
                for (int k = 0; k < 4; k++) memcpy(row + (g / 4 * 4) * QK + k * 32 + (g % 4) * 8, grp + 8 * k, 16);
            else
                for (int h = 0; h < 2; h++) memcpy(row + bslot(G, g, 16 * h), grp + 16 * h, 32);
        }
}

static inline __attribute__((always_inline)) void q4b_tile(const uint16_t *xb, const float *xs, int64_t m0,
                                                           const int mb, int64_t K, const uint8_t *qs,
                                                           const uint16_t *dm, int64_t n0, const int nc, float *sc,
                                                           float out[MAX_MB][NC]) {
    const int64_t G = K / QK;
    float cst[MAX_MB][NC];
    for (int c = 0; c < nc; c++) { /* each group's float scale, and the constant terms */
        const uint16_t *d = dm + (n0 + c) * 2 * G, *mn = d + G;
        for (int64_t i = 0; i < 2 * G; i += 32) _mm_prefetch((const char *)(d + AHEAD * 2 * G + i), _MM_HINT_T0);
        float *scc = sc + c * G;
        __m256 k8[MAX_MB];
        for (int r = 0; r < mb; r++) k8[r] = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g)));
            __m256 t8 = _mm256_fnmadd_ps(d8, _mm256_set1_ps(128.0f), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))));
            _mm256_storeu_ps(scc + g, d8);
            for (int r = 0; r < mb; r++) k8[r] = _mm256_fmadd_ps(t8, _mm256_loadu_ps(xs + (m0 + r) * G + g), k8[r]);
        }
        for (int r = 0; r < mb; r++) cst[r][c] = hsum8(k8[r]);
        for (; g < G; g++) {
            float dg = f16_to_f32(d[g]);
            scc[g] = dg;
            for (int r = 0; r < mb; r++) cst[r][c] += (f16_to_f32(mn[g]) - 128.0f * dg) * xs[(m0 + r) * G + g];
        }
    }
    __m512 acc[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m512i bias = _mm512_set1_epi16(0x4300);
    const __m512i spread8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i spread4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i lo4w = _mm512_set1_epi8(0x0f), hi43 = _mm512_set1_epi8(0x43);
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) { /* blocks of 4 groups: 128 levels a load */
        __m512i xv[MAX_MB][4];
        for (int r = 0; r < mb; r++)
            for (int k = 0; k < 4; k++) xv[r][k] = _mm512_loadu_si512((const void *)(xb + (m0 + r) * K + g * QK + 32 * k));
        for (int c = 0; c < nc; c++) {
            __m512i b = _mm512_loadu_si512((const void *)(qs + (n0 + c) * (K / 2) + g * 16));
            _mm_prefetch((const char *)(qs + (n0 + c + AHEAD) * (K / 2) + g * 16), _MM_HINT_T0);
            __m512i lo = _mm512_and_si512(b, lo4w), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4w);
            __m512i w[4] = {_mm512_unpacklo_epi8(lo, hi43), _mm512_unpackhi_epi8(lo, hi43),
                            _mm512_unpacklo_epi8(hi, hi43), _mm512_unpackhi_epi8(hi, hi43)};
            __m512 s4 = _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_loadu_ps(sc + c * G + g)));
            for (int r = 0; r < mb; r++) {
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[0], (__m512bh)xv[r][0]);
                for (int k = 1; k < 4; k++) dot = _mm512_dpbf16_ps(dot, (__m512bh)w[k], (__m512bh)xv[r][k]);
                acc[r][c] = _mm512_fmadd_ps(dot, s4, acc[r][c]);
            }
        }
    }
    for (; g + 2 <= G; g += 2) {
        __m512i xlo[MAX_MB], xhi[MAX_MB];
        for (int r = 0; r < mb; r++) {
            const uint16_t *xr = xb + (m0 + r) * K + g * QK;
            xlo[r] = _mm512_loadu_si512((const void *)xr);
            xhi[r] = _mm512_loadu_si512((const void *)(xr + QK));
        }
        for (int c = 0; c < nc; c++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(qs + (n0 + c) * (K / 2) + g * 16));
            _mm_prefetch((const char *)(qs + (n0 + c + AHEAD) * (K / 2) + g * 16), _MM_HINT_T0);
            __m512i wlo = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(b, lo4)), bias);
            __m512i whi = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), lo4)), bias);
            __m512 s2 = _mm512_permutexvar_ps(spread8, _mm512_castps128_ps512(_mm_castpd_ps(
                                                           _mm_load_sd((const double *)(sc + c * G + g)))));
            for (int r = 0; r < mb; r++) {
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wlo, (__m512bh)xlo[r]);
                dot = _mm512_dpbf16_ps(dot, (__m512bh)whi, (__m512bh)xhi[r]);
                acc[r][c] = _mm512_fmadd_ps(dot, s2, acc[r][c]);
            }
        }
    }
    if (g < G) { /* the last group alone: its 32 levels in order against its 32 values */
        const __m128i lo4h = _mm_set1_epi8(0x0f);
        for (int c = 0; c < nc; c++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(qs + (n0 + c) * (K / 2) + g * 16));
            __m256i w8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4h), _mm_and_si128(b, lo4h));
            __m512i w = _mm512_or_si512(_mm512_cvtepu8_epi16(w8), bias);
            for (int r = 0; r < mb; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xb + (m0 + r) * K + g * QK));
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w, (__m512bh)xv);
                acc[r][c] = _mm512_fmadd_ps(dot, _mm512_set1_ps(sc[c * G + g]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]) + cst[r][c];
}
#else
#define QM_BF16 0
#endif

/* ---------------------------------------------------------------- fp32 activations
 *
 * The activations as they are, fp32, against the dequantized weights: no rounding of x at all,
 * so a row's result differs from the dequantized weight's float64 product only in the order of
 * its fp32 sums. Rounding x (to int8 per group, or to bf16) is a step function of x: the smallest
 * difference between two hosts' sums moves some values across a step, and a small model's 30
 * layers carry those steps to the logits (0.6 apart between this file's AVX2 and AVX-512 builds
 * with bf16 activations; the default model's greedy answer flipped with them, issue 40).
 *
 * And every build sums in the same order, so a host's answer does not depend on its ISA: 16
 * lanes, lane i taking value i of each 32 (the weight times x, one FMA) then value i + 16, group
 * after group along K; then the lanes halved (i + 8, i + 4, i + 2, i + 1: hsum16). AVX-512 holds
 * the 16 lanes in one register, AVX2 in two of 8, plain C in an array (fmaf: the same single
 * rounding). An int4 weight is level * d + m, one FMA (the dequantized weight, rounded once): on
 * AVX-512 each group's 16 possible values made once and each code's picked by vpermps, which
 * halved the instructions of widening the levels that bound one row (Qwen3.5-0.8B's int4
 * linears 28 -> 17-22 ms a step, bench/qlinear_rows.py); AVX2 and C widen each level and make
 * its weight by the same FMA.
 */
static inline float hsum16(const float a[16]) {
    float r8[8], r4[4];
    for (int i = 0; i < 8; i++) r8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) r4[i] = r8[i] + r8[i + 4];
    return (r4[0] + r4[2]) + (r4[1] + r4[3]);
}

#if QM_AVX2
/* the same halving of 16 lanes held as two of 8 (lo: lanes 0-7); hsum8 halves as hsum16 does */
static inline float hsum16x2(__m256 lo, __m256 hi) { return hsum8(_mm256_add_ps(lo, hi)); }
#endif
#if F32_512
static inline float hsum16x1(__m512 v) {
    return hsum16x2(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

/* int4 groups x fp32: sc holds each column's groups' scales then minima as fp32 (2G a column) */
static inline __attribute__((always_inline)) void q4f_tile(const float *xf, int64_t m0, const int mb, int64_t K,
                                                           const uint8_t *qs, const uint16_t *dm, int64_t n0,
                                                           const int nc, float *sc, float out[MAX_MB][NC]) {
    const int64_t G = K / QK;
    for (int c = 0; c < nc; c++) { /* each group's scale and minimum, as fp32 */
        const uint16_t *d = dm + (n0 + c) * 2 * G, *mn = d + G;
        float *s = sc + c * 2 * G;
        int64_t g = 0;
#if F32_512
        for (; g + 16 <= G; g += 16) {
            _mm512_storeu_ps(s + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g))));
            _mm512_storeu_ps(s + G + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + g))));
        }
#endif
        for (; g < G; g++) {
            s[g] = f16_to_f32(d[g]);
            s[G + g] = f16_to_f32(mn[g]);
        }
    }
#if F32_512
    const __m512 lv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2) + g * 16;
            _mm_prefetch((const char *)(q + AHEAD * (K / 2)), _MM_HINT_T0);
            /* the group's 16 weights, level * d + m, picked by code (vpermps reads an index's low
             * 4 bits: the low nibbles as the bytes are, the high ones shifted down) */
            const float *s = sc + c * 2 * G;
            __m512 lv16 = _mm512_fmadd_ps(lv, _mm512_set1_ps(s[g]), _mm512_set1_ps(s[G + g]));
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
            __m512 w0 = _mm512_permutexvar_ps(b, lv16), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lv16);
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + g * QK;
                acc[r][c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][c]));
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum16x1(acc[r][c]);
#elif QM_AVX2
    __m256 lo8[MAX_MB][NC], hi8[MAX_MB][NC]; /* lanes 0-7 and 8-15 */
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) lo8[r][c] = hi8[r][c] = _mm256_setzero_ps();
    const __m128i lo4 = _mm_set1_epi8(0x0f);
    for (int64_t g = 0; g < G; g++) {
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2) + g * 16;
            __m128i b = _mm_loadu_si128((const __m128i *)q);
            _mm_prefetch((const char *)(q + AHEAD * (K / 2)), _MM_HINT_T0);
            __m128i lo = _mm_and_si128(b, lo4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
            const float *s = sc + c * 2 * G;
            __m256 dg = _mm256_broadcast_ss(s + g), mg = _mm256_broadcast_ss(s + G + g);
            /* weights 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles): level * d + m */
            __m256 w[4] = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dg, mg),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dg, mg),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dg, mg),
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dg, mg)};
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + g * QK;
                lo8[r][c] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), lo8[r][c]));
                hi8[r][c] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), hi8[r][c]));
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum16x2(lo8[r][c], hi8[r][c]);
#else
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2);
            const float *xr = xf + (m0 + r) * K, *s = sc + c * 2 * G;
            float a[16] = {0};
            for (int64_t g = 0; g < G; g++)
                for (int i = 0; i < 16; i++) {
                    const uint8_t v = q[g * 16 + i];
                    a[i] = fmaf(fmaf((float)(v & 0x0f), s[g], s[G + g]), xr[g * QK + i], a[i]);
                    a[i] = fmaf(fmaf((float)(v >> 4), s[g], s[G + g]), xr[g * QK + 16 + i], a[i]);
                }
            out[r][c] = hsum16(a);
        }
#endif
}

/* int8 rows x fp32 (an int4 path's LM head; the int8 path's linears): the 16 lanes above, the
 * row's scale after (by run's caller, as for the int8 kernel). Each column's 32 weights are
 * widened once in registers for the tile's mb rows. (A block's columns widened into a buffer
 * first, shared by every pair of rows, was 1.8x slower at 4 rows than two tiles widening for
 * themselves: the buffer's 64 KB is read from L2 by each pair.) */
static inline __attribute__((always_inline)) void q8f_tile(const float *xf, int64_t m0, const int mb, int64_t K,
                                                           const int8_t *w, const void *ws, int skind, int64_t n0,
                                                           const int nc, float out[MAX_MB][NC]) {
#if F32_512
    __m512 acc[MAX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += QK) {
        for (int c = 0; c < nc; c++) {
            const int8_t *wr = w + (n0 + c) * K + i;
            _mm_prefetch((const char *)(wr + AHEAD * K), _MM_HINT_T0);
            __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)wr)));
            __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wr + 16))));
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + i;
                acc[r][c] = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(f0, _mm512_loadu_ps(xr), acc[r][c]));
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum16x1(acc[r][c]);
#elif QM_AVX2
    __m256 lo8[MAX_MB][NC], hi8[MAX_MB][NC]; /* lanes 0-7 and 8-15 */
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) lo8[r][c] = hi8[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += QK) {
        for (int c = 0; c < nc; c++) {
            __m256 f[4];
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + c) * K + i));
            _mm_prefetch((const char *)(w + (n0 + c + AHEAD) * K + i), _MM_HINT_T0);
            __m128i w0 = _mm256_castsi256_si128(wv), w1 = _mm256_extracti128_si256(wv, 1);
            f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w0));
            f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w0, 8)));
            f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w1));
            f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w1, 8)));
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + i;
                lo8[r][c] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xr + 16), _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xr), lo8[r][c]));
                hi8[r][c] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xr + 24), _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xr + 8), hi8[r][c]));
            }
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) out[r][c] = hsum16x2(lo8[r][c], hi8[r][c]);
#else
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) {
            const int8_t *wr = w + (n0 + c) * K;
            const float *xr = xf + (m0 + r) * K;
            float a[16] = {0};
            for (int64_t i = 0; i < K; i += QK)
                for (int h = 0; h < QK; h += 16)
                    for (int j = 0; j < 16; j++) a[j] = fmaf((float)wr[i + h + j], xr[i + h + j], a[j]);
            out[r][c] = hsum16(a);
        }
#endif
    for (int c = 0; c < nc; c++) {
        float s = load_kind(ws, skind, n0 + c);
        for (int r = 0; r < mb; r++) out[r][c] *= s;
    }
}

/* ---------------------------------------------------------------- entry points */

const char *qm_isa(void) { return QM_ISA; }

/* Columns per work item: enough that a thread's share is a few cache lines of output */
#define NBLOCK 16 /* a multiple of NC */

static int run(const void *x, int xkind, int64_t M, int64_t K, int64_t N, void *y, int ykind, int nthreads,
               int kind, const uint8_t *qs, const uint16_t *dm, const int8_t *w, const void *ws, int skind) {
    if (M == 0) return 0; /* no rows (a prefill step where no row samples): nothing to do */
    if (M < 0 || K < QK || K % QK || K / QK > MAX_G || N < 1 || (xkind != X_F32 && xkind != X_BF16) || (ykind != X_F32 && ykind != X_BF16))
        return 1;
    const int64_t G = K / QK;
    if (kind == 5 && !QM_BF16) return 1;
    /* int8 activations (xq, xd, xs), for kind 5 bf16 ones (xq as bf16, xs), for kinds 6 and 9
     * fp32 ones (xq as fp32: x itself when it is fp32, else widened) */
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) * (kind == 5 ? 2 : kind == 6 || kind == 9 ? (xkind == X_F32 ? 1 : 4) : 1));
    float *xd = (float *)malloc((size_t)(M * G) * sizeof(float) * 2);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return 2;
    }
    float *xs = xd + M * G;
    const float *xf = xkind == X_F32 ? (const float *)x : (const float *)xq;
    if (kind == 6 || kind == 9) {
        if (xkind != X_F32)
            for (int64_t i = 0; i < M * K; i++) ((float *)xq)[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    } else
#if QM_BF16
    if (kind == 5)
        bf16_rows(x, xkind, M, K, (uint16_t *)xq, xs);
    else
#endif
        quantize_rows(x, xkind, M, K, kind == 4 ? BLOCK : 1, xq, xd, xs);
    int nt = nthreads < 1 ? 1 : nthreads;
    const int64_t blocks = (N + NBLOCK - 1) / NBLOCK;
    if (blocks < nt) nt = (int)blocks;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(|| : failed)
    {
        const int scaled = kind != 8 && kind != 9; /* the int4 kinds use sc */
        float *sc = scaled ? (float *)malloc(sizeof(float) * MAX_MB * NC * SC_PER_RC(G)) : NULL;
        if (scaled && !sc) failed = 1;
        /* rows a tile takes: F32_MB for the fp32-activation kernels, 2 for the others */
        const int most = kind == 6 || kind == 9 ? F32_MB : 2;
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < blocks; bi++) {
            if (scaled && !sc) continue;
            float out[MAX_MB][NC];
            const int64_t n1 = (bi + 1) * NBLOCK < N ? (bi + 1) * NBLOCK : N;
            for (int64_t m0 = 0, mb; m0 < M; m0 += mb) {
                mb = M - m0 >= most ? most : M - m0 >= 2 ? 2 : 1;
                const int four = mb == 4, two = mb == 2;
                for (int64_t n0 = bi * NBLOCK; n0 < n1;) {
                    const int quad = n1 - n0 >= NC;
                    /* constant (mb, nc) at each call: the compiler specializes each tile */
#if QM_BF16
                    if (kind == 5) {
                        const uint16_t *xb = (const uint16_t *)xq;
                        if (two && quad) q4b_tile(xb, xs, m0, 2, K, qs, dm, n0, NC, sc, out);
                        else if (two) q4b_tile(xb, xs, m0, 2, K, qs, dm, n0, 1, sc, out);
                        else if (quad) q4b_tile(xb, xs, m0, 1, K, qs, dm, n0, NC, sc, out);
                        else q4b_tile(xb, xs, m0, 1, K, qs, dm, n0, 1, sc, out);
                    } else
#endif
                    if (kind == 6) {
                        if (four && quad) q4f_tile(xf, m0, 4, K, qs, dm, n0, NC, sc, out);
                        else if (four) q4f_tile(xf, m0, 4, K, qs, dm, n0, 1, sc, out);
                        else if (two && quad) q4f_tile(xf, m0, 2, K, qs, dm, n0, NC, sc, out);
                        else if (two) q4f_tile(xf, m0, 2, K, qs, dm, n0, 1, sc, out);
                        else if (quad) q4f_tile(xf, m0, 1, K, qs, dm, n0, NC, sc, out);
                        else q4f_tile(xf, m0, 1, K, qs, dm, n0, 1, sc, out);
                    } else if (kind == 9) {
                        if (four && quad) q8f_tile(xf, m0, 4, K, w, ws, skind, n0, NC, out);
                        else if (four) q8f_tile(xf, m0, 4, K, w, ws, skind, n0, 1, out);
                        else if (two && quad) q8f_tile(xf, m0, 2, K, w, ws, skind, n0, NC, out);
                        else if (two) q8f_tile(xf, m0, 2, K, w, ws, skind, n0, 1, out);
                        else if (quad) q8f_tile(xf, m0, 1, K, w, ws, skind, n0, NC, out);
                        else q8f_tile(xf, m0, 1, K, w, ws, skind, n0, 1, out);
                    } else if (kind == 4) {
                        if (two && quad) q4_tile(xq, xd, xs, m0, 2, K, qs, dm, n0, NC, sc, out);
                        else if (two) q4_tile(xq, xd, xs, m0, 2, K, qs, dm, n0, 1, sc, out);
                        else if (quad) q4_tile(xq, xd, xs, m0, 1, K, qs, dm, n0, NC, sc, out);
                        else q4_tile(xq, xd, xs, m0, 1, K, qs, dm, n0, 1, sc, out);
                    } else {
                        if (two && quad) q8_tile(xq, xd, m0, 2, K, w, ws, skind, n0, NC, out);
                        else if (two) q8_tile(xq, xd, m0, 2, K, w, ws, skind, n0, 1, out);
                        else if (quad) q8_tile(xq, xd, m0, 1, K, w, ws, skind, n0, NC, out);
                        else q8_tile(xq, xd, m0, 1, K, w, ws, skind, n0, 1, out);
                    }
                    const int nc = quad ? NC : 1;
                    for (int r = 0; r < mb; r++)
                        for (int c = 0; c < nc; c++) store_kind(y, ykind, (m0 + r) * N + n0 + c, out[r][c]);
                    n0 += nc;
                }
            }
        }
        free(sc);
    }
    free(xq);
    free(xd);
    return failed ? 2 : 0;
}

/* y [M, N] = x [M, K] @ W^T, W in int4 groups (qs, dm) */
int qm_q4_linear(const void *x, int xkind, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *dm, int64_t N,
                 void *y, int ykind, int nthreads) {
    return run(x, xkind, M, K, N, y, ykind, nthreads, 4, qs, dm, NULL, NULL, 0);
}

/* The same with the activations in bf16 (AVX512_BF16 builds; else refused: qm_has_bf16) */
int qm_q4_linear_bf16(const void *x, int xkind, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *dm,
                      int64_t N, void *y, int ykind, int nthreads) {
    return run(x, xkind, M, K, N, y, ykind, nthreads, 5, qs, dm, NULL, NULL, 0);
}

int qm_has_bf16(void) { return QM_BF16; }

/* The same with the activations in fp32, as they are (every build) */
int qm_q4_linear_f32(const void *x, int xkind, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *dm,
                     int64_t N, void *y, int ykind, int nthreads) {
    return run(x, xkind, M, K, N, y, ykind, nthreads, 6, qs, dm, NULL, NULL, 0);
}

/* y [M, N] = x [M, K] @ W^T, W int8 rows (w, ws of kind skind) */
int qm_q8_linear(const void *x, int xkind, int64_t M, int64_t K, const int8_t *w, const void *ws, int skind,
                 int64_t N, void *y, int ykind, int nthreads) {
    if (skind != X_F32 && skind != X_BF16) return 1;
    return run(x, xkind, M, K, N, y, ykind, nthreads, 8, NULL, NULL, w, ws, skind);
}

/* The same with the activations in fp32, as they are (every build) */
int qm_q8_linear_f32(const void *x, int xkind, int64_t M, int64_t K, const int8_t *w, const void *ws, int skind,
                     int64_t N, void *y, int ykind, int nthreads) {
    if (skind != X_F32 && skind != X_BF16) return 1;
    return run(x, xkind, M, K, N, y, ykind, nthreads, 9, NULL, NULL, w, ws, skind);
}

/* ---------------------------------------------------------------- MXFP4 x fp32 activations
 *
 * gpt-oss's experts as they ship: FP4 e2m1 codes in blocks of 32 along K, each block with an
 * e8m0 exponent (the OCP microscaling format; ggml's block_mxfp4 split in two arrays):
 *   qs [N, K/2] uint8: block g of row n is bytes [16g, 16g + 16); byte j holds value 32g + j's
 *                      code in its low nibble, 32g + j + 16's in its high one (ggml's order)
 *   e  [N, K/32] uint8: w = fp4(code) * 2^(e - 127)
 * As llama.cpp's MXFP4 dot product, a 16-entry table of levels: on AVX-512 the e2m1 levels
 * as floats times the block's power of two (vscalef), each code's weight picked from them
 * (vpermps: 16 at a time); on AVX2 and in C the levels doubled (small integers, looked up 16 at
 * a time by pshufb, widened to fp32) and half the block's scale, 2^(e - 128) (ggml's
 * e8m0_to_fp32_half). The activations as they are, fp32 (bf16 widened): every weight is exact
 * in fp32 and every product exact in an FMA, so a row's result is the dequantized weight's
 * float64 product up to the order of the fp32 sums (no fitted grid, no rounding of x). Threads and
 * tiles as the kernels above (NC columns by up to MX_MB rows, OpenMP over blocks of NBLOCK
 * columns); each output is its row's dot product in a fixed order, whatever M or the threads.
 */
static const int8_t MX_LEVELS[16] __attribute__((unused)) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float mx_half_scale(uint8_t e) { /* 2^(e - 128), subnormal for e < 2 */
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

#if QM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define MX_512 1
#define MX_MB 4 /* rows a tile sums at once: 16 accumulators of 32 registers */
#else
#define MX_512 0
#define MX_MB 2 /* AVX2's 16 registers: 8 accumulators */
#endif

static inline __attribute__((always_inline)) void mx_tile(const float *xf, int64_t m0, const int mb, int64_t K,
                                                          const uint8_t *qs, const uint8_t *e, int64_t n0,
                                                          const int nc, float out[MX_MB][NC]) {
    const int64_t G = K / QK;
#if QM_AVX2
#if MX_512
    const __m512 levels = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                         -2.0f, -3.0f, -4.0f, -6.0f);
    __m512 acc[MX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
#else
    const __m128i lo4 = _mm_set1_epi8(0x0f);
    const __m128i lut = _mm_loadu_si128((const __m128i *)MX_LEVELS);
    __m256 acc[MX_MB][NC];
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
#endif
    for (int64_t g = 0; g < G; g++) {
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2) + g * 16;
            __m128i b = _mm_loadu_si128((const __m128i *)q);
            _mm_prefetch((const char *)(q + AHEAD * (K / 2)), _MM_HINT_T0);
#if MX_512
            /* the levels times the block's power of two (vscalef: exact, subnormals too), then
             * each code's value picked from those 16 (vpermps): the weights themselves, exact */
            __m512 lv16 = _mm512_scalef_ps(levels, _mm512_set1_ps((float)e[(n0 + c) * G + g] - 127.0f));
            __m512i bz = _mm512_cvtepu8_epi32(b); /* vpermps reads an index's low 4 bits */
            __m512 w0 = _mm512_permutexvar_ps(bz, lv16);
            __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bz, 4), lv16);
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + g * QK;
                acc[r][c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][c]));
            }
#else
            /* the codes of values 0-15 (low nibbles) and 16-31 (high ones), their doubled levels
             * as int8 (pshufb), widened to fp32, by half the block's scale */
            __m128i lo = _mm_and_si128(b, lo4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo4);
            __m128i lv = _mm_shuffle_epi8(lut, lo), hv = _mm_shuffle_epi8(lut, hi);
            const float s = mx_half_scale(e[(n0 + c) * G + g]);
            __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lv)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lv, 8))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hv)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hv, 8)))};
            for (int r = 0; r < mb; r++) {
                const float *xr = xf + (m0 + r) * K + g * QK;
                __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
                for (int k = 1; k < 4; k++) dot = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xr + 8 * k), dot);
                acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s), acc[r][c]);
            }
#endif
        }
    }
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++)
#if MX_512
            out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
#else
            out[r][c] = hsum8(acc[r][c]);
#endif
#else
    for (int r = 0; r < mb; r++)
        for (int c = 0; c < nc; c++) {
            const uint8_t *q = qs + (n0 + c) * (K / 2);
            const float *xr = xf + (m0 + r) * K;
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.0f;
                for (int j = 0; j < 16; j++)
                    dot += (float)MX_LEVELS[q[g * 16 + j] & 0x0f] * xr[g * QK + j] +
                           (float)MX_LEVELS[q[g * 16 + j] >> 4] * xr[g * QK + j + 16];
                acc += dot * mx_half_scale(e[(n0 + c) * G + g]);
            }
            out[r][c] = acc;
        }
#endif
}

/* y [M, N] = x [M, K] @ W^T, W in MXFP4 blocks (qs, e): 0, or 1 for shapes or kinds it does
 * not take, 2 when out of memory */
int qm_mxfp4_linear(const void *x, int xkind, int64_t M, int64_t K, const uint8_t *qs, const uint8_t *e, int64_t N,
                    void *y, int ykind, int nthreads) {
    if (M == 0) return 0;
    if (M < 0 || K < QK || K % QK || N < 1 || (xkind != X_F32 && xkind != X_BF16) || (ykind != X_F32 && ykind != X_BF16))
        return 1;
    float *wide = NULL; /* bf16 activations widened to fp32 once */
    if (xkind != X_F32) {
        wide = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!wide) return 2;
        for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const float *xf = wide ? wide : (const float *)x;
    int nt = nthreads < 1 ? 1 : nthreads;
    const int64_t blocks = (N + NBLOCK - 1) / NBLOCK;
    if (blocks < nt) nt = (int)blocks;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t bi = 0; bi < blocks; bi++) {
        float out[MX_MB][NC];
        const int64_t n1 = (bi + 1) * NBLOCK < N ? (bi + 1) * NBLOCK : N;
        for (int64_t m0 = 0; m0 < M;) {
            const int mb = M - m0 >= MX_MB ? MX_MB : M - m0 >= 2 ? 2 : 1;
            for (int64_t n0 = bi * NBLOCK; n0 < n1;) {
                const int quad = n1 - n0 >= NC;
                /* constant (mb, nc) at each call: the compiler specializes each tile */
                if (mb == MX_MB && quad) mx_tile(xf, m0, MX_MB, K, qs, e, n0, NC, out);
                else if (mb == MX_MB) mx_tile(xf, m0, MX_MB, K, qs, e, n0, 1, out);
                else if (mb == 2 && quad) mx_tile(xf, m0, 2, K, qs, e, n0, NC, out);
                else if (mb == 2) mx_tile(xf, m0, 2, K, qs, e, n0, 1, out);
                else if (quad) mx_tile(xf, m0, 1, K, qs, e, n0, NC, out);
                else mx_tile(xf, m0, 1, K, qs, e, n0, 1, out);
                const int nc = quad ? NC : 1;
                for (int r = 0; r < mb; r++)
                    for (int c = 0; c < nc; c++) store_kind(y, ykind, (m0 + r) * N + n0 + c, out[r][c]);
                n0 += nc;
            }
            m0 += mb;
        }
    }
    free(wide);
    return 0;
}

/* ---------------------------------------------------------------- a MoE layer's routed experts
 *
 * One call for every token's routed experts of one layer (what a step otherwise spends on ~10
 * torch ops an expert: gathers, biases, the gated activation, the weighted sum):
 *   y[m] = sum_j wts[m, j] * (down_e(glu(gate_up_e(x[m]) + bu_e)) + bd_e),  e = ids[m, j]
 * x [M, H]; ids [M, k] int64 in [0, E); wts [M, k] fp32; each expert's gate_up [2I, H] (gate rows,
 * then up rows) and down [H, I] in one of the fp32-activation kinds: 6 int4 groups (a: qs
 * [E, 2I|H, K/2], b: dm [E, N, 2, K/32] fp16), 9 int8 rows (a: w [E, N, K], b: scales [E, N] of
 * skind), 10 MXFP4 (a: qs [E, N, K/2], b: e [E, N, K/32]); biases bu [E, 2I], bd [E, H] of bkind,
 * or NULL; glu 0: silu(gate) * up, 1: gpt-oss's clamped SwiGLU (alpha, limit).
 * Everything between the two matrices in fp32. The assignments are grouped by expert (stable:
 * tokens in order), each expert's rows multiplied in the tiles above, all experts' column blocks
 * shared out among the threads at once (one barrier a phase, not one an expert); each token's
 * k outputs summed in its own slot order. A row's result depends on its own row only: the
 * same bits alone, batched and on any thread count.
 */
enum { GLU_SILU = 0, GLU_CLAMPED = 1 };

typedef struct { /* one expert's matrix, as its kind holds it */
    const uint8_t *qs;  /* int4 levels / MXFP4 codes */
    const uint16_t *dm; /* int4 scales and minima */
    const int8_t *w;    /* int8 rows */
    const void *ws;     /* their scales (skind) */
    const uint8_t *e;   /* MXFP4 exponents */
} qmat;

static qmat expert_mat(int kind, const void *a, const void *b, int skind, int64_t ex, int64_t N, int64_t K) {
    qmat m = {0};
    if (kind == 6) {
        m.qs = (const uint8_t *)a + ex * N * (K / 2);
        m.dm = (const uint16_t *)b + ex * N * 2 * (K / QK);
    } else if (kind == 9) {
        m.w = (const int8_t *)a + ex * N * K;
        m.ws = (const char *)b + ex * N * (skind == X_BF16 ? 2 : 4);
    } else {
        m.qs = (const uint8_t *)a + ex * N * (K / 2);
        m.e = (const uint8_t *)b + ex * N * (K / QK);
    }
    return m;
}

/* Column block bi of rows [M, K] (fp32, contiguous) times one matrix, into y [M, N] fp32: run's
 * tiles for the fp32-activation kinds */
static void block_rows(int kind, const qmat *w, int skind, const float *xf, int64_t M, int64_t K, int64_t N,
                       int64_t bi, float *y, float *sc) {
    float out[MAX_MB][NC];
    const int64_t n1 = (bi + 1) * NBLOCK < N ? (bi + 1) * NBLOCK : N;
    for (int64_t m0 = 0, mb; m0 < M; m0 += mb) {
        mb = M - m0 >= F32_MB ? F32_MB : M - m0 >= 2 ? 2 : 1; /* F32_MB <= MX_MB on every build */
        const int four = mb == 4, two = mb == 2;
        for (int64_t n0 = bi * NBLOCK; n0 < n1;) {
            const int quad = n1 - n0 >= NC;
            if (kind == 6) {
                if (four && quad) q4f_tile(xf, m0, 4, K, w->qs, w->dm, n0, NC, sc, out);
                else if (four) q4f_tile(xf, m0, 4, K, w->qs, w->dm, n0, 1, sc, out);
                else if (two && quad) q4f_tile(xf, m0, 2, K, w->qs, w->dm, n0, NC, sc, out);
                else if (two) q4f_tile(xf, m0, 2, K, w->qs, w->dm, n0, 1, sc, out);
                else if (quad) q4f_tile(xf, m0, 1, K, w->qs, w->dm, n0, NC, sc, out);
                else q4f_tile(xf, m0, 1, K, w->qs, w->dm, n0, 1, sc, out);
            } else if (kind == 9) {
                if (four && quad) q8f_tile(xf, m0, 4, K, w->w, w->ws, skind, n0, NC, out);
                else if (four) q8f_tile(xf, m0, 4, K, w->w, w->ws, skind, n0, 1, out);
                else if (two && quad) q8f_tile(xf, m0, 2, K, w->w, w->ws, skind, n0, NC, out);
                else if (two) q8f_tile(xf, m0, 2, K, w->w, w->ws, skind, n0, 1, out);
                else if (quad) q8f_tile(xf, m0, 1, K, w->w, w->ws, skind, n0, NC, out);
                else q8f_tile(xf, m0, 1, K, w->w, w->ws, skind, n0, 1, out);
            } else {
#if F32_MB == 4
                if (four && quad) mx_tile(xf, m0, 4, K, w->qs, w->e, n0, NC, out);
                else if (four) mx_tile(xf, m0, 4, K, w->qs, w->e, n0, 1, out);
                else
#endif
                if (two && quad) mx_tile(xf, m0, 2, K, w->qs, w->e, n0, NC, out);
                else if (two) mx_tile(xf, m0, 2, K, w->qs, w->e, n0, 1, out);
                else if (quad) mx_tile(xf, m0, 1, K, w->qs, w->e, n0, NC, out);
                else mx_tile(xf, m0, 1, K, w->qs, w->e, n0, 1, out);
            }
            const int nc = quad ? NC : 1;
            for (int64_t r = 0; r < mb; r++)
                for (int c = 0; c < nc; c++) y[(m0 + r) * N + n0 + c] = out[r][c];
            n0 += nc;
        }
    }
}

typedef struct { /* an expert with rows this call: its matrices and its rows' place in the sorted assignments */
    qmat gu, dn;
    int64_t start, rows;
} active_expert;

static inline float glu_one(float g, float u, int glu, float alpha, float limit) {
    if (glu == GLU_SILU) return g / (1.0f + expf(-g)) * u;
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

int qm_experts(const void *x, int xkind, int64_t M, int64_t H, int64_t I, int topk, const int64_t *ids,
               const float *wts, int64_t E, int kind, const void *gu_a, const void *gu_b, const void *dn_a,
               const void *dn_b, int skind, const void *gu_bias, const void *dn_bias, int bkind, int glu,
               float alpha, float limit, void *y, int ykind, int nthreads) {
    if (M == 0) return 0;
    if (M < 0 || topk < 1 || E < 1 || H < QK || H % QK || I < QK || I % QK || H / QK > MAX_G || 2 * I / QK > MAX_G ||
        (kind != 6 && kind != 9 && kind != 10) || (xkind != X_F32 && xkind != X_BF16) ||
        (ykind != X_F32 && ykind != X_BF16) || (skind != X_F32 && skind != X_BF16) ||
        (bkind != X_F32 && bkind != X_BF16) || (glu != GLU_SILU && glu != GLU_CLAMPED))
        return 1;
    const int64_t A = M * topk;
    for (int64_t i = 0; i < A; i++)
        if (ids[i] < 0 || ids[i] >= E) return 1;
    const int64_t G = H > I ? H / QK : I / QK; /* the most groups a row of either matrix has */
    /* the assignments sorted by expert (a counting sort: stable), where each landed */
    int64_t *count = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    /* pos[a]: where assignment a landed; src[r]: the assignment sorted row r holds */
    int64_t *pos = (int64_t *)malloc((size_t)A * sizeof(int64_t)), *src = (int64_t *)malloc((size_t)A * sizeof(int64_t));
    active_expert *act = (active_expert *)malloc((size_t)(E < A ? E : A) * sizeof(active_expert));
    /* the sorted rows: inputs [A, H], gate_up out [A, 2I], activated [A, I], expert out [A, H] */
    float *xg = (float *)malloc((size_t)A * (size_t)(H + 2 * I + I + H) * sizeof(float));
    if (!count || !pos || !src || !act || !xg) {
        free(count), free(pos), free(src), free(act), free(xg);
        return 2;
    }
    float *gu = xg + A * H, *av = gu + A * 2 * I, *ys = av + A * I;
    for (int64_t i = 0; i < A; i++) count[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    int64_t na = 0;
    for (int64_t e = 0; e < E; e++)
        if (count[e + 1] > count[e]) {
            act[na].gu = expert_mat(kind, gu_a, gu_b, skind, e, 2 * I, H);
            act[na].dn = expert_mat(kind, dn_a, dn_b, skind, e, H, I);
            act[na].start = count[e], act[na].rows = count[e + 1] - count[e];
            na++;
        }
    for (int64_t i = 0; i < A; i++) { /* count[e] runs from e's start to its end */
        pos[i] = count[ids[i]]++;
        src[pos[i]] = i;
    }
    const int64_t nb_gu = (2 * I + NBLOCK - 1) / NBLOCK, nb_dn = (H + NBLOCK - 1) / NBLOCK;
    int nt = nthreads < 1 ? 1 : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(|| : failed)
    {
        float *sc = (float *)malloc(sizeof(float) * MAX_MB * NC * SC_PER_RC(G));
        if (!sc) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < A; r++) { /* gather each sorted row's input, in fp32 */
            const int64_t m = src[r] / topk;
            float *dst = xg + r * H;
            if (xkind == X_F32) memcpy(dst, (const float *)x + m * H, (size_t)H * sizeof(float));
            else
                for (int64_t i = 0; i < H; i++) dst[i] = bf16_to_f32(((const uint16_t *)x)[m * H + i]);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < na * nb_gu; it++) {
            const active_expert *ae = &act[it / nb_gu]; /* work item it: (expert, column block) */
            const int64_t bi = it % nb_gu;
            if (sc) block_rows(kind, &ae->gu, skind, xg + ae->start * H, ae->rows, H, 2 * I, bi,
                               gu + ae->start * 2 * I, sc);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < A; r++) { /* each row's gate_up bias, then its gated activation */
            const int64_t e = ids[src[r]];
            const float *g = gu + r * 2 * I;
            float *o = av + r * I;
            for (int64_t i = 0; i < I; i++) {
                float gv = g[i], uv = g[I + i];
                if (gu_bias) {
                    gv += load_kind(gu_bias, bkind, e * 2 * I + i);
                    uv += load_kind(gu_bias, bkind, e * 2 * I + I + i);
                }
                o[i] = glu_one(gv, uv, glu, alpha, limit);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < na * nb_dn; it++) {
            const active_expert *ae = &act[it / nb_dn]; /* work item it: (expert, column block) */
            const int64_t bi = it % nb_dn;
            if (sc) block_rows(kind, &ae->dn, skind, av + ae->start * I, ae->rows, I, H, bi,
                               ys + ae->start * H, sc);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) { /* each token's k outputs, in its slot order */
            for (int64_t i = 0; i < H; i++) {
                float acc = 0.0f;
                for (int j = 0; j < topk; j++) {
                    const int64_t a = m * topk + j;
                    float v = ys[pos[a] * H + i];
                    if (dn_bias) v += load_kind(dn_bias, bkind, ids[a] * H + i);
                    acc += wts[a] * v;
                }
                store_kind(y, ykind, m * H + i, acc);
            }
        }
        free(sc);
    }
    free(count), free(pos), free(src), free(act), free(xg);
    return failed ? 2 : 0;
}
