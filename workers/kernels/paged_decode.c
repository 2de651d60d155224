/* Paged decode attention: one pre-scaled query row per sequence against the K/V rows of its
 * blocks in the paged pool, read where they lie (no gathered copy of the context).
 *
 * Built at run time by workers/kernels/build.py (cc -O3 -march=native -fopenmp -shared -fPIC)
 * and called through ctypes by workers/kernels/paged.py.
 *
 * Shapes (all contiguous):
 *   q, out      [B, H, D]          fp32 or bf16 (out in q's kind)
 *   k, v pools  [rows, KV, D]      fp32 / bf16 / fp16, or quantized rows (kv_quant.QuantRows):
 *                                  q8_0: int8 [rows, KV, D] + fp16 scales [rows, KV, D/32]
 *                                  q4_0: uint8 [rows, KV, D/2] (block_q4_0 nibbles) + fp16 scales
 *   table       [B, nb]            int64 or int32 block ids; position p of row b lives in pool
 *                                  row table[b][p / bs] * bs + p % bs
 *   lens        [B]                int64 or int32: row b attends to positions 0 .. lens[b] - 1
 *   sinks       [H] fp32 or NULL   gpt-oss: one more logit per head, with no value
 *
 * Work: a row's context is cut into CHUNK positions (a constant: the split depends on the
 * row's own length only). One work item is (row, KV head, chunk): the G query heads of that
 * KV head against the chunk's keys (GQA without repeating K/V), a two-pass softmax inside the
 * chunk in fp32 (max, then exp and sum), values weighted in fp32. The items' partials
 * (max, sum, acc) are then merged per (row, KV head) in chunk order (flash-decoding). So a
 * row's arithmetic never depends on the other rows of the batch, on the thread count nor on
 * which thread ran which item: bit-identical output alone or batched.
 *
 * Threads: OpenMP. Loaded after torch, this library's NEEDED libgomp.so.1 binds to the copy
 * torch already loaded (same SONAME): one runtime, one thread pool (checked in
 * tests/unit/test_paged_kernel.py through /proc/self/maps and pd_omp_max_threads). The
 * caller passes the thread count (torch.get_num_threads()).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define PD_AVX512 1
#else
#define PD_AVX512 0
#endif

enum { K_F32 = 0, K_BF16 = 1, K_F16 = 2, K_Q8_0 = 3, K_Q4_0 = 4 };
#define CHUNK 256 /* positions of one work item */
#define QBLOCK 32 /* values per quantization block (one fp16 scale) */
#define MAX_G 32  /* query heads per KV head the stack buffers hold */
#define MAX_D 512

/* ---------------------------------------------------------------- scalar conversions: convert.h */

/* ---------------------------------------------------------------- vector helpers */

/* One cache row of one KV head as D fp32 values: the pool's own row for fp32, else
 * converted (or dequantized) into buf. */
static inline const float *row_f32(int kind, const void *data, const uint16_t *scales, int64_t row,
                                   int64_t kvh, int64_t KV, int64_t D, float *buf) {
    int64_t r = row * KV + kvh;
    switch (kind) {
    case K_F32:
        return (const float *)data + r * D;
    case K_BF16: {
        const uint16_t *s = (const uint16_t *)data + r * D;
#if PD_AVX512
        for (int64_t i = 0; i < D; i += 16) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
            _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
#else
        for (int64_t i = 0; i < D; i++) buf[i] = bf16_to_f32(s[i]);
#endif
        return buf;
    }
    case K_F16: {
        const uint16_t *s = (const uint16_t *)data + r * D;
#if PD_AVX512
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
#else
        for (int64_t i = 0; i < D; i++) buf[i] = f16_to_f32(s[i]);
#endif
        return buf;
    }
    case K_Q8_0: {
        const int8_t *s = (const int8_t *)data + r * D;
        const uint16_t *sc = scales + r * (D / QBLOCK);
        for (int64_t j = 0; j < D / QBLOCK; j++) {
            float d = f16_to_f32(sc[j]);
#if PD_AVX512
            __m512 dv = _mm512_set1_ps(d);
            for (int h = 0; h < QBLOCK; h += 16) {
                __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + j * QBLOCK + h)));
                _mm512_storeu_ps(buf + j * QBLOCK + h, _mm512_mul_ps(_mm512_cvtepi32_ps(w), dv));
            }
#else
            for (int i = 0; i < QBLOCK; i++) buf[j * QBLOCK + i] = (float)s[j * QBLOCK + i] * d;
#endif
        }
        return buf;
    }
    case K_Q4_0: { /* byte i of a block: value i in its low nibble, value i + 16 in its high one */
        const uint8_t *s = (const uint8_t *)data + r * (D / 2);
        const uint16_t *sc = scales + r * (D / QBLOCK);
        for (int64_t j = 0; j < D / QBLOCK; j++) {
            float d = f16_to_f32(sc[j]);
            const uint8_t *p = s + j * (QBLOCK / 2);
            float *o = buf + j * QBLOCK;
#if PD_AVX512
            __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            __m512i eight = _mm512_set1_epi32(8), lo4 = _mm512_set1_epi32(0x0f);
            __m512 dv = _mm512_set1_ps(d);
            __m512i lo = _mm512_sub_epi32(_mm512_and_si512(w, lo4), eight);
            __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(w, 4), eight);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dv));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), dv));
#else
            for (int i = 0; i < QBLOCK / 2; i++) {
                o[i] = (float)((int)(p[i] & 0x0f) - 8) * d;
                o[i + QBLOCK / 2] = (float)((int)(p[i] >> 4) - 8) * d;
            }
#endif
        }
        return buf;
    }
    }
    return buf;
}

/* a . b over D values (D a multiple of 16) */
static inline float dot(const float *a, const float *b, int64_t D) {
#if PD_AVX512
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc[16];
    for (int l = 0; l < 16; l++) acc[l] = a[l] * b[l];
    for (int64_t i = 16; i < D; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
#endif
}

/* acc += w * x over D values */
static inline void axpy(float *acc, float w, const float *x, int64_t D) {
#if PD_AVX512
    __m512 wv = _mm512_set1_ps(w);
    for (int64_t i = 0; i < D; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(acc + i)));
#else
    for (int64_t i = 0; i < D; i++) acc[i] += w * x[i];
#endif
}

/* e^x: x = n ln2 + r (|r| <= ln2 / 2, ln2 split in two for the reduction), e^r by its Taylor
 * series to r^7 (error ~5e-9 relative), times 2^n. Inputs below -104 give 0. */
static const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
static const float C7[8] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};

#if PD_AVX512
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(C7[7]);
    for (int i = 6; i >= 0; i--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C7[i]));
    return _mm512_scalef_ps(p, n);
}
#else
static inline float exp1(float x) {
    x = x < -104.0f ? -104.0f : x;
    float n = nearbyintf(x * LOG2E);
    float r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    float p = C7[7];
    for (int i = 6; i >= 0; i--) p = p * r + C7[i];
    return ldexpf(p, (int)n);
}
#endif

static inline float vmax(const float *s, int64_t n) {
#if PD_AVX512
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    if (i < n) m = _mm512_mask_max_ps(m, (__mmask16)((1u << (n - i)) - 1), m, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), s + i));
    return _mm512_reduce_max_ps(m);
#else
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
#endif
}

/* s[i] = e^(s[i] - m) for i < n; returns their sum */
static inline float exp_sum(float *s, int64_t n, float m) {
#if PD_AVX512
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
        _mm512_mask_storeu_ps(s + i, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
#else
    float acc[16] = {0};
    for (int64_t i = 0; i < n; i++) {
        s[i] = exp1(s[i] - m);
        acc[i % 16] += s[i];
    }
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
#endif
}

/* ---------------------------------------------------------------- the kernel */

typedef struct {
    const void *q;
    int q_kind;
    const void *k, *v;
    const uint16_t *ks, *vs;
    int k_kind, v_kind;
    const void *table;
    int table_i32;
    int64_t nb;
    int64_t B, H, KV, D, G, bs;
    const float *sinks;
    void *out;
} Args;

static inline int64_t block_of(const Args *a, int64_t b, int64_t j) {
    return a->table_i32 ? (int64_t)((const int32_t *)a->table)[b * a->nb + j]
                        : ((const int64_t *)a->table)[b * a->nb + j];
}

/* One item: query heads kvh*G .. kvh*G + G - 1 of row b against positions p0 .. p1 - 1.
 * part: [G] max, [G] sum, [G, D] acc (unnormalized). */
static void run_item(const Args *a, int64_t b, int64_t kvh, int64_t p0, int64_t p1, float *part) {
    const int64_t G = a->G, D = a->D, n = p1 - p0, bs = a->bs;
    float qf[MAX_G * MAX_D] __attribute__((aligned(64)));
    float s[MAX_G * CHUNK] __attribute__((aligned(64))); /* [G, CHUNK] scores, then weights */
    float buf[MAX_D] __attribute__((aligned(64)));
    const int64_t q0 = (b * a->H + kvh * G) * D;
    if (a->q_kind == K_F32)
        memcpy(qf, (const float *)a->q + q0, (size_t)(G * D) * sizeof(float));
    else
        for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f32(((const uint16_t *)a->q)[q0 + i]);
    for (int64_t i = 0; i < n; i++) { /* scores: each key row read (converted) once for G heads */
        int64_t p = p0 + i;
        int64_t row = block_of(a, b, p / bs) * bs + p % bs;
        const float *kr = row_f32(a->k_kind, a->k, a->ks, row, kvh, a->KV, D, buf);
        for (int64_t g = 0; g < G; g++) s[g * CHUNK + i] = dot(qf + g * D, kr, D);
    }
    float *mx = part, *sm = part + G, *acc = part + 2 * G;
    for (int64_t g = 0; g < G; g++) {
        mx[g] = vmax(s + g * CHUNK, n);
        sm[g] = exp_sum(s + g * CHUNK, n, mx[g]);
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        int64_t p = p0 + i;
        int64_t row = block_of(a, b, p / bs) * bs + p % bs;
        const float *vr = row_f32(a->v_kind, a->v, a->vs, row, kvh, a->KV, D, buf);
        for (int64_t g = 0; g < G; g++) axpy(acc + g * D, s[g * CHUNK + i], vr, D);
    }
}

/* Row b, KV head kvh: its chunks' partials (in order) merged, normalized, written to out. */
static void merge(const Args *a, int64_t b, int64_t kvh, const float *parts, int64_t nch) {
    const int64_t G = a->G, D = a->D, stride = G * (D + 2);
    float o[MAX_D];
    for (int64_t g = 0; g < G; g++) {
        int64_t h = kvh * G + g;
        float m = -INFINITY;
        for (int64_t c = 0; c < nch; c++) m = fmaxf(m, parts[c * stride + g]);
        if (a->sinks) m = fmaxf(m, a->sinks[h]);
        float l = a->sinks ? expf(a->sinks[h] - m) : 0.0f;
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t c = 0; c < nch; c++) {
            const float *p = parts + c * stride;
            float w = expf(p[g] - m); /* 1 for the chunk that holds the max */
            l += p[G + g] * w;
            axpy(o, w, p + 2 * G + g * D, D);
        }
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        int64_t o0 = (b * a->H + h) * D;
        if (a->q_kind == K_F32)
            for (int64_t i = 0; i < D; i++) ((float *)a->out)[o0 + i] = o[i] * inv;
        else
            for (int64_t i = 0; i < D; i++) ((uint16_t *)a->out)[o0 + i] = f32_to_bf16(o[i] * inv);
    }
}

int pd_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int pd_chunk(void) { return CHUNK; }

/* Returns 0, or: 1 bad shape, 2 out of memory. */
int pd_paged_decode(const void *q, int q_kind, const void *k, const void *k_scales, int k_kind, const void *v,
                    const void *v_scales, int v_kind, const void *table, int table_i32, int64_t nb,
                    const void *lens, int lens_i32, int64_t B, int64_t H, int64_t KV, int64_t D,
                    int64_t block_size, const float *sinks, void *out, int nthreads, int64_t min_parallel) {
    if (B <= 0 || KV <= 0 || H % KV || D % 16 || D > MAX_D || H / KV > MAX_G || block_size <= 0)
        return 1;
    Args a = {q, q_kind, k, v, (const uint16_t *)k_scales, (const uint16_t *)v_scales, k_kind, v_kind, table,
              table_i32, nb, B, H, KV, D, H / KV, block_size, sinks, out};
    /* items: (row, KV head, chunk), rows in order; first[b]: row b's first item */
    int64_t *first = (int64_t *)malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!first) return 2;
    int64_t work = 0;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t len = lens_i32 ? (int64_t)((const int32_t *)lens)[b] : ((const int64_t *)lens)[b];
        if (len < 0 || (len + block_size - 1) / block_size > nb) {
            free(first);
            return 1;
        }
        first[b + 1] = first[b] + KV * ((len + CHUNK - 1) / CHUNK);
        work += len * KV;
    }
    const int64_t items = first[B], stride = a.G * (D + 2);
    float *parts = (float *)malloc((size_t)(items > 0 ? items : 1) * (size_t)stride * sizeof(float));
    if (!parts) {
        free(first);
        return 2;
    }
    int nt = nthreads < 1 ? 1 : nthreads;
    if (work < min_parallel || items < 2) nt = 1; /* a parallel region costs more than it saves */
    int64_t next = 0;                              /* the next item to take */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        for (;;) {
            int64_t it = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            if (it >= items) break;
            int64_t lo = 0, hi = B; /* the row holding item it: first[lo] <= it < first[lo + 1] */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (first[mid] <= it) lo = mid; else hi = mid;
            }
            int64_t r = it - first[lo], nch = (first[lo + 1] - first[lo]) / KV;
            int64_t kvh = r / nch, c = r % nch;
            int64_t len = lens_i32 ? (int64_t)((const int32_t *)lens)[lo] : ((const int64_t *)lens)[lo];
            int64_t p0 = c * CHUNK, p1 = p0 + CHUNK < len ? p0 + CHUNK : len;
            run_item(&a, lo, kvh, p0, p1, parts + it * stride);
        }
#pragma omp barrier
#ifdef _OPENMP
        int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        int t = 0, n = 1;
#endif
        for (int64_t j = t; j < B * KV; j += n) { /* (row, KV head) pairs, split by thread */
            int64_t b = j / KV, kvh = j % KV, nch = (first[b + 1] - first[b]) / KV;
            merge(&a, b, kvh, parts + (first[b] + kvh * nch) * stride, nch);
        }
    }
    free(parts);
    free(first);
    return 0;
}
