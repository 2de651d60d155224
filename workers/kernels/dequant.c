/* GGUF's block formats -> float32, the loader's dequantization (workers/gguf_weights.py, which
 * documents each layout and keeps the torch version of every format: the fallback without a C
 * compiler, and what this is held to bit for bit by tests/unit/test_dequant_kernel.py).
 *
 * Why C: the torch version unpacks a chunk of blocks at a time with ~10-30 ops a chunk; a
 * Qwen3.5-0.8B Q4_K_M file took 6.2 s of its 13.8 s load there (its Q4_K and Q6_K tensors), where
 * a pass in C over the bytes takes a fraction of a second and one core's cache.
 *
 * Each value is ggml's: the scales' products rounded to fp32 as the torch path rounds them, then
 * d * q (and - m) each rounded once; Q4_1 and Q5_1's d * q + m is one fused multiply-add, as
 * torch's addcmul computes it on the hosts we run (fmaf: the same value on every build).
 *
 * Built by workers/kernels/build.py, called through ctypes by workers/kernels/dequant.py.
 * OpenMP over blocks; every value depends on its block alone.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* the formats, in workers/kernels/dequant.py's order */
enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, N_TYPES };
static const int BLOCK[N_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 256, 32};
static const int BYTES[N_TYPES] = {18, 20, 22, 24, 34, 84, 110, 144, 176, 210, 17};

static inline float half_at(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return f16_to_f32(h);
}

/* Q5_0 / Q5_1's 5-bit values: nibbles (low ones x[0:16]) and bit i of the LE uint32 qh for x[i] */
static inline void q5_values(const uint8_t *qh4, const uint8_t *qs, int q[32]) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    for (int i = 0; i < 16; i++) {
        q[i] = (qs[i] & 0x0F) | (((qh >> i) & 1) << 4);
        q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
}

/* Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins */
static inline void scale_min_k4(const uint8_t *r, int sc[8], int mn[8]) {
    for (int i = 0; i < 4; i++) {
        sc[i] = r[i] & 0x3F;
        mn[i] = r[4 + i] & 0x3F;
        sc[4 + i] = (r[8 + i] & 0x0F) | ((r[i] >> 2) & 0x30);
        mn[4 + i] = (r[8 + i] >> 4) | ((r[4 + i] >> 2) & 0x30);
    }
}

static const float MX_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Q6_K: value 128 h + 32 k + l (half h, quarter k, l < 32) takes its low 4 bits from byte l of
 * ql's half (32 + l for odd k; the high nibble for k >= 2) and its high 2 bits from bits 2k..2k+1
 * of byte l of qh's half; scale (value) / 16; each value (d * scale) * (q - 32), rounded as the
 * torch path rounds it. A half's 128 levels in a few byte ops on AVX2 (a value at a time with
 * its indices divided out was 13x slower than Q4_K's unpacking: 2 GB of a Q4_K_M file's token
 * table and head unpacked per Qwen3.5 load), the same loop in plain C elsewhere. */
static void q6_k(const uint8_t *b, float *y) {
    const float d = half_at(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
#if defined(__AVX2__)
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
        /* (shifts within 16-bit lanes: each byte's bits stay in its byte after the masks) */
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4)),
        };
        for (int k = 0; k < 4; k++) {
            const __m256i v = _mm256_sub_epi8(q[k], off);
            const __m128i runs[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
            for (int r = 0; r < 2; r++) {
                const __m256 ds = _mm256_set1_ps(d * (float)scales[8 * h + 2 * k + r]);
                float *out = y + 128 * h + 32 * k + 16 * r;
                _mm256_storeu_ps(out, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(runs[r]))));
                _mm256_storeu_ps(out + 8, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(runs[r], 8)))));
            }
        }
#else
        int8_t q[128];
        for (int l = 0; l < 32; l++) {
            q[l] = (int8_t)((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
            q[32 + l] = (int8_t)((ql[32 + l] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
            q[64 + l] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            q[96 + l] = (int8_t)((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
        for (int r = 0; r < 8; r++) {
            const float ds = d * (float)scales[8 * h + r];
            for (int i = 0; i < 16; i++) y[128 * h + 16 * r + i] = ds * (float)(q[16 * r + i] - 32);
        }
#endif
    }
}

static void block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case Q8_0: {
        const float d = half_at(b);
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
        break;
    }
    case Q4_0: {
        const float d = half_at(b);
        for (int i = 0; i < 16; i++) {
            y[i] = (float)((b[2 + i] & 0x0F) - 8) * d;
            y[i + 16] = (float)((b[2 + i] >> 4) - 8) * d;
        }
        break;
    }
    case Q4_1: {
        const float d = half_at(b), m = half_at(b + 2);
        for (int i = 0; i < 16; i++) {
            y[i] = fmaf(d, (float)(b[4 + i] & 0x0F), m);
            y[i + 16] = fmaf(d, (float)(b[4 + i] >> 4), m);
        }
        break;
    }
    case Q5_0: {
        int q[32];
        const float d = half_at(b);
        q5_values(b + 2, b + 6, q);
        for (int i = 0; i < 32; i++) y[i] = (float)(q[i] - 16) * d;
        break;
    }
    case Q5_1: {
        int q[32];
        const float d = half_at(b), m = half_at(b + 2);
        q5_values(b + 4, b + 8, q);
        for (int i = 0; i < 32; i++) y[i] = fmaf(d, (float)q[i], m);
        break;
    }
    case Q2_K: { /* 16 sub-blocks of 16: scale low nibble, min high nibble; 2-bit values */
        const uint8_t *sc = b, *qs = b + 16;
        const float d = half_at(b + 80), dmin = half_at(b + 82);
        for (int idx = 0; idx < 256; idx++) { /* value idx: half, shift, byte */
            const int half = idx / 128, sh = (idx / 32) % 4, j = idx % 32, s = idx / 16;
            const float q = (float)((qs[half * 32 + j] >> (2 * sh)) & 3);
            const float dl = d * (float)(sc[s] & 0x0F), ml = dmin * (float)(sc[s] >> 4);
            y[idx] = dl * q - ml;
        }
        break;
    }
    case Q3_K: { /* 16 6-bit scales (low nibbles in bytes 0-7, high 2 bits in 8-11), 3-bit values */
        const uint8_t *hmask = b, *qs = b + 32, *raw = b + 96;
        const float d = half_at(b + 108);
        float ds[16];
        for (int i = 0; i < 16; i++) {
            const int low = i < 8 ? raw[i] & 0x0F : raw[i - 8] >> 4;
            const int high = (raw[8 + i % 4] >> (2 * (i / 4))) & 3;
            ds[i] = d * (float)((int8_t)(low | (high << 4)) - 32);
        }
        for (int idx = 0; idx < 256; idx++) {
            const int half = idx / 128, sh = (idx / 32) % 4, j = idx % 32, s = idx / 32;
            const int q = ((qs[half * 32 + j] >> (2 * sh)) & 3) - (((hmask[j] >> s) & 1) ? 0 : 4);
            y[idx] = ds[idx / 16] * (float)q;
        }
        break;
    }
    case Q4_K:
    case Q5_K: { /* 8 sub-blocks of 32: x = d * scale * q - dmin * min */
        int sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48), *qh = b + 16;
        for (int s = 0; s < 8; s++) {
            const float dl = d * (float)sc[s], ml = dmin * (float)mn[s];
            for (int j = 0; j < 32; j++) { /* chunk s / 2's low nibbles, then its high ones */
                int q = (qs[(s / 2) * 32 + j] >> (4 * (s % 2))) & 0x0F;
                if (type == Q5_K) q |= ((qh[j] >> s) & 1) << 4;
                y[s * 32 + j] = dl * (float)q - ml;
            }
        }
        break;
    }
    case Q6_K: /* 16 int8 scales of 16 values; 4 low bits in ql, 2 high bits in qh */
        q6_k(b, y);
        break;
    case MXFP4: { /* e8m0 exponent byte, e2m1 nibbles (low ones x[0:16]); ggml's doubled levels */
        const int e = (int)b[0] - 128;
        for (int i = 0; i < 16; i++) {
            y[i] = ldexpf(MX_LEVELS[b[1 + i] & 0x0F], e);
            y[i + 16] = ldexpf(MX_LEVELS[b[1 + i] >> 4], e);
        }
        break;
    }
    }
}

/* y [nblocks * block] = the nblocks blocks at src; 0 on success, 1 for an unknown type */
int dq_blocks(int type, const uint8_t *src, int64_t nblocks, float *y, int nthreads) {
    if (type < 0 || type >= N_TYPES || nblocks < 0) return 1;
    const int64_t bs = BLOCK[type], nb = BYTES[type];
    int nt = nthreads < 1 ? 1 : nthreads;
    if (nblocks < 4096) nt = 1; /* a small tensor: not worth waking the threads */
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t i = 0; i < nblocks; i++) block(type, src + i * nb, y + i * bs);
    return 0;
}

/* ---------------------------------------------------------------- a 4-bit file's grids
 *
 * dq_grid_fit: workers/quant.py's _grid_fit in one pass a group (the torch version takes ~8 passes
 * over a whole weight for L = 15, then more over the groups left: 2.3 s of a Qwen3.5-0.8B Q4_K_M
 * load). Each group of 32 unpacked values is tried on the grid of L = 15, 14, ... 1 steps between
 * its lowest and highest value; it fits when every value is within tol of a step. The same
 * arithmetic as the torch version (each (w - lo) / step rounded once, nearest-even rounding), so
 * the same levels, steps and minima. q: the levels as floats [groups, 32]; step, lo [groups].
 * Returns 1 when every group fits, else 0 (q of a group that fits no grid: its L = 15 rounding). */
static inline int grid_fits(const float *x, float lo, float step, float tol, float *q) {
    int ok = 1;
    for (int i = 0; i < 32; i++) {
        const float v = (x[i] - lo) / step, r = nearbyintf(v);
        q[i] = r;
        if (!(fabsf(v - r) <= tol)) ok = 0;
    }
    return ok;
}

/* Whether the group fits the grid, stopping at the first value off it (a coarser L is tried on
 * most Q4_K groups, and most values miss it: 32 divisions a try were 0.9 s of a MoE load). */
static inline int grid_try(const float *x, float lo, float step, float tol) {
    for (int i = 0; i < 32; i++) {
        const float v = (x[i] - lo) / step;
        if (!(fabsf(v - nearbyintf(v)) <= tol)) return 0;
    }
    return 1;
}

/* A group's lowest and highest value. */
static inline void group_range(const float *x, float *lo, float *hi) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < 32; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    *lo = mn;
    *hi = mx;
}

/* One group's fit: its levels q, step and lowest value; 1 when it fits. */
static int fit_group(const float *x, float tol, float *q, float *step, float *lo) {
    float mn, mx;
    group_range(x, &mn, &mx);
    const float span = mx - mn;
    float st = span > 0 ? span / 15.0f : 1.0f; /* a constant group is level 0 (step 1) */
    int ok = grid_fits(x, mn, st, tol, q);
    for (int L = 14; L >= 1 && !ok; L--) {
        const float d = span / (float)L;
        if (grid_try(x, mn, d, tol)) {
            grid_fits(x, mn, d, tol, q);
            st = d;
            ok = 1;
        }
    }
    *step = st;
    *lo = mn;
    return ok;
}

int dq_grid_fit(const float *w, int64_t groups, float tol, float *q, float *step, float *lo, int nthreads) {
    int64_t misfits = 0;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (groups < 4096) nt = 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static) reduction(+ : misfits)
    for (int64_t g = 0; g < groups; g++) misfits += !fit_group(w + g * 32, tol, q + g * 32, step + g, lo + g);
    return misfits == 0;
}

/* One group on the min/max grid workers/quant.py's _affine_groups fits: step (max - min) / 15,
 * at least 1e-8, step and minimum rounded to fp16 first (sh, lh), each level (w - min) / step
 * rounded to nearest even and clamped to 0..15 (a constant group's step rounds to 0: its 0 / 0
 * levels are 0, as torch converts them). */
static void affine_group(const float *x, float *q, uint16_t *sh, uint16_t *lh) {
    float mn, mx;
    group_range(x, &mn, &mx);
    float st = (mx - mn) / 15.0f;
    st = st < 1e-8f ? 1e-8f : st;
    *sh = f32_to_f16(st);
    *lh = f32_to_f16(mn);
    const float s = f16_to_f32(*sh), lo = f16_to_f32(*lh);
    for (int i = 0; i < 32; i++) {
        const float r = nearbyintf((x[i] - lo) / s);
        q[i] = r >= 15.0f ? 15.0f : r > 0.0f ? r : 0.0f; /* NaN: 0 */
    }
}

/* dq_q4_pack: a [N, K] fp32 weight straight into the int4 kernel's layout, as workers/quant.py's
 * q4_groups packs it (its torch ops a whole weight at a time, then a stack and a conversion: ~1
 * s of a Qwen3-30B-A3B 2-layer load, and 0.46 s more for one layer's Q6_K down experts): qs
 * [N, K/2], byte j of group g holding level j low and level j + 16 high; dm [N, 2, K/32] fp16,
 * the groups' steps, then their lowest values, rounded to nearest even. affine 0: each group on
 * its own 4-bit grid (dq_grid_fit's verdict), found early when one is not (the outputs are then
 * unfinished); affine 1: each on its min/max grid (affine_group). Returns 1 when every group is
 * packed, 0 when one is on no grid, 2 on bad arguments. */
int dq_q4_pack(const float *w, int64_t N, int64_t K, float tol, int affine, uint8_t *qs, uint16_t *dm,
               int nthreads) {
    if (N < 0 || K < 32 || K % 32) return 2;
    const int64_t G = K / 32;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (N * K < (1 << 17)) nt = 1;
    volatile int missed = 0;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (missed) continue;
        for (int64_t g = 0; g < G; g++) {
            const float *x = w + n * K + g * 32;
            float q[32], st, lo;
            uint16_t sh, lh;
            if (affine) {
                affine_group(x, q, &sh, &lh);
            } else if (fit_group(x, tol, q, &st, &lo)) {
                sh = f32_to_f16(st);
                lh = f32_to_f16(lo);
            } else {
                missed = 1;
                break;
            }
            uint8_t *b = qs + n * (K / 2) + g * 16;
            for (int j = 0; j < 16; j++) b[j] = (uint8_t)((int)q[j] | ((int)q[j + 16] << 4));
            dm[n * 2 * G + g] = sh;
            dm[n * 2 * G + G + g] = lh;
        }
    }
    return missed ? 0 : 1;
}

/* ---------------------------------------------------------------- int8 rows
 *
 * workers/quant.py's int8_rows in one pass a row (its torch ops take a run of rows at a time:
 * ~7 passes over each, 1.0 s of a Qwen3.5-0.8B Q4_K_M load for its head and Q6_K linears):
 * s = max(max |w|, 1e-8) / 127 and q = w / s rounded to nearest-even and clamped to +-127, in fp32
 * as torch computes them (the same q and s, bit for bit). dq_int8_rows takes a dense weight
 * (fp32 or bf16, wkind 0 / 1); dq_int8_rows_blocks a GGUF tensor's blocks, each row unpacked as
 * dq_blocks unpacks it (and rounded to bf16 when bf16 is set: a bf16 model's table holds those
 * values), so a token table held as blocks gives its tied head's rows without a dense copy. */
static void q8_row(const float *w, int64_t K, int8_t *q, float *scale) {
    float mx = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        const float a = fabsf(w[i]);
        mx = a > mx ? a : mx;
    }
    const float s = (mx > 1e-8f ? mx : 1e-8f) / 127.0f;
    for (int64_t i = 0; i < K; i++) {
        float r = nearbyintf(w[i] / s);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[i] = (int8_t)r;
    }
    *scale = s;
}

int dq_int8_rows(const void *w, int wkind, int64_t N, int64_t K, int8_t *q, float *scale, int nthreads) {
    if ((wkind != 0 && wkind != 1) || N < 0 || K < 1) return 1;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (N * K < (1 << 17)) nt = 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(|| : failed)
    {
        float *row = wkind == 1 ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (wkind == 1 && !row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (failed) continue;
            const float *x = (const float *)w + n * K;
            if (wkind == 1) {
                const uint16_t *b = (const uint16_t *)w + n * K;
                for (int64_t i = 0; i < K; i++) row[i] = bf16_to_f32(b[i]);
                x = row;
            }
            q8_row(x, K, q + n * K, scale + n);
        }
        free(row);
    }
    return failed ? 2 : 0;
}

int dq_int8_rows_blocks(int type, const uint8_t *src, int64_t N, int64_t K, int bf16, int8_t *q, float *scale,
                        int nthreads) {
    if (type < 0 || type >= N_TYPES || N < 0 || K < 1 || K % BLOCK[type]) return 1;
    const int64_t bs = BLOCK[type], nb = BYTES[type], per = K / bs;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (N * K < (1 << 17)) nt = 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(|| : failed)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
        if (!row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!row) continue;
            for (int64_t j = 0; j < per; j++) block(type, src + (n * per + j) * nb, row + j * bs);
            if (bf16)
                for (int64_t i = 0; i < K; i++) row[i] = bf16_to_f32(f32_to_bf16(row[i]));
            q8_row(row, K, q + n * K, scale + n);
        }
        free(row);
    }
    return failed ? 2 : 0;
}
