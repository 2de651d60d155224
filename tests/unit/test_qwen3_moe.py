"""Mixture of experts: the shared block (``workers/layers/moe.py``) and the ``qwen3_moe`` family.

The block: routing variants against their definitions, the grouping's bookkeeping exactly, the
grouped experts against a dense per-token reference, and a step reading only the experts its tokens
chose (the others are poisoned with NaN). The family: logits against transformers'
``Qwen3MoeForCausalLM`` in fp32 (every prompt position, then 16 decode steps) with dense layers
mixed in (``mlp_only_layers``) and without top-k renormalisation, chunked prefill, transformers 5's
fused expert layout loading as the Hub's per-expert one, and sizing counting every expert as
resident while reporting the active parameters.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_reference import PROMPT, assert_matches

from makemodel import build_config
from pantheon.core.description import read_description
from pantheon.core.sizing import estimate, shape_from_config
from workers.engine import Engine
from workers.layers.moe import Groups, MoE, experts_forward, route

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------- the block


def test_route_softmax_then_topk_renormalised_or_not():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, -1.0]])
    w, ids = route(logits, 2, "softmax", norm_topk_prob=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [2, 0]] or ids.tolist() == [[1, 2], [2, 1]]
    assert torch.allclose(w, probs.gather(1, ids))
    wn, idn = route(logits, 2, "softmax", norm_topk_prob=True)
    assert torch.equal(idn, ids) and torch.allclose(wn, w / w.sum(-1, keepdim=True))
    assert torch.allclose(wn.sum(-1), torch.ones(2))


def test_route_softmax_over_the_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, 2, "topk_softmax")
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    with pytest.raises(ValueError, match="unknown routing"):
        route(logits, 2, "sigmoid")


def test_groups_bookkeeping():
    # 3 tokens, top 2 of 5 experts: expert 3 is chosen by tokens 0 and 2, expert 1 by tokens 0
    # and 1, expert 4 by tokens 1 and 2; experts 0 and 2 by nobody
    ids = torch.tensor([[3, 1], [1, 4], [4, 3]])
    g = Groups(ids, 5)
    assert g.counts.tolist() == [0, 2, 0, 2, 2]
    assert g.ends.tolist() == [0, 2, 2, 4, 6] and g.ends.dtype == torch.int32
    # sorted by expert, tokens in order inside a group (flat index = token * k + slot)
    assert g.order.tolist() == [1, 2, 0, 5, 3, 4]
    assert g.tokens.tolist() == [0, 1, 0, 2, 1, 2]
    assert g.active() == [(1, 0, 2), (3, 2, 4), (4, 4, 6)]


def _dense_reference(x, weights, ids, gate_up, down):
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gu = gate_up[e] @ x[n]
            out[n] += weights[n, j] * (down[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


def _experts(e=6, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) * 0.3, torch.randn(e, h, i, generator=g) * 0.3


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_experts_forward_equals_a_per_token_reference(tokens):
    gate_up, down = _experts()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 16, generator=g)
    weights, ids = route(torch.randn(tokens, 6, generator=g), 3)
    got = experts_forward(x, weights, ids, gate_up, down)
    assert torch.allclose(got, _dense_reference(x, weights, ids, gate_up, down), atol=1e-5)


def test_a_step_reads_only_the_experts_its_tokens_chose():
    gate_up, down = _experts()
    x = torch.randn(2, 16)
    ids = torch.tensor([[0, 4], [4, 2]])
    weights = torch.full((2, 2), 0.5)
    want = experts_forward(x, weights, ids, gate_up, down)
    for e in (1, 3, 5):  # never chosen: their bytes may be anything
        gate_up[e] = float("nan")
        down[e] = float("nan")
    assert torch.equal(experts_forward(x, weights, ids, gate_up, down), want)


def test_grouped_gemm_equals_the_loop():
    """``torch._grouped_mm`` (the CUDA path) runs on CPU too in this torch: the same sums as the
    per-expert loop, in bf16 (its dtype) with 16-byte-aligned shapes."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    gate_up, down = (t.bfloat16() for t in _experts(e=8, h=32, i=16))
    x = torch.randn(9, 32).bfloat16()
    weights, ids = route(torch.randn(9, 8), 2)
    loop = experts_forward(x, weights, ids, gate_up, down, grouped_mm=False)
    grouped = experts_forward(x, weights, ids, gate_up, down, grouped_mm=True)
    assert torch.allclose(loop.float(), grouped.float(), atol=2e-2, rtol=2e-2)


def test_shared_expert_behind_its_sigmoid_gate():
    torch.manual_seed(0)
    m = MoE(16, 8, 4, 2, shared_inter=12)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 16)
    routed = experts_forward(x, *route(m.gate(x), 2), m.gate_up, m.down)
    assert m.shared_expert is not None and m.shared_expert_gate is not None
    want = routed + torch.sigmoid(m.shared_expert_gate(x)) * m.shared_expert(x)
    assert torch.allclose(m(x), want, atol=1e-6)


@pytest.mark.gpu
def test_cuda_grouped_experts_equal_the_cpu_loop():
    gate_up, down = (t.bfloat16() for t in _experts(e=8, h=64, i=32))
    x = torch.randn(17, 64).bfloat16()
    weights, ids = route(torch.randn(17, 8), 2)
    want = experts_forward(x, weights, ids, gate_up, down, grouped_mm=False).float()
    got = experts_forward(x.cuda(), weights.cuda(), ids.cuda(), gate_up.cuda(), down.cuda())
    assert torch.allclose(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- the family against transformers


def test_logits_match_transformers(model_factory):
    """tiny-qwen3-moe (3 layers of 8 experts, top 2, renormalised, untied head): every prompt
    position, then 16 decode steps."""
    path = model_factory("tiny-qwen3-moe", dtype="float32")
    ours = Engine(str(path), dtype="float32").prompt_logits(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
    assert_matches(path)


def test_dense_layers_and_plain_topk_weights_match_transformers(model_factory):
    """A dense MLP in ``mlp_only_layers`` between sparse layers, and top-k weights not renormalised."""
    path = model_factory("tiny-qwen3-moe", dtype="float32", mlp_only_layers=[1], norm_topk_prob=False)
    desc = read_description(path)
    assert [s.experts is not None for s in desc.layers] == [True, False, True]
    assert_matches(path)


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_matches_transformers(model_factory, chunk):
    assert_matches(model_factory("tiny-qwen3-moe", dtype="float32"), prefill_chunk=chunk, block_size=4)


def test_fused_expert_layout_loads_as_the_per_expert_one(model_factory, tmp_path):
    """transformers 5's fused ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
    (how Qwen3.5-MoE checkpoints are stored) fill the same weights as the Hub's per-expert names."""
    src = model_factory("tiny-qwen3-moe", dtype="float32")
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        n = cfg["num_experts"]
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(n)]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(n)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(n)]
        tensors[f"{p}gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        tensors[f"{p}down_proj"] = torch.stack(down)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    # one CPU path for both (the chooser times paths, and a busy host may pick another per load)
    want = Engine(str(src), dtype="float32", cpu_path="fp32").prompt_logits(PROMPT)
    assert torch.equal(Engine(str(tmp_path), dtype="float32", cpu_path="fp32").prompt_logits(PROMPT), want)


# ---------------------------------------------------------------- sizing


def test_sizing_counts_every_expert_and_reports_the_active_ones():
    desc = shape_from_config(build_config("qwen3-30b-a3b"), "qwen3-30b-a3b")
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (its model card's figures)
    assert round(desc.total_params / 1e9, 1) == 30.5
    assert 3.3e9 < desc.active_params < 3.4e9  # embedding table and head counted whole
    est = estimate(desc, cpu_path="bf16")
    assert est.total_params == desc.total_params and est.active_params == desc.active_params
    # every expert is resident: bf16 weights are 2 bytes a parameter
    assert est.weights == 2 * desc.total_params
    tiny = shape_from_config(build_config("tiny-qwen3-moe"), "tiny")
    e = tiny.layers[0].experts
    assert e is not None and (e.count, e.top_k, e.intermediate) == (8, 2, 32)
    assert tiny.total_params - tiny.active_params == 3 * (8 - 2) * 3 * 32 * 64
    # int8 lays out the linears and the experts in rows: a byte a weight and a bf16 scale a row
    int8 = estimate(tiny, cpu_path="int8")
    expert_rows = e.count * (2 * e.intermediate + e.hidden)
    assert e.params + 2 * expert_rows < int8.layer_bytes[0] < e.params * 2


def test_a_stack_with_more_experts_than_the_config_is_a_load_error(model_factory, tmp_path):
    from workers.errors import LoadError

    src = model_factory("tiny-qwen3-moe", dtype="float32")
    tensors = load_file(src / "model.safetensors")
    p = "model.layers.0.mlp.experts."
    down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)]
    tensors[f"{p}down_proj"] = torch.stack(down + down[:1])  # 9 experts, the config says 8
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LoadError, match=r"experts\.8\.down_proj\.weight.*not part of the model") as e:
        Engine(str(tmp_path), dtype="float32")
    assert e.value.kind == "invalid"
