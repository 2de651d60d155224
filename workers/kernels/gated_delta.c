/* One decode step of the gated delta rule (Qwen3.5's linear-attention layers), each recurrent
 * state updated in place in two passes over it (see workers/layers/gated_delta.py for the math):
 *
 *   pass 1 (read):  u = k^T S, p = q^T S                  (both from the old state)
 *                   u, p *= exp(g)                        (the gate, applied to the reads)
 *                   delta = beta * (v - u)                 (the delta-rule write)
 *                   out = p + (q . k) * delta              (q^T of the new state, no third pass)
 *   pass 2 (write): S = exp(g) * S + k delta^T             (decay and rank-1 write at once)
 *
 * torch's ops (mul_, a batched matmul, baddbmm_) go over the state three times for reads and
 * twice for writes; here one head's state (Dk x Dv fp32: 64 KiB at 128 x 128) is read once from
 * memory and read again from the cache by pass 2, written once. No dtype round trip: all fp32.
 *
 * Layouts (contiguous, row-major, fp32):
 *   q, k   [B, H, Dk]   L2-normalised (q also scaled), one head per value head (the caller's)
 *   v      [B, H, Dv]
 *   g, beta [B, H]      log decay (<= 0) and write strength
 *   pool   [S, H, Dk, Dv]  the slots' states; sequence b's is slot slots[b] (slots NULL:
 *                       slot b), updated in place
 *   out    [B, H, Dv]
 * Each (sequence, head) is independent: OpenMP over them; each one's sums run in a fixed order
 * (over Dk, the rows of its state), so the result does not depend on the thread count.
 *
 * Built by workers/kernels/build.py and called through ctypes by workers/kernels/gdn_step.py.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "convert.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* No a * b + c contracted into one rounding: where the compiler fuses is its choice per ISA and
 * vector width, and the values must be one on every build (tests/unit/test_gdn_kernel.py holds
 * the AVX2, AVX-512 and plain C builds to the same bits) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define MAX_DV 1024 /* the stack buffers' length; the caller checks Dv against gd_max_dv() */

int gd_max_dv(void) { return MAX_DV; }

#define JB 64 /* state columns a pass takes at once: their sums stay in registers down the rows */

/* pass 1 (read): u = k^T S, p = q^T S, each column's sum over the rows i in order */
static void head_read(const float *S, const float *k, const float *q, float *u, float *p, int64_t Dk, int64_t Dv) {
    int64_t j0 = 0;
    for (; j0 + JB <= Dv; j0 += JB) {
        float ub[JB], pb[JB];
        for (int j = 0; j < JB; j++) ub[j] = pb[j] = 0.0f;
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i], qi = q[i], *row = S + i * Dv + j0;
#pragma omp simd
            for (int j = 0; j < JB; j++) {
                ub[j] += ki * row[j];
                pb[j] += qi * row[j];
            }
        }
        for (int j = 0; j < JB; j++) u[j0 + j] = ub[j], p[j0 + j] = pb[j];
    }
    if (j0 < Dv) {
        for (int64_t j = j0; j < Dv; j++) u[j] = p[j] = 0.0f;
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i], qi = q[i], *row = S + i * Dv;
            for (int64_t j = j0; j < Dv; j++) {
                u[j] += ki * row[j];
                p[j] += qi * row[j];
            }
        }
    }
}

/* pass 2 (write): S = e S + k delta^T in place; with k2 (not NULL) also the next row's pass 1 on
 * the new state as it is written (u2 = k2^T S, p2 = q2^T S): one pass over the state a row of a
 * run, the same sums as a separate read */
static void head_write(float *S, float e, const float *k, const float *delta, const float *k2, const float *q2,
                       float *u2, float *p2, int64_t Dk, int64_t Dv) {
    int64_t j0 = 0;
    for (; j0 + JB <= Dv; j0 += JB) {
        float ub[JB], pb[JB], db[JB];
        for (int j = 0; j < JB; j++) ub[j] = pb[j] = 0.0f, db[j] = delta[j0 + j];
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i];
            float *row = S + i * Dv + j0;
#pragma omp simd
            for (int j = 0; j < JB; j++) row[j] = e * row[j] + ki * db[j];
            if (k2) {
                const float ki2 = k2[i], qi2 = q2[i];
#pragma omp simd
                for (int j = 0; j < JB; j++) {
                    ub[j] += ki2 * row[j];
                    pb[j] += qi2 * row[j];
                }
            }
        }
        if (k2)
            for (int j = 0; j < JB; j++) u2[j0 + j] = ub[j], p2[j0 + j] = pb[j];
    }
    if (j0 < Dv) {
        for (int64_t i = 0; i < Dk; i++) {
            const float ki = k[i];
            float *row = S + i * Dv;
            for (int64_t j = j0; j < Dv; j++) row[j] = e * row[j] + ki * delta[j];
        }
        if (k2) { /* the tail's columns read after its writes: the same sums */
            for (int64_t j = j0; j < Dv; j++) u2[j] = p2[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++)
                for (int64_t j = j0; j < Dv; j++) {
                    u2[j] += k2[i] * S[i * Dv + j];
                    p2[j] += q2[i] * S[i * Dv + j];
                }
        }
    }
}

/* between the passes: delta = beta (v - e u), the row's output e p + (q . k) delta (q^T of the
 * new state, no third pass) */
static void head_delta(const float *q, const float *k, const float *v, const float *u, const float *p, float e,
                       float beta, float *delta, float *out, int64_t Dk, int64_t Dv) {
    float qk = 0.0f;
    for (int64_t i = 0; i < Dk; i++) qk += q[i] * k[i];
#pragma omp simd
    for (int64_t j = 0; j < Dv; j++) {
        delta[j] = beta * (v[j] - e * u[j]);
        out[j] = e * p[j] + qk * delta[j];
    }
}

static void head_step(const float *q, const float *k, const float *v, float g, float beta, float *S, float *out,
                      int64_t Dk, int64_t Dv) {
    float u[MAX_DV], p[MAX_DV], delta[MAX_DV];
    head_read(S, k, q, u, p, Dk, Dv);
    const float e = expf(g);
    head_delta(q, k, v, u, p, e, beta, delta, out, Dk, Dv);
    head_write(S, e, k, delta, NULL, NULL, NULL, NULL, Dk, Dv);
}

/* 0 on success, 1 on bad sizes */
int gd_step(const float *q, const float *k, const float *v, const float *g, const float *beta, float *pool,
            const int64_t *slots, float *out, int64_t B, int64_t H, int64_t Dk, int64_t Dv, int nthreads) {
    if (B < 0 || H < 1 || Dk < 1 || Dv < 1 || Dv > MAX_DV) return 1;
    const int64_t n = B * H, per = Dk * Dv;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (n < nt) nt = (int)(n > 0 ? n : 1);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t bh = 0; bh < n; bh++) {
        const int64_t b = bh / H, h = bh % H, slot = slots ? slots[b] : b;
        head_step(q + bh * Dk, k + bh * Dk, v + bh * Dv, g[bh], beta[bh], pool + (slot * H + h) * per,
                  out + bh * Dv, Dk, Dv);
    }
    return 0;
}

/* ---------------------------------------------------------------- the whole decode step
 *
 * gd_decode: everything a Qwen3.5 linear-attention layer does to B decode rows between its two
 * linears, in one call (gd_runs: the same for runs of rows, each a sequence's consecutive tokens,
 * a prefill chunk's among them, every row as a decode step of its own; a chunk's rows cost their
 * arithmetic on a state that stays in the core's cache, where the chunked rule's torch ops pass
 * over the states several times: 16 against 32 us a token on Qwen3.5-0.8B's layer shapes, 2
 * threads, and 9-token chunks 17 against ~70): the causal conv1d step and its SiLU (the conv state shifted in place),
 * q and k L2-normalised (q scaled by Dk^-0.5; key head h / (Hv / Hk) serves value head h), the
 * decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), head_step above, and the
 * output's RMSNorm gated by silu(z). In torch that is ~70 ops a layer, each a few microseconds
 * of dispatch at one row: more than the arithmetic (bench/step_ops.py --times).
 *
 * Numbers follow the torch path's roundings (workers/models/qwen3_5.py, GatedDeltaNet.forward
 * with workers/layers/gated_delta.py): values the torch path holds in the model's dtype (xkind:
 * F32 or BF16) are rounded to it where it rounds them (the conv's products and sum in the
 * weight's dtype, its output, the step's output, the norm's x-hat and its weight product, the
 * gated output); everything else is fp32.
 *
 * Layouts (contiguous, row-major):
 *   proj   [N, P]      xkind: the in_proj rows (N = B for gd_decode), P = C + Hv*Dv + 2*Hv (q k v | z | b | a)
 *   convw  [C, Kc]     wkind         conv  [S, C, Kc-1]  xkind, slot slots[b], shifted in place
 *   A_log, dt_bias [Hv] akind        normw [Dv]  nkind
 *   ssm    [S, Hv, Dk, Dv] fp32, updated in place       out [N, Hv*Dv] xkind
 *   runs   [B, 3] int64 (gd_runs): sequence b's first row, rows, and whether it starts fresh
 * Work for each (sequence, block of conv channels), then for each (sequence, value head), over
 * OpenMP; the sums run in a fixed order, so the result does not depend on the thread count.
 */

enum { GD_F32 = 0, GD_BF16 = 1 };

static inline float gd_load(const void *p, int kind, int64_t i) {
    return kind == GD_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float gd_round(float f, int kind) { /* to bf16 (convert.h: nearest even), or as is */
    return kind == GD_BF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static inline void gd_store(void *p, int kind, int64_t i, float f) {
    if (kind == GD_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* e^x in plain float arithmetic the compiler vectorizes (libm's expf is a call per value:
 * ~10 ns, where the ~250 k SiLUs of a batch-8 step's conv and norms are a few ms): x = n ln2 + r,
 * |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r (within 2 ulp of expf), 2^n from its
 * exponent bits. Plain operations, each rounded (no contraction, above): one value on every build */
static inline float gd_exp(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* nearest integer */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two;
    two.i = ((int32_t)n + 127) << 23;
    return p * two.f;
}

static inline float gd_silu(float x) { return x / (1.0f + gd_exp(-x)); }

/* xs[0 .. n) = silu(xs), each rounded to kind after (as torch's silu of a tensor of that kind) */
static void gd_silu_rows(float *xs, int64_t n, int kind) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) xs[i] = gd_silu(xs[i]);
    if (kind == GD_BF16)
        for (int64_t i = 0; i < n; i++) xs[i] = gd_round(xs[i], kind);
}

#define GD_MAX_K 16 /* conv taps */

/* Rows of proj / out: run b's are [first, first + rows), consecutive tokens of sequence b, taken
 * in order from its slot's states (zeros first when fresh). runs NULL: one row each (decode). */
#define RUN_FIRST(b) (runs ? runs[3 * (b)] : (b))
#define RUN_ROWS(b) (runs ? runs[3 * (b) + 1] : 1)
#define RUN_FRESH(b) (runs ? runs[3 * (b) + 2] : 0)

static int gd_layer(const void *proj, const void *convw, void *conv, const void *A_log, const void *dt_bias,
                    const void *normw, float *ssm, const int64_t *slots, const int64_t *runs, void *out, int xkind,
                    int wkind, int akind, int nkind, int64_t B, int64_t C, int64_t Kc, int64_t Hk, int64_t Hv,
                    int64_t Dk, int64_t Dv, float eps, int nthreads) {
    if (B < 0 || Hk < 1 || Hv < 1 || Hv % Hk || Dk < 1 || Dk > MAX_DV || Dv < 1 || Dv > MAX_DV || Kc < 2 ||
        Kc > GD_MAX_K || C != 2 * Hk * Dk + Hv * Dv)
        return 1;
    if (B == 0) return 0;
    int64_t R = 0; /* rows of proj and out */
    for (int64_t b = 0; b < B; b++) {
        if (RUN_FIRST(b) < 0 || RUN_ROWS(b) < 0) return 1;
        if (RUN_FIRST(b) + RUN_ROWS(b) > R) R = RUN_FIRST(b) + RUN_ROWS(b);
    }
    const int64_t P = C + Hv * Dv + 2 * Hv, Ks = Kc - 1, rep = Hv / Hk;
    float *mixed = (float *)malloc(sizeof(float) * (size_t)(R * C + Kc * C)); /* the conv's outputs, fp32 */
    int64_t *run_of = (int64_t *)malloc(sizeof(int64_t) * (size_t)R); /* each row's run, or -1 */
    if (!mixed || !run_of) {
        free(mixed);
        free(run_of);
        return 2;
    }
    float *wt = mixed + R * C; /* the conv's taps [Kc, C], fp32 (values of wkind), made below */
    for (int64_t r = 0; r < R; r++) run_of[r] = -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = RUN_FIRST(b); r < RUN_FIRST(b) + RUN_ROWS(b); r++) run_of[r] = b;
    int nt = nthreads < 1 ? 1 : nthreads;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* the taps transposed, channels contiguous (shared among the threads: a decode step's
         * one row made them serially in ~10 us a layer) */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < Kc; j++) wt[j * C + c] = gd_load(convw, wkind, c * Kc + j);
        /* the conv: output (row, channel c) is its K-tap dot product over the K inputs ending
         * at that row (the run's earlier rows, or the slot's state before its first), then
         * SiLU, each output's taps added in order. Rows are independent (they read inputs
         * only): work items are rows, each one's channels in vectorized loops over contiguous
         * memory (the in_proj row as it lies). */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const int64_t b = run_of[r];
            if (b < 0) continue;
            const int64_t i = r - RUN_FIRST(b), at = slots[b] * C * Ks, fresh = RUN_FRESH(b);
            float *m = mixed + r * C;
            for (int64_t c = 0; c < C; c++) m[c] = 0.0f;
            for (int64_t j = 0; j < Kc; j++) {
                const int64_t src = i - Ks + j; /* the run's row of tap j; < 0: the state's */
                const float *w = wt + j * C;
                if (src >= 0) {
                    const int64_t base = (RUN_FIRST(b) + src) * P;
#pragma omp simd
                    for (int64_t c = 0; c < C; c++)
                        m[c] += gd_round(gd_round(gd_load(proj, xkind, base + c), wkind) * w[c], wkind);
                } else if (!fresh) { /* (a fresh run's state is zeros: its products add zero) */
#pragma omp simd
                    for (int64_t c = 0; c < C; c++)
                        m[c] += gd_round(gd_round(gd_load(conv, xkind, at + c * Ks + Ks + src), wkind) * w[c], wkind);
                } else
                    for (int64_t c = 0; c < C; c++) m[c] += gd_round(0.0f * w[c], wkind);
            }
            for (int64_t c = 0; c < C; c++) m[c] = gd_round(m[c], wkind);
            gd_silu_rows(m, C, wkind);
            if (xkind != wkind)
                for (int64_t c = 0; c < C; c++) m[c] = gd_round(m[c], xkind);
        }
        /* each run's new conv state, once every row has read the old: its last K-1 inputs (the
         * old state's last ones shifted down first when the run has fewer rows) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const int64_t nr = RUN_ROWS(b), at = slots[b] * C * Ks;
            for (int64_t c = 0; c < C; c++)
                for (int64_t j = 0; j < Ks; j++) {
                    const int64_t src = nr - Ks + j;
                    const float x = src >= 0 ? gd_load(proj, xkind, (RUN_FIRST(b) + src) * P + c)
                                    : RUN_FRESH(b) ? 0.0f
                                                   : gd_load(conv, xkind, at + c * Ks + Ks + src);
                    gd_store(conv, xkind, at + c * Ks + j, x);
                }
        }
        /* the heads: (run, value head) items, each taking its run's rows in order on its state
         * (64 KiB at 128 x 128: it stays in the core's cache from one row to the next) */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * Hv; bh++) {
            const int64_t b = bh / Hv, h = bh % Hv, hk = h / rep;
            float *S = ssm + (slots[b] * Hv + h) * Dk * Dv;
            if (RUN_FRESH(b))
                for (int64_t i = 0; i < Dk * Dv; i++) S[i] = 0.0f;
            const float scale = 1.0f / sqrtf((float)Dk);
            const float dtb = gd_load(dt_bias, akind, h), A = expf(gd_load(A_log, akind, h));
            /* row r's q, k (L2-normalised, q scaled), v, log decay and write strength */
#define PREP(r, q, k, v, g, beta)                                                                   \
    do {                                                                                           \
        const float *row_ = mixed + (r) * C, *q0_ = row_ + hk * Dk, *k0_ = row_ + Hk * Dk + hk * Dk; \
        float sq_ = 0.0f, sk_ = 0.0f;                                                              \
        for (int64_t i = 0; i < Dk; i++) {                                                         \
            sq_ += q0_[i] * q0_[i];                                                                \
            sk_ += k0_[i] * k0_[i];                                                                \
        }                                                                                          \
        const float rq_ = 1.0f / sqrtf(sq_ + 1e-6f), rk_ = 1.0f / sqrtf(sk_ + 1e-6f);              \
        for (int64_t i = 0; i < Dk; i++) {                                                         \
            (q)[i] = q0_[i] * rq_ * scale;                                                         \
            (k)[i] = k0_[i] * rk_;                                                                 \
        }                                                                                          \
        v = row_ + 2 * Hk * Dk + h * Dv;                                                           \
        const float bb_ = gd_load(proj, xkind, (r) * P + C + Hv * Dv + h);                         \
        const float a_ = gd_load(proj, xkind, (r) * P + C + Hv * Dv + Hv + h) + dtb;               \
        g = -A * (a_ > 20.0f ? a_ : log1pf(expf(a_)));                                             \
        beta = 1.0f / (1.0f + expf(-bb_));                                                         \
    } while (0)
            float qa[MAX_DV], ka[MAX_DV], qb[MAX_DV], kb[MAX_DV], ua[MAX_DV], pa[MAX_DV], ub[MAX_DV], pb[MAX_DV];
            float *q = qa, *k = ka, *q2 = qb, *k2 = kb, *u = ua, *p = pa, *u2 = ub, *p2 = pb, *tmp;
            float delta[MAX_DV], o[MAX_DV], g = 0.0f, beta = 0.0f, g2, beta2;
            const float *v = NULL, *v2;
            const int64_t r1 = RUN_FIRST(b) + RUN_ROWS(b);
            if (RUN_ROWS(b) > 0) {
                PREP(RUN_FIRST(b), q, k, v, g, beta);
                head_read(S, k, q, u, p, Dk, Dv);
            }
            for (int64_t r = RUN_FIRST(b); r < r1; r++) {
                /* the row as head_step takes it, its write fused with the next row's read */
                const float e = expf(g);
                head_delta(q, k, v, u, p, e, beta, delta, o, Dk, Dv);
                if (r + 1 < r1) {
                    PREP(r + 1, q2, k2, v2, g2, beta2);
                    head_write(S, e, k, delta, k2, q2, u2, p2, Dk, Dv);
                    tmp = q, q = q2, q2 = tmp;
                    tmp = k, k = k2, k2 = tmp;
                    tmp = u, u = u2, u2 = tmp;
                    tmp = p, p = p2, p2 = tmp;
                    v = v2, g = g2, beta = beta2;
                } else
                    head_write(S, e, k, delta, NULL, NULL, NULL, NULL, Dk, Dv);
                /* the gated RMSNorm of the step's output (rounded to the model's dtype first) */
                float ss = 0.0f;
                for (int64_t j = 0; j < Dv; j++) {
                    o[j] = gd_round(o[j], xkind);
                    ss += o[j] * o[j];
                }
                const float rn = 1.0f / sqrtf(ss / (float)Dv + eps);
                float gate[MAX_DV]; /* silu(z), fp32 */
                for (int64_t j = 0; j < Dv; j++) gate[j] = gd_load(proj, xkind, r * P + C + h * Dv + j);
                gd_silu_rows(gate, Dv, GD_F32);
                for (int64_t j = 0; j < Dv; j++) {
                    const float hj = gd_round(gd_load(normw, nkind, j) * gd_round(o[j] * rn, xkind), xkind);
                    gd_store(out, xkind, r * Hv * Dv + h * Dv + j, hj * gate[j]);
                }
            }
        }
    }
    free(mixed);
    free(run_of);
    return 0;
}

/* B decode rows, row b of sequence b: 0 on success, 1 on bad sizes, 2 out of memory */
int gd_decode(const void *proj, const void *convw, void *conv, const void *A_log, const void *dt_bias,
              const void *normw, float *ssm, const int64_t *slots, void *out, int xkind, int wkind, int akind,
              int nkind, int64_t B, int64_t C, int64_t Kc, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
              float eps, int nthreads) {
    return gd_layer(proj, convw, conv, A_log, dt_bias, normw, ssm, slots, NULL, out, xkind, wkind, akind, nkind, B,
                    C, Kc, Hk, Hv, Dk, Dv, eps, nthreads);
}

/* B runs of rows (runs [B, 3]: first row, rows, fresh), each a sequence's consecutive tokens
 * (a prefill chunk, or one decode row), every row as a decode step of its own: a chunk's
 * result is the token-by-token decode's to the bit, however the prompt is chunked or batched */
int gd_runs(const void *proj, const void *convw, void *conv, const void *A_log, const void *dt_bias,
            const void *normw, float *ssm, const int64_t *slots, const int64_t *runs, void *out, int xkind,
            int wkind, int akind, int nkind, int64_t B, int64_t C, int64_t Kc, int64_t Hk, int64_t Hv, int64_t Dk,
            int64_t Dv, float eps, int nthreads) {
    if (!runs) return 1;
    return gd_layer(proj, convw, conv, A_log, dt_bias, normw, ssm, slots, runs, out, xkind, wkind, akind, nkind, B,
                    C, Kc, Hk, Hv, Dk, Dv, eps, nthreads);
}
