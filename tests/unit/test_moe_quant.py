"""A mixture of experts' routed experts on the int8 / int4 CPU paths (``workers/quant.py``'s
``QuantExperts``, ``MoE.quantize``) and gpt-oss's MXFP4 experts (``workers/mxfp4.py``).

The stacks against the dense linears' own layouts (the same levels, the same kernels), the block's
output against the fp32 reference within each path's tolerance, a step reading only the experts its
tokens chose (the others' scales poisoned with NaN), a token's output the same whatever shares its
step, the bytes a step reads (``Engine.step_read_bytes``) and sizing's count of the quantized
experts, the int4 grid fitted to FP4's levels against the min/max one (the former MXFP4 holding,
bench/mxfp4_experts.py's baseline), engines on the paths (qwen3_moe on int8 and int4) against the
fp32 engine's logits; gpt-oss's MXFP4 experts held as they ship, exact against their dequantized
products, and sized so.
"""

from __future__ import annotations

import pytest
import torch

from makemodel.families.gpt_oss import _mxfp4_quantize
from pantheon.core.protocol import SamplingParams
from pantheon.core.sizing import estimate
from workers.cpu_paths import probe
from workers.engine import Engine
from workers.layers.moe import MoE, Router, experts_forward, route
from workers.mxfp4 import MxExperts, dequantize, from_hub, int4_from_fp4
from workers.quant import Int4Linear, Int8Linear, QuantExperts, int4_groups

LAYOUTS = ("int8", "int4")
# relative error of the block's output against fp32 (random weights): int8 rows lose ~1%, int4
# groups ~8% (each path's probe allows 8x bf16's 3e-2)
TOLERANCE = {"int8": 0.03, "int4": 0.15}


def _needs(layout: str) -> None:
    if why := probe(layout):
        pytest.skip(f"the {layout} path does not run here: {why}")


def _experts(e=8, h=64, i=32, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_stacks_hold_the_linears_levels(layout, monkeypatch):
    """Each expert quantized as the path's dense linear would be on torch's kernels: the same
    bytes, the same output, with our kernel switched off (``workers/kernels/qlinear.py``; with it
    on both hold its layout: ``test_a_layers_experts_run_in_one_kernel_call``)."""
    _needs(layout)
    monkeypatch.setenv("PANTHEON_LINEAR_KERNEL", "0")
    w = (torch.randn(3, 48, 64) * 0.1).bfloat16()
    q = QuantExperts(w, layout)
    x = torch.randn(5, 64).bfloat16()
    for e in range(3):
        lin = Int4Linear(w[e], None) if layout == "int4" else Int8Linear(w[e], None)
        assert torch.equal(q.weight[e], lin.weight)
        assert torch.equal(q.scales[e], lin.scales_zeros if layout == "int4" else lin.scale)
        assert torch.equal(q[e](x), lin(x))
    assert q.expert_bytes() == (48 * 32 + 2 * 48 * 2 * 2 if layout == "int4" else 48 * 64 + 48 * 2)


@pytest.mark.parametrize("k", [24, 40, 64])
def test_int8_experts_of_any_width_sum_right(k):
    """torch's int8 kernel takes K in 16s only (others sum wrongly): those widen the rows."""
    w = (torch.randn(2, 16, k) * 0.1).bfloat16()
    q = QuantExperts(w, "int8")
    x = torch.randn(3, k).bfloat16()
    want = x.float() @ (q.weight[1].float() * q.scales[1].float()[:, None]).t()
    assert torch.allclose(q[1](x).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_expert_put_a_run_of_rows_at_a_time_gets_its_whole_matrixs_levels(layout):
    """``put`` of an expert's rows in runs (a checkpoint's gate, then its up) gives the stack the
    same bytes as the whole matrix at once: int8 rows are per row, int4 groups per 32 values of
    a row (an on-grid run keeps its levels: the weights here are a 4-bit grid's, as a Q4 file's)."""
    _needs(layout)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 64, 96, generator=g) * 0.1
    grid = (torch.randint(0, 16, w.shape, generator=g) - 8) * 0.01 + 0.002  # levels on one grid
    for weights in (w, grid):
        whole = QuantExperts(weights, layout)
        runs = QuantExperts(weights, layout, fill=False)
        assert runs.takes_rows
        for e in (2, 0, 1):  # in any order
            runs.put(e, 32, weights[e, 32:])
            runs.put(e, 0, weights[e, :32])
        assert torch.equal(runs.weight, whole.weight) and torch.equal(runs.scales, whole.scales)


def test_torchs_int4_packing_takes_whole_matrices_and_a_moe_then_loads_as_before(monkeypatch):
    """With our kernel off the int4 stacks are torch's packing, which takes an expert's whole
    matrix only: a run of rows is refused, and ``MoE.receive`` declines (the stacks are then
    filled in the load's dtype and quantized once loaded, as without it), changing nothing."""
    _needs("int4")
    monkeypatch.setenv("PANTHEON_LINEAR_KERNEL", "0")
    w = (torch.randn(2, 48, 64) * 0.1).bfloat16()
    q = QuantExperts(w, "int4", fill=False)
    assert q.int4 and not q.takes_rows
    with pytest.raises(ValueError, match="whole matrix"):
        q.put(0, 0, w[0, :16])
    q.put(0, 0, w[0])
    assert torch.equal(q.weight[0], QuantExperts(w, "int4").weight[0])
    moe = MoE(64, 24, 4, 2)
    assert moe.receive("int4") is None
    assert moe.receiving is None and moe.gate_up.shape == (4, 48, 64) and moe.laid_out is None


def test_int4_keeps_a_shape_its_kernel_does_not_take_in_int8_rows():
    _needs("int4")
    q = QuantExperts(torch.randn(2, 24, 64).bfloat16(), "int4")  # 24 rows: not in 16s
    assert not q.int4 and q.weight.dtype == torch.int8 and q.expert_bytes() == 24 * 64 + 24 * 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_quantized_experts_stay_close_to_fp32(layout, tokens):
    _needs(layout)
    gate_up, down = _experts()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    weights, ids = route(torch.randn(tokens, 8, generator=g), 2)
    want = experts_forward(x, weights, ids, gate_up, down)
    laid = (QuantExperts(gate_up.bfloat16(), layout), QuantExperts(down.bfloat16(), layout))
    got = experts_forward(x.bfloat16(), weights, ids, gate_up, down, laid_out=laid)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < TOLERANCE[layout], _rel(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_quantized_step_reads_only_the_experts_its_tokens_chose(layout):
    _needs(layout)
    m = MoE(64, 32, 8, 2)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.to(torch.bfloat16)
    m.quantize(layout)
    x = torch.randn(2, 64).bfloat16()
    ids = torch.tensor([[0, 4], [4, 2]])
    weights = torch.full((2, 2), 0.5)
    want = experts_forward(x, weights, ids, m.gate_up, m.down, laid_out=m.laid_out)
    assert m.gate_up.shape[0] == 0 and m.down.shape[0] == 0  # the bf16 stacks are let go
    for stack in (m.gate_up_laid_out, m.down_laid_out):
        for e in (1, 3, 5, 6, 7):  # never chosen: their bytes may be anything
            stack.scales[e] = float("nan")
    got = experts_forward(x, weights, ids, m.gate_up, m.down, laid_out=m.laid_out)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layers_experts_run_in_one_kernel_call(layout):
    """Where our kernel holds the stacks (int4 groups in its layout, int8 rows), the block runs
    every routed expert in one call (``qlinear.experts``): the same sums as the experts one by
    one through the same kernel (to the fp32 rounding of the activation between the matrices),
    only the chosen experts read (the others' scales poisoned), each token the same bits alone
    as beside others."""
    _needs(layout)
    from workers.kernels import qlinear

    if not qlinear.available():
        pytest.skip("no C compiler here: the experts run one by one")
    torch.manual_seed(5)
    m = MoE(64, 32, 8, 2, expert_bias=True)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.quantize(layout)
    assert m.kernel_glu == ("silu", 0.0, 0.0) and m.gate_up_laid_out.ours
    x = torch.randn(6, 64)
    weights, ids = route(m.gate(x), 2)
    with torch.inference_mode():
        want = experts_forward(
            x,
            weights,
            ids,
            m.gate_up,
            m.down,
            laid_out=m.laid_out,
            gate_up_bias=m.gate_up_bias,
            down_bias=m.down_bias,
        )
        got = m(x)
        assert _rel(got, want) < 1e-5, _rel(got, want)
        chosen = set(ids.flatten().tolist())
        for stack in (m.gate_up_laid_out, m.down_laid_out):
            for e in set(range(8)) - chosen:
                stack.scales[e] = float("nan")
        assert torch.equal(m(x), got)
        # (the router's own torch GEMM may round a row alone differently: the experts' call is
        # held to the bits given the same routing)
        stacks = m._stacks()
        assert stacks is not None
        gu, dn = stacks
        for n in range(6):
            alone = qlinear.experts(
                x[n : n + 1],
                ids[n : n + 1],
                weights[n : n + 1],
                gu,
                dn,
                "silu",
                0.0,
                0.0,
                m.gate_up_bias,
                m.down_bias,
            )
            assert torch.equal(alone, got[n : n + 1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tokens_experts_sum_is_the_same_whatever_shares_its_step(layout):
    _needs(layout)
    gate_up, down = _experts()
    laid = (QuantExperts(gate_up.bfloat16(), layout), QuantExperts(down.bfloat16(), layout))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=g).bfloat16()
    weights, ids = route(torch.randn(7, 8, generator=g), 2)
    batch = experts_forward(x, weights, ids, gate_up, down, laid_out=laid)
    for n in range(7):
        alone = experts_forward(
            x[n : n + 1], weights[n : n + 1], ids[n : n + 1], gate_up, down, laid_out=laid
        )
        assert torch.allclose(alone.float(), batch[n : n + 1].float(), rtol=1e-2, atol=1e-3)


def test_moe_per_expert_bytes_count_the_quantized_matrices_and_the_biases():
    _needs("int4")
    m = MoE(64, 32, 4, 2, expert_bias=True).to(torch.bfloat16)
    m.quantize("int4")
    # gate_up [64, 64] and down [64, 32] in 4 bits with a bf16 scale and zero per 32, the biases bf16
    matrices = 64 * 64 // 2 + 64 * 2 * 4 + 64 * 32 // 2 + 64 * 1 * 4
    assert m.per_expert_bytes() == matrices + (64 + 64) * 2


def _mxfp4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return dequantize(*_mxfp4_quantize(torch.randn(n, k, generator=g) * 0.02))


def _held(packed_scales: tuple[torch.Tensor, torch.Tensor], k: int) -> torch.Tensor:
    """What the int4 kernel reads back: the product with the identity."""
    packed, scales_zeros = packed_scales
    eye = torch.eye(k, dtype=torch.bfloat16)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_zeros).float().t()


def test_the_fitted_int4_grid_holds_mxfp4_weights_better_than_min_max():
    _needs("int4")
    d = _mxfp4_weight(256, 512)
    fitted = _rel(_held(int4_from_fp4(d.bfloat16()), 512), d)
    minmax = _rel(_held(int4_groups(d.bfloat16()), 512), d)
    assert fitted < 0.06 < 0.08 < minmax, (fitted, minmax)  # measured: ~4.7% and ~8.8%


def test_mxfp4_blocks_on_an_int4_grid_come_back_exactly():
    """A block whose FP4 values fit 16 evenly spaced levels (here -3.5 .. 4 in steps of 0.5) is
    held exactly, up to nothing: its scale and zero are powers of two times small integers."""
    _needs("int4")
    levels = torch.tensor([-3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    g = torch.Generator().manual_seed(0)
    w = levels[torch.randint(0, len(levels), (16, 64), generator=g)]
    w[:, 0], w[:, 32] = 4.0, 4.0  # each block's largest magnitude: FP4's level 4
    w = w * torch.exp2(torch.randint(-8, -4, (16, 2), generator=g).float()).repeat_interleave(32, 1)
    assert torch.equal(_held(int4_from_fp4(w.bfloat16()), 64), w)


def _first_logits(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits after the prompt (greedy decode steps would diverge on the first differing
    token: not a measure of the layout)."""
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda seqs, logits: rows.append(logits[0].clone())
    eng.submit("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return rows[0]


# cosine similarity of those logits to fp32's (random tiny weights, every linear quantized too)
CLOSE = {"int8": 0.995, "int4": 0.97, "mxfp4": 0.99}


PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11]


@pytest.mark.parametrize("path", LAYOUTS)
def test_qwen3_moe_on_the_quantized_paths(model_factory, path):
    """The int8 and int4 paths lay the experts out quantized: the logits stay close to fp32's, the
    bytes a step reads count the quantized experts (top k of each layer), sizing agrees."""
    _needs(path)
    folder = str(model_factory("tiny-qwen3-moe", dtype="float32"))
    ref = Engine(folder, dtype="float32", cpu_path="fp32", num_slots=2, kv_budget_bytes=1 << 20)
    eng = Engine(folder, cpu_path=path, num_slots=2, kv_budget_bytes=1 << 20)
    mods = [m for m in eng.model.modules() if isinstance(m, MoE)]
    assert mods and all(isinstance(m.gate_up_laid_out, QuantExperts) for m in mods)
    # the router stays dense in the path's dtype (llama.cpp keeps it F32): the checkpoint's
    # weights as they are, not int8 rows, so a token's experts are the ones its logits pick
    refs = [m for m in ref.model.modules() if isinstance(m, MoE)]
    for m, r in zip(mods, refs):
        assert type(m.gate) is Router and m.gate.weight.dtype == eng.dtype
        assert torch.equal(m.gate.weight, r.gate.weight.to(eng.dtype))
    want, got = _first_logits(ref, PROMPT), _first_logits(eng, PROMPT)
    cos = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    assert cos > CLOSE[path], cos
    emb = eng.model.embed_tokens.weight
    unread = sum((m.num_experts - m.top_k) * m.per_expert_bytes() for m in mods)
    assert eng.step_read_bytes == eng.weight_bytes - emb.numel() * emb.element_size() - unread
    e = eng.cfg.layers[0].experts
    assert e is not None
    rows = 2 * e.intermediate + e.hidden  # a scale (bf16) per row, int8; int4 a scale and zero per 32
    want_bytes = (
        3 * e.intermediate * e.hidden + 2 * rows if path == "int8" else 3 * e.intermediate * e.hidden // 2
    )
    if path == "int4":
        want_bytes += 3 * e.intermediate * e.hidden // 32 * 4
    assert all(m.per_expert_bytes() == want_bytes for m in mods)
    assert estimate(eng.cfg, cpu_path=path).weights == eng.weight_bytes
    ref.close()
    eng.close()


def _logits_many(eng: Engine) -> torch.Tensor:
    return torch.stack([_first_logits(eng, PROMPT[i:] + PROMPT[:i]) for i in (0, 5)])


def test_gpt_oss_mxfp4_experts_are_held_as_they_ship(model_factory):
    """An MXFP4 folder on the CPU paths: the experts hold the file's own codes (reordered into the
    kernel's nibble order) and exponents (``MxExperts``: no bf16 copy, no fitted grid), sized so
    (sizing, the bytes a step reads); on the fp32 path the logits are those of the same engine
    with its experts dequantized (exact: the kernel differs only in the order of its sums), on
    the bf16 path close to them."""
    from safetensors import safe_open

    folder = model_factory("tiny-gpt-oss", dtype="float32", mxfp4=True)
    eng = Engine(str(folder), dtype="float32", cpu_path="fp32", num_slots=2, kv_budget_bytes=1 << 20)
    mods = [m for m in eng.model.modules() if isinstance(m, MoE)]
    assert mods and all(isinstance(m.gate_up_laid_out, MxExperts) and m.mxfp4 for m in mods)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        blocks = st.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")  # [E, 2I, G, 16]
        scales = st.get_tensor("model.layers.0.mlp.experts.gate_up_proj_scales")
    held = mods[0].gate_up_laid_out
    inter = mods[0].inter
    assert torch.equal(held.qs[:, :inter], from_hub(blocks[:, 0::2]))  # the gate rows
    assert torch.equal(held.e[:, inter:], scales[:, 1::2])  # the up rows' exponents
    e = eng.cfg.layers[0].experts
    assert e is not None
    mats = 3 * e.intermediate * e.hidden
    assert all(
        m.per_expert_bytes() == mats // 2 + mats // 32 + (2 * e.intermediate + e.hidden) * 4 for m in mods
    )
    assert estimate(eng.cfg, cpu_path="fp32").weights == eng.weight_bytes
    got = _logits_many(eng)
    for m in mods:
        m.unpack_mxfp4(torch.float32)
    assert not any(m.mxfp4 for m in mods)
    want = _logits_many(eng)
    assert _rel(got, want) < 1e-5, _rel(got, want)
    eng.close()
    bf16 = Engine(str(folder), cpu_path="bf16", num_slots=2, kv_budget_bytes=1 << 20)
    assert all(isinstance(m.gate_up_laid_out, MxExperts) for m in bf16.model.modules() if isinstance(m, MoE))
    assert estimate(bf16.cfg, cpu_path="bf16").weights == bf16.weight_bytes
    cos = torch.nn.functional.cosine_similarity(_logits_many(bf16), want, dim=-1)
    assert float(cos.min()) > CLOSE["mxfp4"], cos
    bf16.close()


def test_the_mxfp4_experts_equal_their_dequantized_products():
    """A mixture of experts holding MXFP4 experts (the kernel) against the same block with the
    experts dequantized (``unpack_mxfp4``: torch's products of the exact values), many tokens."""
    torch.manual_seed(3)
    m = MoE(64, 32, 8, 2, expert_bias=True, mxfp4=True)
    for held, (n, k) in ((m.gate_up_laid_out, (64, 64)), (m.down_laid_out, (64, 32))):
        for i in range(8):
            b, sc = _mxfp4_quantize(torch.randn(n, k) * 0.1)
            held.qs[i], held.e[i] = from_hub(b), sc
    with torch.no_grad():
        m.gate.weight.normal_()
        assert m.gate_up_bias is not None and m.down_bias is not None
        m.gate_up_bias.normal_()
        m.down_bias.normal_()
    x = torch.randn(13, 64)
    with torch.inference_mode():
        got = m(x)
        m.unpack_mxfp4(torch.float32)
        assert _rel(got, m(x)) < 1e-6


@pytest.mark.parametrize(
    "mark", [{"quantization_config": {"quant_method": "mxfp4"}}, {"experts_mxfp4": True}]
)
def test_mxfp4_experts_are_sized_as_they_ship_on_the_cpu_paths(mark):
    """A folder's quantization_config or a GGUF's MXFP4 expert tensors (gguf_config's mark) make
    every CPU path count the experts as MXFP4 (a code a half byte, an exponent a block of 32)."""
    from makemodel import build_config
    from pantheon.core.sizing import shape_from_config

    plain = shape_from_config(build_config("tiny-gpt-oss"), "plain")
    marked = shape_from_config({**build_config("tiny-gpt-oss"), **mark}, "mxfp4")
    e = marked.layers[0].experts
    assert e is not None and e.mxfp4 and plain.layers[0].experts is not None
    assert not plain.layers[0].experts.mxfp4
    mx = e.count * (3 * e.intermediate * e.hidden // 2 + 3 * e.intermediate * e.hidden // 32)
    for path, b in (("bf16", 2), ("bf16-packed", 2), ("fp32", 4)):
        saved = estimate(plain, cpu_path=path).layer_bytes[0] - estimate(marked, cpu_path=path).layer_bytes[0]
        assert saved == b * 3 * e.intermediate * e.hidden * e.count - mx  # the full matrices, less MXFP4
