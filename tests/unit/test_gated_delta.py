"""workers/layers/gated_delta.py against transformers' Qwen3.5 reference functions
(transformers/models/qwen3_5/modeling_qwen3_5.py): the chunked and the recurrent gated delta
rule, the causal conv1d with its state, the gated RMSNorm. Small shapes, fp32, seeded."""

import pytest
import torch
import torch.nn.functional as F

tf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from workers.layers.gated_delta import (  # noqa: E402
    causal_conv1d_prefill,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    gated_rms_norm,
    l2norm,
    recurrent_gated_delta_step,
)

TOL = dict(atol=1e-5, rtol=1e-5)
DK, DV = 16, 8  # head dims: small for speed, Dk != Dv to catch a swapped axis


def _inputs(T, Hk, Hv, seed, batch=()):
    """Random layer inputs shaped as the layer makes them: g from A_log, a and dt_bias (fp32,
    <= 0, some heads near 0 so the state keeps a long memory), beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, T, Hk, DK, generator=gen)
    k = torch.randn(*batch, T, Hk, DK, generator=gen)
    v = torch.randn(*batch, T, Hv, DV, generator=gen)
    A_log = torch.linspace(-4.0, 1.0, Hv)  # exp(A) from 0.018 (slow decay) to 2.7
    a = torch.randn(*batch, T, Hv, generator=gen)
    dt_bias = torch.randn(Hv, generator=gen)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.randn(*batch, T, Hv, generator=gen).sigmoid()
    return q, k, v, g, beta


def _state(Hv, seed, batch=()):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*batch, Hv, DK, DV, generator=gen)


def _ref_chunk(q, k, v, g, beta, state):
    """transformers' chunked rule on one sequence (adds and drops the batch dim)."""
    out, s = tf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], s[0]


def _ref_recurrent(q, k, v, g, beta, state):
    out, s = tf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], s[0]


def test_l2norm_matches_transformers():
    x = torch.randn(5, 3, DK, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 0.0  # eps keeps a zero vector finite
    torch.testing.assert_close(l2norm(x), tf.l2norm(x, dim=-1, eps=1e-6), atol=0, rtol=0)
    assert torch.isfinite(l2norm(x)).all()


@pytest.mark.parametrize("Hk,Hv", [(2, 4), (3, 3)])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 200])
@pytest.mark.parametrize("fresh", [True, False])
def test_chunk_matches_transformers(T, Hk, Hv, fresh):
    q, k, v, g, beta = _inputs(T, Hk, Hv, seed=T)
    state = torch.zeros(Hv, DK, DV) if fresh else _state(Hv, seed=T + 1)
    out, new_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (T, Hv, DV) and out.dtype == torch.float32
    assert new_state.shape == (Hv, DK, DV) and new_state.dtype == torch.float32

    ref_out, ref_state = _ref_chunk(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)
    # and the token-by-token definition
    rec_out, rec_state = _ref_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, rec_out, **TOL)
    torch.testing.assert_close(new_state, rec_state, **TOL)
    # the input state is left alone
    if not fresh:
        torch.testing.assert_close(state, _state(Hv, seed=T + 1), atol=0, rtol=0)


def test_chunk_is_sensitive_to_the_state_and_the_head_mapping():
    """Guards the comparisons above against passing vacuously: a wrong initial state, or
    `repeat` instead of `repeat_interleave` for the key heads, changes the output."""
    T, Hk, Hv = 20, 2, 4
    q, k, v, g, beta = _inputs(T, Hk, Hv, seed=3)
    state = _state(Hv, seed=4)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, state)
    fresh, _ = chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(state))
    assert (out - fresh).abs().max() > 1e-2
    tiled, _ = _ref_chunk(q.repeat(1, 2, 1), k.repeat(1, 2, 1), v, g, beta, state)
    assert (out - tiled).abs().max() > 1e-2


def test_chunk_size_does_not_change_the_result():
    q, k, v, g, beta = _inputs(100, 2, 4, seed=5)
    state = _state(4, seed=6)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    for C in (1, 16, 33, 128):
        out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=C)
        torch.testing.assert_close(out_c, out, **TOL)
        torch.testing.assert_close(s_c, s, **TOL)


@pytest.mark.parametrize("piece", [1, 7, 64])
def test_chunked_prefill_in_pieces_equals_one_pass(piece):
    """The engine feeds a long prompt in pieces, carrying the state: same outputs, same state."""
    T, Hk, Hv = 150, 2, 4
    q, k, v, g, beta = _inputs(T, Hk, Hv, seed=7)
    state = _state(Hv, seed=8)
    whole_out, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, state)

    outs, s = [], state
    for i in range(0, T, piece):
        sl = slice(i, i + piece)
        o, s = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_out, **TOL)
    torch.testing.assert_close(s, whole_state, **TOL)


def test_chunk_accepts_a_batch_dim():
    B, T, Hk, Hv = 3, 70, 2, 4
    q, k, v, g, beta = _inputs(T, Hk, Hv, seed=9, batch=(B,))
    state = _state(Hv, seed=10, batch=(B,))
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (B, T, Hv, DV) and s.shape == (B, Hv, DK, DV)
    for b in range(B):
        ref_out, ref_s = _ref_chunk(q[b], k[b], v[b], g[b], beta[b], state[b])
        torch.testing.assert_close(out[b], ref_out, **TOL)
        torch.testing.assert_close(s[b], ref_s, **TOL)


def test_chunk_keeps_v_dtype_and_fp32_state():
    q, k, v, g, beta = _inputs(40, 2, 4, seed=11)
    state = _state(4, seed=12)
    out, s = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
    ref_out, ref_s = _ref_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s, ref_s, **TOL)  # same bf16 inputs, fp32 math


@pytest.mark.parametrize("Hk,Hv", [(2, 4), (3, 3)])
def test_recurrent_step_batched_matches_transformers(Hk, Hv):
    B, steps = 5, 3
    q, k, v, g, beta = _inputs(steps, Hk, Hv, seed=13, batch=(B,))  # [B, steps, H, D]
    state = _state(Hv, seed=14, batch=(B,))
    s = state
    outs = []
    for t in range(steps):  # decode: one token of every sequence per call
        o, s = recurrent_gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        assert o.shape == (B, Hv, DV) and s.shape == (B, Hv, DK, DV) and s.dtype == torch.float32
        outs.append(o)
    out = torch.stack(outs, dim=1)  # [B, steps, Hv, DV]
    for b in range(B):
        ref_out, ref_s = _ref_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b])
        torch.testing.assert_close(out[b], ref_out, **TOL)
        torch.testing.assert_close(s[b], ref_s, **TOL)
    torch.testing.assert_close(state, _state(Hv, seed=14, batch=(B,)), atol=0, rtol=0)  # untouched
    # the sequences are independent: another row's state does not leak in
    o0, _ = recurrent_gated_delta_step(q[:1, 0], k[:1, 0], v[:1, 0], g[:1, 0], beta[:1, 0], state[:1])
    torch.testing.assert_close(o0, outs[0][:1], **TOL)


def test_chunk_of_one_token_equals_recurrent_step():
    Hk, Hv = 2, 4
    q, k, v, g, beta = _inputs(1, Hk, Hv, seed=15)
    state = _state(Hv, seed=16)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    step_out, step_s = recurrent_gated_delta_step(q, k, v, g, beta, state[None])
    torch.testing.assert_close(out, step_out, **TOL)
    torch.testing.assert_close(s, step_s[0], **TOL)


# -- causal conv1d ---------------------------------------------------------------------------

C_CH, K = 12, 4


def _conv_inputs(T, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, C_CH, generator=gen), torch.randn(C_CH, K, generator=gen)


@pytest.mark.parametrize("T", [1, 2, 3, 10])
def test_conv_prefill_fresh_matches_transformers(T):
    x, w = _conv_inputs(T, seed=T)
    out, state = causal_conv1d_prefill(x, w, torch.zeros(C_CH, K - 1))
    ref = tf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # the state: the last K-1 inputs, zeros in front when T < K-1
    expect = torch.cat([torch.zeros(C_CH, K - 1), x.t()], dim=-1)[:, -(K - 1) :]
    torch.testing.assert_close(state, expect, atol=0, rtol=0)


@pytest.mark.parametrize("pieces", [[1] * 9, [2, 2, 2, 2, 1], [5, 4], [1, 2, 5, 1]])
def test_conv_prefill_chained_matches_transformers(pieces):
    T = sum(pieces)
    x, w = _conv_inputs(T, seed=20 + len(pieces))
    gen = torch.Generator().manual_seed(21)
    state0 = torch.randn(C_CH, K - 1, generator=gen)  # a sequence already under way
    outs, state = [], state0
    ref_state = state0[None].clone()  # transformers' update writes its state in place
    start = 0
    for n in pieces:
        piece = x[start : start + n]
        start += n
        o, state = causal_conv1d_prefill(piece, w, state)
        ref = tf.causal_conv1d_update(piece.t()[None], ref_state, w, None, activation="silu")[0].t()
        torch.testing.assert_close(o, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, ref_state[0], atol=0, rtol=0)
        outs.append(o)
    # and the whole sequence in one call, from the same state
    whole, whole_state = causal_conv1d_prefill(x, w, state0)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, whole_state, atol=0, rtol=0)
    # the state matters (guards against a comparison that cannot fail)
    fresh, _ = causal_conv1d_prefill(x, w, torch.zeros_like(state0))
    assert (fresh[: K - 1] - whole[: K - 1]).abs().max() > 1e-3


def test_conv_step_batched_matches_transformers_and_prefill():
    B, steps = 4, 6
    gen = torch.Generator().manual_seed(30)
    x = torch.randn(B, steps, C_CH, generator=gen)
    w = torch.randn(C_CH, K, generator=gen)
    state0 = torch.randn(B, C_CH, K - 1, generator=gen)
    state, ref_state = state0, state0.clone()
    outs = []
    for t in range(steps):
        o, state = causal_conv1d_step(x[:, t], w, state)
        assert o.shape == (B, C_CH) and state.shape == (B, C_CH, K - 1)
        ref = tf.causal_conv1d_update(x[:, t, :, None], ref_state, w, None, activation="silu")[..., 0]
        torch.testing.assert_close(o, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, ref_state, atol=0, rtol=0)
        outs.append(o)
    # per sequence, decode steps equal one prefill over the same tokens
    for b in range(B):
        pre, pre_state = causal_conv1d_prefill(x[b], w, state0[b])
        torch.testing.assert_close(torch.stack(outs, 1)[b], pre, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[b], pre_state, atol=0, rtol=0)


def test_conv_state_keeps_the_input_dtype():
    x, w = _conv_inputs(5, seed=40)
    out, state = causal_conv1d_prefill(x.bfloat16(), w.bfloat16(), torch.zeros(C_CH, K - 1))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    ref = tf.causal_conv1d_fn(x.bfloat16().t()[None], w.bfloat16(), None, activation="silu")[0].t()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    o, s = causal_conv1d_step(x[:2].bfloat16(), w.bfloat16(), torch.zeros(2, C_CH, K - 1))
    assert o.dtype == torch.bfloat16 and s.dtype == torch.bfloat16


# -- gated RMSNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(50)
    x = torch.randn(6, DV, generator=gen).to(dtype)
    z = torch.randn(6, DV, generator=gen).to(dtype)
    ref_mod = tf.Qwen3_5RMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.randn(DV, generator=gen))
        ref = ref_mod(x, z)
    out = gated_rms_norm(x, z, ref_mod.weight.detach(), 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert (out - gated_rms_norm(x, torch.zeros_like(z), ref_mod.weight.detach(), 1e-6)).abs().max() > 1e-2
