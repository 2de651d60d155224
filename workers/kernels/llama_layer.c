/* One Llama-family decoder layer for a pure decode step, in one call: RMSNorm, the fused q/k/v
 * linear, RoPE, the K/V cache write, paged attention, the output linear and its residual,
 * RMSNorm, the fused gate/up linear, SwiGLU, the down linear and its residual.
 *
 * Qwen3's per-head q/k RMSNorm (before the rotation) is in; biases (Qwen2) are added.
 *
 * Why: at one row a small model's layer is ~30 eager torch ops and four kernel calls, each op a
 * few microseconds of dispatch, more than the arithmetic between the linears; here it is one
 * call. The linears and the attention are the other kernels' own entry points (qmatmul.c's
 * qm_q4_linear / qm_q8_linear, paged_decode.c's pd_paged_decode), reached through the function
 * pointers the plan carries, so each lives and is tested in one place; this file holds only
 * what lies between them.
 *
 * Built at run time by workers/kernels/build.py; called through ctypes by
 * workers/layers/decode_layer.py, which checks that a layer and a step are of the kind this
 * takes (see ``fits`` there) and keeps the torch path for everything else.
 *
 * Shapes (contiguous): x, out [M, hidden] fp32 or bf16 (xkind); rot_cos, rot_sin [M, H + KV, D]
 * (fp32 or bf16, q heads pre-scaled, sin signed for the swapped halves: workers/layers/rotary.py);
 * slots [M] int64 cache rows; the K and V pools [rows, KV, D] fp32 or bf16, or quantized rows
 * (q8_0: int8 [rows, KV, D]; q4_0: uint8 [rows, KV, D / 2]; fp16 scales [rows, KV, D / 32]),
 * each of its own kind. Numbers
 * follow the torch path's roundings where they change the model's state (the residual stream
 * and the cache are rounded to their own dtype); between the linears everything is fp32.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"

/* No a * b + c contracted into one rounding: the K/V quantization below rounds as torch's
 * (workers/kernels/kv_quant.py), one operation at a time */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* the kinds of qmatmul.c (X_*: F32, BF16) and paged_decode.c (K_*: all five) alike */
enum { F32 = 0, BF16 = 1, F16 = 2, Q8_0 = 3, Q4_0 = 4 };
#define QBLOCK 32 /* values per quantized K/V block (one fp16 scale) */

typedef int (*q4_fn)(const void *x, int xkind, int64_t M, int64_t K, const uint8_t *qs, const uint16_t *dm, int64_t N,
                     void *y, int ykind, int nthreads);
typedef int (*q8_fn)(const void *x, int xkind, int64_t M, int64_t K, const int8_t *w, const void *ws, int skind,
                     int64_t N, void *y, int ykind, int nthreads);
typedef int (*pd_fn)(const void *q, int q_kind, const void *k, const void *k_scales, int k_kind, const void *v,
                     const void *v_scales, int v_kind, const void *table, int table_i32, int64_t nb, const void *lens,
                     int lens_i32, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t block_size,
                     const float *sinks, void *out, int nthreads, int64_t min_parallel);

typedef struct {
    int kind;         /* 4: int4 groups (a = qs, b = dm); 8: int8 rows (a = w, b = scales of skind) */
    int skind;
    const void *a, *b;
    const float *bias; /* [n] or NULL */
    int64_t n, k;      /* out, in features */
} Linear;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim;
    float eps_in, eps_post;
    const float *norm_in, *norm_post; /* [hidden] */
    int norm_round;                   /* round x-hat to x's kind before the weight (Llama's norm) */
    const float *qk_norm;             /* [H + KV, D]: Qwen3's per-head q and k norm weights, or NULL */
    float eps_qk;
    Linear qkv, o, gate_up, down;
    q4_fn q4;
    q8_fn q8;
    pd_fn attend;
} Plan;

typedef struct {
    const void *rot_cos, *rot_sin;
    int rot_kind;
    const int64_t *slots;
    const void *table;
    int table_i32;
    int64_t nb;
    const void *lens;
    int lens_i32;
    int64_t block_size, min_parallel;
} Step;

/* One token's K (or V) heads, x [KV * D] fp32, into pool row ``row`` of kind: copied, or
 * quantized per block of 32 as workers/kernels/kv_quant.py's quantize does */
static void write_row(void *data, uint16_t *scales, int kind, int64_t row, int64_t n, const float *x) {
    if (kind == F32 || kind == BF16) {
        for (int64_t i = 0; i < n; i++) store_kind(data, kind, row * n + i, x[i]);
        return;
    }
    for (int64_t b = 0; b < n / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        if (kind == Q8_0) {
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            uint16_t h = f32_to_f16(amax / 127.0f);
            float sc = f16_to_f32(h), inv = sc > 0.0f ? 1.0f / sc : 0.0f;
            int8_t *q = (int8_t *)data + row * n + b * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) {
                float r = rintf(xb[i] * inv);
                q[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
            scales[row * (n / QBLOCK) + b] = h;
        } else { /* Q4_0: the block's value of largest magnitude (the first) sets the scale */
            float m = xb[0];
            for (int i = 1; i < QBLOCK; i++) m = fabsf(xb[i]) > fabsf(m) ? xb[i] : m;
            uint16_t h = f32_to_f16(m / -8.0f);
            float sc = f16_to_f32(h), inv = sc != 0.0f ? 1.0f / sc : 0.0f;
            uint8_t *q = (uint8_t *)data + row * (n / 2) + b * (QBLOCK / 2);
            uint8_t lv[QBLOCK];
            for (int i = 0; i < QBLOCK; i++) {
                float t = xb[i] * inv;
                float r = floorf(t + 8.5f);
                lv[i] = (uint8_t)(r > 15.0f ? 15.0f : r < 0.0f ? 0.0f : r);
            }
            for (int i = 0; i < QBLOCK / 2; i++) q[i] = (uint8_t)(lv[i] | (lv[i + QBLOCK / 2] << 4));
            scales[row * (n / QBLOCK) + b] = h;
        }
    }
}

/* v rounded as a value of kind would be */
static inline float as_kind(float v, int kind) { return kind == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* h = w * x-hat (x-hat = x * rsqrt(mean(x^2) + eps), rounded to x's kind first when round) */
static void rms_norm(const float *x, int64_t M, int64_t D, const float *w, float eps, int round, int kind, float *h) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * D;
        double ss = 0.0;
        for (int64_t i = 0; i < D; i++) ss += (double)r[i] * r[i];
        float s = 1.0f / sqrtf((float)(ss / (double)D) + eps);
        for (int64_t i = 0; i < D; i++) {
            float xh = r[i] * s;
            h[m * D + i] = round ? as_kind(as_kind(xh, kind) * w[i], kind) : xh * w[i];
        }
    }
}

static int linear(const Plan *p, const Linear *l, const float *x, int64_t M, float *y, int nthreads) {
    int rc = l->kind == 4 ? p->q4(x, F32, M, l->k, (const uint8_t *)l->a, (const uint16_t *)l->b, l->n, y, F32, nthreads)
                          : p->q8(x, F32, M, l->k, (const int8_t *)l->a, l->b, l->skind, l->n, y, F32, nthreads);
    if (rc || !l->bias) return rc;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < l->n; i++) y[m * l->n + i] += l->bias[i];
    return 0;
}

/* out = x + layer(x). Returns 0, or the code of the kernel that refused (1 a shape, 2 memory). */
int ll_decode(const Plan *p, const Step *s, const void *x, int xkind, void *out, int64_t M, void *k_cache,
              uint16_t *k_scales, int k_kind, void *v_cache, uint16_t *v_scales, int v_kind, int nthreads) {
    const int64_t D = p->head_dim, H = p->heads, KV = p->kv_heads, HD = p->hidden, W = (H + 2 * KV) * D;
    const int64_t I = p->gate_up.n / 2;
    if (M < 1 || D % 2 || (xkind != F32 && xkind != BF16) || k_kind < F32 || k_kind > Q4_0 || k_kind == F16 ||
        v_kind < F32 || v_kind > Q4_0 || v_kind == F16)
        return 1;
    if ((k_kind >= Q8_0 || v_kind >= Q8_0) && D % QBLOCK) return 1; /* blocks run along a head */
    /* scratch: residual, norm, qkv, attention out, gate/up (the largest first use reuses none) */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(M * (2 * HD + W + H * D + 2 * I + I)));
    if (!buf) return 2;
    float *res = buf, *h = res + M * HD, *qkv = h + M * HD, *att = qkv + M * W, *gu = att + M * H * D;
    float *act = gu + M * 2 * I;
    int rc = 0;
    for (int64_t i = 0; i < M * HD; i++) res[i] = load_kind(x, xkind, i);

    /* attention block */
    rms_norm(res, M, HD, p->norm_in, p->eps_in, p->norm_round, xkind, h);
    if ((rc = linear(p, &p->qkv, h, M, qkv, nthreads))) goto done;
    for (int64_t i = 0; i < M * W; i++) qkv[i] = as_kind(qkv[i], xkind); /* a linear's output */
    if (p->qk_norm) /* Qwen3: each q and k head normed over D before the rotation */
        for (int64_t m = 0; m < M; m++)
            for (int64_t hh = 0; hh < H + KV; hh++) {
                float *v = qkv + m * W + hh * D;
                rms_norm(v, 1, D, p->qk_norm + hh * D, p->eps_qk, 1, xkind, v);
            }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t hh = 0; hh < H + KV; hh++) { /* rotate q and k heads: x cos + swap(x) sin */
            float *v = qkv + m * W + hh * D, tmp[1024];
            const int64_t t = (m * (H + KV) + hh) * D;
            if (D > 1024) { rc = 1; goto done; }
            for (int64_t j = 0; j < D; j++) tmp[j] = v[j];
            for (int64_t j = 0; j < D; j++) {
                float r = tmp[j] * load_kind(s->rot_cos, s->rot_kind, t + j) +
                          tmp[(j + D / 2) % D] * load_kind(s->rot_sin, s->rot_kind, t + j);
                v[j] = as_kind(r, xkind); /* the torch path rotates in x's kind */
            }
        }
        const int64_t row = s->slots[m]; /* this token's K and V into the cache */
        write_row(k_cache, k_scales, k_kind, row, KV * D, qkv + m * W + H * D);
        write_row(v_cache, v_scales, v_kind, row, KV * D, qkv + m * W + (H + KV) * D);
        memmove(att + m * H * D, qkv + m * W, sizeof(float) * (size_t)(H * D)); /* q, packed */
    }
    /* att holds q [M, H, D]; the kernel writes the output over qkv (free now) then back */
    if ((rc = p->attend(att, F32, k_cache, k_scales, k_kind, v_cache, v_scales, v_kind, s->table, s->table_i32, s->nb,
                        s->lens, s->lens_i32, M, H, KV, D, s->block_size, NULL, qkv, nthreads, s->min_parallel)))
        goto done;
    if ((rc = linear(p, &p->o, qkv, M, h, nthreads))) goto done;
    for (int64_t i = 0; i < M * HD; i++) res[i] = as_kind(res[i] + as_kind(h[i], xkind), xkind);

    /* MLP block */
    rms_norm(res, M, HD, p->norm_post, p->eps_post, p->norm_round, xkind, h);
    if ((rc = linear(p, &p->gate_up, h, M, gu, nthreads))) goto done;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i++) {
            float g = as_kind(gu[m * 2 * I + i], xkind), u = as_kind(gu[m * 2 * I + I + i], xkind);
            act[m * I + i] = as_kind(as_kind(g / (1.0f + expf(-g)), xkind) * u, xkind);
        }
    if ((rc = linear(p, &p->down, act, M, h, nthreads))) goto done;
    for (int64_t i = 0; i < M * HD; i++) store_kind(out, xkind, i, res[i] + as_kind(h[i], xkind));
done:
    free(buf);
    return rc;
}

/* Every layer of a model's decode step, layer i with plans[i] and its pools: x [M, hidden] is
 * replaced by the last layer's output. One call instead of one per layer (each costs ~20 us of
 * Python and ctypes: 0.6 ms of a 30-layer step). In place: ll_decode reads its input whole before
 * it writes its output. Returns 0, or the first refusing layer's code. */
int ll_decode_layers(const Plan *const *plans, int64_t n, const Step *s, void *x, int xkind, int64_t M,
                     void *const *k_data, uint16_t *const *k_scales, const int *k_kinds, void *const *v_data,
                     uint16_t *const *v_scales, const int *v_kinds, int nthreads) {
    for (int64_t i = 0; i < n; i++) {
        int rc = ll_decode(plans[i], s, x, xkind, x, M, k_data[i], k_scales[i], k_kinds[i], v_data[i], v_scales[i],
                           v_kinds[i], nthreads);
        if (rc) return rc;
    }
    return 0;
}
