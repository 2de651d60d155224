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

#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_DV 1024 /* the stack buffers' length; the caller checks Dv against gd_max_dv() */

int gd_max_dv(void) { return MAX_DV; }

static void head_step(const float *q, const float *k, const float *v, float g, float beta, float *S, float *out,
                      int64_t Dk, int64_t Dv) {
    float u[MAX_DV], p[MAX_DV], delta[MAX_DV];
    for (int64_t j = 0; j < Dv; j++) u[j] = p[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) { /* pass 1: both reads of the old state, row by row */
        const float ki = k[i], qi = q[i], *row = S + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) {
            u[j] += ki * row[j];
            p[j] += qi * row[j];
        }
    }
    const float e = expf(g);
    float qk = 0.0f;
    for (int64_t i = 0; i < Dk; i++) qk += q[i] * k[i];
#pragma omp simd
    for (int64_t j = 0; j < Dv; j++) {
        delta[j] = beta * (v[j] - e * u[j]);
        out[j] = e * p[j] + qk * delta[j];
    }
    for (int64_t i = 0; i < Dk; i++) { /* pass 2: decay and rank-1 write, in place */
        const float ki = k[i];
        float *row = S + i * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) row[j] = e * row[j] + ki * delta[j];
    }
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
