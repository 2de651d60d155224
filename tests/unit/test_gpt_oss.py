"""gpt-oss (``workers/models/gpt_oss.py``) and what it added to the shared parts.

The parts: gpt-oss's clamped SwiGLU against transformers' ``GptOssExperts._apply_gate``, experts
with biases (per-expert loop, prepacked-style linears, grouped GEMM) against a per-token
reference, sink attention against its log-sum-exp form, MXFP4 dequantization of codes and
scales, and our YaRN tables against transformers' rope init for gpt-oss-20b's config.

The family: ``tiny-gpt-oss`` (a 16-token sliding layer and a full one, 8 experts top 4, YaRN)
against transformers' ``GptOssForCausalLM`` in fp32 on a 40-token prompt (past the window):
every prompt position, then 16 greedy decode steps, also with the clamps active; chunked prefill
(chunks shorter and longer than the window, 4-token blocks); eight prompts together equal each
alone; an MXFP4 folder (``make_model(mxfp4=True)``) equals transformers' dequantized model; the
description and sizing of gpt-oss-20b (every expert resident, its model card's parameter counts);
the preset's Harmony markers and template.
"""

from __future__ import annotations

import json

import pytest
import torch
from unit.test_engine_batching import PROMPTS, drain, greedy
from unit.test_engine_reference import assert_matches

from makemodel import build_config, make_model
from makemodel import tokenizer_train as tt
from makemodel.families import gpt_oss
from pantheon.core.description import ModelError, describe, read_description
from pantheon.core.sizing import estimate, shape_from_config
from workers.engine import Engine
from workers.layers.moe import ClampedSwiGLU, MoE, experts_forward, route
from workers.layers.rotary import inv_freq_for
from workers.layers.sinks import attend_with_sinks
from workers.mxfp4 import dequantize

transformers = pytest.importorskip("transformers")

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2
# the clamps at 0.05 cut ~3/4 of the random weights' gate and up values (their std is ~0.16)
CLAMPED = dict(swiglu_limit=0.05, swiglu_alpha=1.0)


# ---------------------------------------------------------------- the parts


def test_clamped_swiglu_equals_transformers_gate():
    """Our stacked gate-then-up columns give what transformers' interleaved ones give."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(intermediate_size=8, hidden_size=8, num_local_experts=2, swiglu_limit=0.7)
    ref = GptOssExperts(cfg)
    interleaved = torch.randn(5, 16) * 2
    stacked = torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=-1)
    got = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)(stacked)
    assert torch.equal(got, ref._apply_gate(interleaved))


def _reference(x, weights, ids, gate_up, down, gb, db, glu):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gu = gate_up[e] @ x[n] + gb[e]
            out[n] += weights[n, j] * (down[e] @ glu(gu[None])[0] + db[e])
    return out


def _biased_experts(e=6, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * 0.3 for s in ((e, 2 * i, h), (e, h, i), (e, 2 * i), (e, h))]


@pytest.mark.parametrize("tokens", [1, 9])
def test_experts_with_biases_and_clamps_equal_a_per_token_reference(tokens):
    gate_up, down, gb, db = _biased_experts()
    glu = ClampedSwiGLU(1.702, 0.5)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 16, generator=g)
    weights, ids = route(torch.randn(tokens, 6, generator=g), 4, "topk_softmax")
    want = _reference(x, weights, ids, gate_up, down, gb, db, glu)
    got = experts_forward(x, weights, ids, gate_up, down, glu=glu, gate_up_bias=gb, down_bias=db)
    assert torch.allclose(got, want, atol=1e-5)
    # as the packed CPU paths run them: one bias-less linear per expert, the biases added after
    laid = tuple(torch.nn.ModuleList(_linear(w[e]) for e in range(w.shape[0])) for w in (gate_up, down))
    got = experts_forward(
        x, weights, ids, gate_up, down, glu=glu, gate_up_bias=gb, down_bias=db, laid_out=laid
    )
    assert torch.allclose(got, want, atol=1e-5)


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


def test_grouped_gemm_with_biases_equals_the_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    parts = [t.bfloat16() for t in _biased_experts(e=8, h=32, i=16)]
    gate_up, down, gb, db = parts
    x = torch.randn(9, 32).bfloat16()
    weights, ids = route(torch.randn(9, 8), 4, "topk_softmax")
    kw = dict(glu=ClampedSwiGLU(1.702, 0.5), gate_up_bias=gb, down_bias=db)
    loop = experts_forward(x, weights, ids, gate_up, down, grouped_mm=False, **kw)
    grouped = experts_forward(x, weights, ids, gate_up, down, grouped_mm=True, **kw)
    assert torch.allclose(loop.float(), grouped.float(), atol=2e-2, rtol=2e-2)


def test_moe_per_expert_bytes_count_the_biases():
    m = MoE(16, 8, 4, 2, expert_bias=True)
    assert m.per_expert_bytes() == (2 * 8 * 16 + 16 * 8 + 2 * 8 + 16) * 4


def test_sinks_scale_attention_by_the_sigmoid_of_lse_minus_sink():
    """A sink is one more logit with no value: out = attention * sigmoid(lse - sink); a causal
    chunk after history (mask None) equals the explicit band."""
    g = torch.Generator().manual_seed(0)
    c, t, h, kv, d = 5, 9, 4, 2, 8
    q, k, v = (torch.randn(n, m, d, generator=g) for n, m in ((c, h), (t, kv), (t, kv)))
    sinks = torch.randn(h, generator=g)
    got = attend_with_sinks(q, k, v, None, sinks)
    mask = torch.arange(t)[None, :] <= torch.arange(t - c, t)[:, None]  # [C, T]
    assert torch.allclose(attend_with_sinks(q, k, v, mask, sinks), got)
    kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = torch.einsum("chd,thd->hct", q, kk).masked_fill(~mask, float("-inf"))
    plain = torch.einsum("hct,thd->chd", torch.softmax(scores, -1), vv)
    lse = torch.logsumexp(scores, -1).transpose(0, 1)  # [C, H]
    want = plain * torch.sigmoid(lse - sinks)[..., None]
    assert torch.allclose(got, want, atol=1e-6)


def test_mxfp4_codes_and_scales():
    # byte 0x2F: low nibble 0xF (-6.0) is the even column, high nibble 0x2 (1.0) the odd one
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F
    blocks[0, 0, 1] = 0x97  # 6.0, then -0.5
    scales = torch.tensor([[126]], dtype=torch.uint8)  # 2 ** -1
    w = dequantize(blocks, scales)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [-3.0, 0.5, 3.0, -0.25] and not w[0, 4:].any()
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16).float(), w)  # exact in bf16
    with pytest.raises(ValueError, match="do not match"):
        dequantize(blocks, scales[:, :0])


def test_mxfp4_quantizer_round_trips_its_levels():
    """make-model's quantizer: values already on the grid come back exactly; others to the
    nearest level of their block's scale."""
    levels = torch.tensor(gpt_oss._FP4_LEVELS)  # the 8 magnitudes
    block = torch.cat((levels, -levels, levels, -levels))  # 32 values
    w = torch.cat((block * 4, block / 8))[None]  # two blocks, two scales
    blocks, scales = gpt_oss._mxfp4_quantize(w)
    assert torch.equal(dequantize(blocks, scales), w)
    x = torch.randn(3, 64)
    blocks, scales = gpt_oss._mxfp4_quantize(x)
    back = dequantize(blocks, scales)
    scale = torch.exp2(scales.float() - 127)[..., None]  # [3, 2, 1]
    assert (x.view(3, 2, 32).abs().amax(-1, keepdim=True) <= 6 * scale).all()  # the largest fits
    assert ((back - x).view(3, 2, 32).abs() <= scale).all()  # half the widest gap (4 to 6)


def test_yarn_tables_equal_transformers():
    """gpt-oss-20b's YaRN (factor 32 over 4096 positions, not truncated) and the tiny preset's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for preset in ("gpt-oss-20b", "tiny-gpt-oss"):
        cfg = build_config(preset)
        ours, scale = inv_freq_for(shape_from_config(cfg, preset))
        ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(**cfg), "cpu")
        assert torch.allclose(ours, ref, rtol=1e-6, atol=0) and scale == pytest.approx(ref_scale)


# ---------------------------------------------------------------- description and sizing


def test_gpt_oss_20b_description_and_sizing():
    desc = shape_from_config(build_config("gpt-oss-20b"), "gpt-oss-20b")
    assert desc.family == "gpt_oss" and desc.windows == [128]
    assert desc.layer_types == ("sliding_attention", "full_attention") * 12
    assert desc.rope.type == "yarn" and desc.rope.theta == 150000.0
    e = desc.layers[0].experts
    assert e is not None and (e.count, e.top_k, e.intermediate, e.bias) == (32, 4, 2880, True)
    # its model card: 20.91B parameters, 3.61B active (the embedding lookup not counted; ours
    # counts the table whole, as for every model)
    assert round(desc.total_params / 1e9, 2) == 20.91
    table = desc.vocab_size * desc.hidden_size
    assert round((desc.active_params - table) / 1e9, 2) == 3.61
    est = estimate(desc, cpu_path="bf16")
    assert est.weights == 2 * desc.total_params  # every expert resident
    # full layers keep KV per token in the pool, sliding ones a 128-position ring per slot
    assert est.kv_per_token == 12 * 2 * 8 * 64 * 2
    assert est.state_per_slot == 12 * 128 * 2 * 8 * 64 * 2


@pytest.mark.parametrize(
    "change, words",
    [
        ({"layer_types": ["sliding_attention"]}, "layer_types must list"),
        ({"num_experts_per_tok": 9}, "exceeds num_local_experts"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "mxfp4 is"),
        ({"swiglu_limit": 0}, "swiglu_limit must be a positive number"),
    ],
)
def test_configs_refused_say_why(change, words):
    with pytest.raises(ModelError, match=words):
        describe({**build_config("tiny-gpt-oss"), **change}, {}, "cfg")


def test_defaults_of_a_bare_config():
    """What transformers' GptOssConfig fills in: alternating layers from sliding, a 128 window,
    YaRN over 4096 positions at base 150,000."""
    cfg = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64}
    cfg |= {"intermediate_size": 64, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 128}
    desc = describe(cfg, {}, "bare")
    assert desc.layer_types == ("sliding_attention", "full_attention") * 2 and desc.windows == [128]
    assert desc.rope.type == "yarn" and desc.rope.theta == 150000.0
    assert desc.rope.scaling["factor"] == 32.0 and desc.rope.scaling["truncate"] is False
    assert (desc.num_experts, desc.num_experts_per_tok) == (128, 4)


# ---------------------------------------------------------------- the family against transformers


def _hf_logits(path, **kw) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


@pytest.mark.parametrize("options", [{}, CLAMPED], ids=["preset", "clamped"])
def test_logits_match_transformers_past_the_window(model_factory, options):
    path = model_factory("tiny-gpt-oss", dtype="float32", **options)
    ours = Engine(str(path), dtype="float32").prompt_logits(PROMPT)  # [40, V]
    ref = _hf_logits(path)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    assert_matches(path, prompt=PROMPT)  # 16 decode steps on, the window sliding each step


@pytest.mark.parametrize("chunk", [5, 23])
def test_chunked_prefill_matches_transformers(model_factory, chunk):
    path = model_factory("tiny-gpt-oss", dtype="float32")
    assert_matches(path, prompt=PROMPT, prefill_chunk=chunk, block_size=4)


def test_eight_prompts_together_equal_alone(model_factory):
    eng = Engine(
        str(model_factory("tiny-gpt-oss", dtype="float32")), dtype="float32", kv_budget_bytes=8 << 20
    )
    alone = {}
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy())
        alone[f"p{i}"] = drain(eng)[f"p{i}"]
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy())
    assert drain(eng) == alone
    assert len({tuple(v) for v in alone.values()}) > 1


def test_mxfp4_folder_equals_transformers_dequantized(model_factory):
    """The Hub's storage of the experts: blocks and scales, dequantized at load by us and by
    transformers (``Mxfp4Config(dequantize=True)``) to the same model."""
    path = model_factory("tiny-gpt-oss", dtype="float32", mxfp4=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4" and read_description(path).mxfp4
    ours = Engine(str(path), dtype="float32").prompt_logits(PROMPT)
    ref = _hf_logits(path, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert (ours - ref).abs().max().item() < 1e-4
    # and it is a different model from the unquantized folder (FP4 levels), not the same bytes
    plain = Engine(str(model_factory("tiny-gpt-oss", dtype="float32")), dtype="float32").prompt_logits(PROMPT)
    assert (ours - plain).abs().max().item() > 1e-3


def test_mxfp4_folders_are_written_expert_by_expert(model_factory, tmp_path):
    """make-model's MXFP4 folder is written tensor by tensor, each expert quantized on its own
    (never a bf16 file of the whole model first): the bf16 folder's tensors, its experts as
    ``_mxfp4_quantize`` makes them; ``fast``: the experts' codes random, their exponents one power
    of two, and the folder loads."""
    from safetensors.torch import load_file

    mx = load_file(model_factory("tiny-gpt-oss", mxfp4=True) / "model.safetensors")
    plain = load_file(model_factory("tiny-gpt-oss") / "model.safetensors")
    for name, w in plain.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(mx[name], w), name
            continue
        parts = [gpt_oss._mxfp4_quantize(w[e].transpose(-1, -2)) for e in range(w.shape[0])]
        assert torch.equal(mx[f"{name}_blocks"], torch.stack([b for b, _ in parts])), name
        assert torch.equal(mx[f"{name}_scales"], torch.stack([sc for _, sc in parts])), name
    assert len(mx) == len(plain) + sum(n.endswith("_blocks") for n in mx)
    fast = make_model("tiny-gpt-oss", tmp_path / "fast", mxfp4=True, fast=True)
    tensors = load_file(fast / "model.safetensors")
    scales = tensors["model.layers.0.mlp.experts.down_proj_scales"]
    assert scales.shape == (8, 64, 2) and (scales == gpt_oss._FAST_MXFP4_EXP).all()
    assert tensors["model.layers.0.mlp.experts.down_proj_blocks"].unique().numel() > 200
    logits = Engine(str(fast)).prompt_logits(PROMPT)
    assert torch.isfinite(logits).all()


def test_mxfp4_blocks_without_scales_are_a_load_error(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    from workers.errors import LoadError

    src = model_factory("tiny-gpt-oss", dtype="float32", mxfp4=True)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LoadError, match=r"layers\.1\.mlp\.experts\.down_proj.*only its blocks") as e:
        Engine(str(tmp_path), dtype="float32")
    assert e.value.kind == "invalid"


# ---------------------------------------------------------------- the preset's tokenizer and template


def test_the_template_writes_harmony(model_factory):
    folder = model_factory("tiny-gpt-oss")
    gen = json.loads((folder / "generation_config.json").read_text())
    ids = gpt_oss.TOKEN_IDS
    assert gen["eos_token_id"] == [ids["<|return|>"], ids["<|call|>"], tt.TOKEN_IDS["<|endoftext|>"]]
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.convert_tokens_to_ids(gpt_oss.MARKERS) == list(range(4000, 4007))
    assert tok.eos_token == "<|return|>"
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather of a city.",
                "parameters": {"type": "object"},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Ask the tool.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Rain."},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|start|>system<|message|>You are a large language model.\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Every message names its channel.\n"
        "Tool calls go to the commentary channel.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        'namespace functions {\n\n// Weather of a city.\ntype weather = (_: {"type": "object"}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.weather to=assistant<|channel|>commentary<|message|>Rain.<|end|>"
        "<|start|>assistant"
    )
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], tokenize=False
    )
    assert plain.endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
    )
    assert tok(text, add_special_tokens=False)["input_ids"].count(ids["<|start|>"]) == 7


@pytest.mark.parametrize("name", ["fp32-packed", "bf16", "bf16-packed", "int8"])
def test_cpu_paths_match_the_fp32_reference(name, model_factory):
    """Each CPU path's layout of gpt-oss (the packed ones prepack each expert without its biases,
    which the block adds after) against the plain fp32 path."""
    from workers import cpu_paths

    if cpu_paths.probe(name) is not None:
        pytest.skip(f"{name} does not work on this host")
    path = str(model_factory("tiny-gpt-oss", dtype="float32"))
    ref = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path="fp32").prompt_logits(PROMPT)
    lossy = cpu_paths.PATHS[name].lossy
    eng = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path=name, quantize=lossy)
    assert eng.cpu_path == name
    tol = {"fp32-packed": 1e-4}.get(name, 0.25 if lossy else 0.05)
    assert float((eng.prompt_logits(PROMPT) - ref).abs().max() / ref.abs().max()) < tol
