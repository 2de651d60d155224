"""gpt-oss (GptOssForCausalLM): alternating sliding-window (128 tokens; 16 in the tiny preset) and
full attention layers with q/k/v/o biases and a learned sink per head, YaRN RoPE, and a mixture
of experts in every layer (router with a bias, top k, experts with biases, clamped SwiGLU). The
experts stacked as transformers' GptOssExperts holds them: gate_up_proj [E, H, 2I] with gate and
up columns interleaved, down_proj [E, I, H], and their biases; ``make_model(..., mxfp4=True)``
stores gate_up_proj and down_proj as the Hub does, MXFP4 blocks and scales (_write_mxfp4).
The tokenizer is ours plus Harmony's markers (special, ids 4000..4006; the real ones are
200002..200012), with a short Harmony chat template of our own; <|return|> and <|call|> end a
turn (EOS), as in gpt-oss's generation_config.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from makemodel import tokenizer_train as tt
from makemodel.families.common import TINY_VOCAB
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary
from makemodel.writer import DTYPES, ChunksOf, numel, tensor_seed
from makemodel.writer import write_json as _write_json  # the name _write_mxfp4 calls it by

MARKERS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]

# Harmony, gpt-oss's message format, in our own shorter text: every message is
# <|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>. A system message says the reasoning
# effort and the channels; the request's system/developer text and its tools go into a developer
# message (tools as TypeScript-like signatures in the `functions` namespace, parameters as JSON
# schema); an assistant turn after the last user message keeps its reasoning (analysis channel),
# its tool calls go to the commentary channel addressed `to=functions.NAME` and end in <|call|>,
# its answer to the final channel; tool results come from `functions.NAME` to the assistant. The
# generation prompt opens an assistant message.
CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}{%- if 'text' in part -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are a large language model.\\nReasoning: '
    + (reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium')
    + '\\n\\n# Valid channels: analysis, commentary, final. Every message names its channel.' -}}
{%- if tools -%}{{- '\\nTool calls go to the commentary channel.' -}}{%- endif -%}
{{- '<|end|>' -}}
{%- set msgs = messages -%}
{%- set instructions = '' -%}
{%- if messages and messages[0].role in ('system', 'developer') -%}
  {%- set instructions = render(messages[0].content) -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- if instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if instructions -%}{{- '# Instructions\\n\\n' + instructions -}}{%- endif -%}
  {%- if tools -%}
    {%- if instructions -%}{{- '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}
    {%- for tool in tools -%}
      {%- set f = tool.function if tool.function is defined else tool -%}
      {{- '\\n// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: '
          + ((f.parameters or {}) | tojson) + ') => any;\\n' -}}
    {%- endfor -%}
    {{- '\\n} // namespace functions' -}}
  {%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
  {%- if m.role == 'user' or m.role == 'system' or m.role == 'developer' -%}
    {{- '<|start|>' + m.role + '<|message|>' + render(m.content) + '<|end|>' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if reasoning and loop.index0 > ns.last_user -%}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}
    {%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>'
          + (f.arguments if f.arguments is string else (f.arguments | tojson)) + '<|call|>' -}}
    {%- endfor -%}
    {%- set content = render(m.content) -%}
    {%- if content or not m.tool_calls -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' -}}
    {%- endif -%}
  {%- elif m.role == 'tool' -%}
    {%- set tool = namespace(name=m.name if m.name is defined and m.name else 'tool') -%}
    {%- for prev in msgs[:loop.index0] -%}
      {%- for call in prev.tool_calls or [] -%}
        {%- if call.id is defined and call.id == m.tool_call_id -%}
          {%- set tool.name = (call.function if call.function is defined else call).name -%}
        {%- endif -%}
      {%- endfor -%}
    {%- endfor -%}
    {{- '<|start|>functions.' + tool.name + ' to=assistant<|channel|>commentary<|message|>'
        + render(m.content) + '<|end|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

TOKENIZER = Vocabulary(tuple(MARKERS), "<|return|>", CHAT_TEMPLATE)
TOKEN_IDS = TOKENIZER.token_ids
VOCAB_SIZE = TOKENIZER.size  # 4007
EOS = [TOKEN_IDS["<|return|>"], TOKEN_IDS["<|call|>"]]


def _layer_types(n: int) -> list[str]:
    """gpt-oss alternates, sliding first."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def gpt_oss_config(**shapes) -> dict:
    """A ``gpt_oss`` config as the Hub writes gpt-oss-20b's (without its quantization_config,
    which ``mxfp4=True`` adds), keys sorted."""
    config = dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        attention_bias=True,
        attention_dropout=0.0,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=TOKEN_IDS["<|return|>"],
        hidden_act="silu",
        initializer_range=0.02,
        layer_types=_layer_types(shapes["num_hidden_layers"]),
        output_router_logits=False,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        router_aux_loss_coef=0.9,
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


_ROPE = dict(
    beta_fast=32.0,
    beta_slow=1.0,
    factor=32.0,
    original_max_position_embeddings=4096,
    rope_type="yarn",
    truncate=False,
)
PRESETS: dict[str, dict] = {
    # Tiny: 2 layers (sliding, full), a 16-token window, 8 experts (top 4) of 64 rows, YaRN over
    # 1024 original positions (so that its ramp and attention factor matter at the tiny head dim).
    "tiny-gpt-oss": gpt_oss_config(
        hidden_size=64,
        intermediate_size=64,  # a multiple of 32: MXFP4 blocks along the down projection's rows
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=TINY_VOCAB + 64,  # 4096: room for the Harmony markers
        max_position_embeddings=4096,
        sliding_window=16,
        num_local_experts=8,
        num_experts_per_tok=4,
        rope_scaling={**_ROPE, "factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    # Exactly gpt-oss-20b's shapes (24 layers of 32 experts, 4 per token; tokenizer ours): the
    # decode benchmark cuts it to a few layers with num_hidden_layers (layer_types follow, see
    # follow_overrides).
    "gpt-oss-20b": gpt_oss_config(
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=201088,
        max_position_embeddings=131072,
        sliding_window=128,
        num_local_experts=32,
        num_experts_per_tok=4,
        rope_scaling=dict(_ROPE),
    ),
}


def follow_overrides(config: dict, given: set[str]) -> None:
    """``layer_types`` follows an overridden ``num_hidden_layers`` unless given too."""
    if "num_hidden_layers" in given and "layer_types" not in given:
        config["layer_types"] = _layer_types(config["num_hidden_layers"])


def tensor_specs(config: dict) -> list[TensorSpec]:
    """gpt-oss under transformers' names (experts stacked and transposed, biases everywhere)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    e = config["num_local_experts"]
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (config["vocab_size"], h), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (nq * hd, h), "normal"),
            (p + "self_attn.q_proj.bias", (nq * hd,), "normal"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.k_proj.bias", (nkv * hd,), "normal"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.v_proj.bias", (nkv * hd,), "normal"),
            (p + "self_attn.o_proj.weight", (h, nq * hd), "normal"),
            (p + "self_attn.o_proj.bias", (h,), "normal"),
            (p + "self_attn.sinks", (nq,), "normal"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.router.weight", (e, h), "normal"),
            (p + "mlp.router.bias", (e,), "normal"),
            (p + "mlp.experts.gate_up_proj", (e, h, 2 * inter), "normal"),
            (p + "mlp.experts.gate_up_proj_bias", (e, 2 * inter), "normal"),
            (p + "mlp.experts.down_proj", (e, inter, h), "normal"),
            (p + "mlp.experts.down_proj_bias", (e, h), "normal"),
        ]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


MXFP4_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes, codes 0..7 (8..15: negative)


def _mxfp4_quantize(w):
    """``[..., R, C]`` float -> (blocks ``[..., R, C / 32, 16]`` uint8, scales ``[..., R, C / 32]``
    uint8) as transformers' ``integrations/mxfp4.py`` reads them: per 32 values an e8m0 exponent
    (the smallest power of two that brings the block's largest magnitude within 6), each value
    the nearest e2m1 level of its scaled value, two a byte, the even column in the low nibble."""
    import torch

    *lead, r, c = w.shape
    x = w.float().contiguous().reshape(*lead, r, c // 32, 32)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)
    levels = torch.tensor(_FP4_LEVELS)
    # the nearest magnitude (a tie to the smaller): the midpoints between levels as bucket edges
    code = torch.bucketize(scaled.abs(), (levels[1:] + levels[:-1]) / 2)
    code = code + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def _write_mxfp4(out: Path, config: dict, chunks_of: ChunksOf, fast: bool = False) -> None:
    """Write a gpt-oss folder's weights with its experts as MXFP4 (``gate_up_proj`` /
    ``down_proj`` -> ``*_blocks`` and ``*_scales`` of their untransposed ``[E, 2I, H]`` /
    ``[E, H, I]``, as the Hub ships gpt-oss) into one ``model.safetensors``, and add its
    ``quantization_config``. Tensor by tensor and expert by expert (``_mxfp4_tensors``): the
    experts are never whole in bf16 on disk nor in memory, so gpt-oss-20b's full shapes write a
    ~13 GB file holding a few hundred MB. ``chunks_of(name, shape, kind)``: ``writer.write_weights``'
    generator of a tensor's bytes (the experts' values are those the bf16 folder holds); ``fast``:
    the experts' codes random bytes instead (``_fast_mxfp4``: the whole 20b in minutes)."""
    import torch

    dtype_name, st_dtype, itemsize = DTYPES[config["torch_dtype"]]
    torch_dtype = getattr(torch, dtype_name)
    entries = {}  # name -> (safetensors dtype, shape): the file's tensors
    for name, shape, _ in tensor_specs(config):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = shape  # stored transposed: [E, in, out]
            entries[f"{name}_blocks"] = ("U8", (e, rows, cols // 32, 16))
            entries[f"{name}_scales"] = ("U8", (e, rows, cols // 32))
        else:
            entries[name] = (st_dtype, shape)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(entries):
        dt, shape = entries[name]
        size = numel(shape) * (itemsize if dt == st_dtype else 1)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    base = 8 + len(raw)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(base + offset)
        for name, data in _mxfp4_tensors(config, chunks_of, torch_dtype, fast):
            at = base + header[name]["data_offsets"][0]
            for pos, chunk in data:
                f.seek(at + pos)
                f.write(chunk if isinstance(chunk, bytes) else chunk.data)  # an array's raw bytes, uncopied
    config["quantization_config"] = dict(MXFP4_QUANTIZATION)
    _write_json(out / "config.json", dict(sorted(config.items())))


def _mxfp4_tensors(config: dict, chunks_of: ChunksOf, torch_dtype, fast: bool = False):
    """``(name, [(byte offset in the tensor, bytes), ...])`` for every tensor of an MXFP4 gpt-oss
    folder, as ``_write_mxfp4`` places them: float tensors as ``chunks_of`` yields them; each
    expert stack quantized an expert at a time (``_mxfp4_quantize`` of the expert's transposed
    matrix, as the bf16 folder's values), its blocks and scales each at the expert's slot; or,
    ``fast``, made directly (``_fast_mxfp4``)."""
    import torch

    for name, shape, kind in tensor_specs(config):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            yield name, _at_offsets(chunks_of(name, shape, kind))
            continue
        num, cols, rows = shape
        per_blocks, per_scales = rows * cols // 2, rows * cols // 32  # one expert's bytes
        if fast:
            for e in range(num):
                blocks, scales = _fast_mxfp4(name, e, per_blocks, per_scales)
                yield f"{name}_blocks", [(e * per_blocks, blocks)]
                yield f"{name}_scales", [(e * per_scales, scales)]
            continue
        e = 0
        for chunk in chunks_of(name, shape, kind):  # whole experts: rows of the stack
            w = torch.from_numpy(chunk).view(torch_dtype).view(-1, cols, rows)
            for i in range(w.shape[0]):
                blocks, scales = _mxfp4_quantize(w[i].transpose(-1, -2))
                yield f"{name}_blocks", [(e * per_blocks, blocks.numpy().tobytes())]
                yield f"{name}_scales", [(e * per_scales, scales.numpy().tobytes())]
                e += 1


# MXFP4 exponent of the fast experts: uniform codes have an RMS of ~2.9 levels, so 2^-7 gives the
# RMS of the other weights (_STD)
_FAST_MXFP4_EXP = 127 - 7


def _fast_mxfp4(name: str, e: int, nblocks: int, nscales: int) -> tuple[bytes, bytes]:
    """One expert's MXFP4 codes as seeded random bytes (every code equally likely) and its
    exponents all ``_FAST_MXFP4_EXP``: weights of the other tensors' spread, for timing runs."""
    import torch

    gen = torch.Generator().manual_seed(tensor_seed(e, name))
    blocks = torch.randint(0, 256, (nblocks,), dtype=torch.uint8, generator=gen)
    return blocks.numpy().tobytes(), bytes([_FAST_MXFP4_EXP]) * nscales


def _at_offsets(chunks):
    """Consecutive chunks of a tensor's bytes, each with its offset in the tensor."""
    pos = 0
    for chunk in chunks:
        yield pos, chunk
        pos += len(chunk)


FAMILY = Family(
    name="gpt_oss",
    model_types=frozenset({"gpt_oss"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=TOKENIZER,
    jittered=frozenset({"tiny-gpt-oss"}),
    turn_ends=tuple(EOS),  # <|return|> and <|call|> end a turn, as gpt-oss's
    follow_overrides=follow_overrides,
    mxfp4=_write_mxfp4,
)
