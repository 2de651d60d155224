"""Qwen3.5 as the Hub ships it, and as a text-only checkpoint.

Qwen3.5 is a hybrid: three Gated DeltaNet (linear attention) layers, then one gated full-attention
layer (q_proj also yields a per-head output gate), repeated; RMSNorms are zero-centred (weight 0
is the identity: x * (1 + w)), except the DeltaNet's gated output norm (plain, weight 1). The Hub
checkpoints are Qwen3_5ForConditionalGeneration: a nested text_config / vision_config, weights
model.language_model.* (text), model.visual.* (vision tower), lm_head.weight (when untied) and
mtp.* (one multi-token-prediction layer, which transformers skips on load; vLLM/SGLang use it
for speculative decoding). The MoE variant (``qwen3_5_moe``) builds on the helpers here.
"""

from __future__ import annotations

from collections.abc import Callable

from makemodel.families.common import IDS, TINY_VOCAB
from makemodel.family import Family, TensorSpec, text_config
from makemodel.vocab import Vocabulary

# The vision markers of Qwen's tokenizer, added after ours for the Qwen3.5 presets (4000..4004), so
# that the image/video ids of the config are real tokens (the real ids are 248053..248057).
VISION_TOKENS = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen3.5's chat format, our own shorter text: ChatML; thinking on unless enable_thinking is false
# (the generation prompt then opens "<think>\n"); reasoning shown for the assistant turns after the
# last user turn, taken from reasoning_content or from a "<think>...</think>" prefix of the
# content; tools listed as JSON in the system turn, calls written as XML
# (<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>, one call per
# tool_call block, non-string values as JSON); tool results as <tool_response> blocks in one user
# turn; image / video parts as vision placeholders. Every tag uses '-' whitespace control, so the
# output does not depend on trim_blocks / lstrip_blocks.
CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif part.type == 'video' or 'video' in part -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
      {%- elif 'text' in part -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set msgs = messages -%}
{%- set system = '' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = render(messages[0].content) | trim -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n# Tools\\n\\nYou have these functions:\\n\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call functions, end your reply with one block per call, in this format:\\n\\n'
      '<tool_call>\\n<function=FUNCTION_NAME>\\n<parameter=PARAMETER_NAME>\\nvalue\\n</parameter>\\n'
      '</function>\\n</tool_call>\\n\\nGive every required parameter; reason before the calls, never '
      'after them. Without a fitting function, answer normally.' -}}
  {%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
  {%- if m.role == 'user' or m.role == 'system' -%}
    {{- '<|im_start|>' + m.role + '\\n' + render(m.content) + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = render(m.content) -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if '</think>' in content -%}
      {%- if not reasoning -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}{%- endif -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- if not loop.first -%}{{- '\\n' -}}{%- elif content | trim -%}{{- '\\n\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}
      {%- if f.arguments is mapping -%}
        {%- for name, value in f.arguments.items() -%}
          {{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}
        {%- endfor -%}
      {%- elif f.arguments -%}
        {{- f.arguments + '\\n' -}}
      {%- endif -%}
      {{- '</function>\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or msgs[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + render(m.content) + '\\n</tool_response>' -}}
    {%- if loop.last or msgs[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- else -%}
    {{- '<think>\\n' -}}
  {%- endif -%}
{%- endif -%}
"""

TOKENIZER = Vocabulary(tuple(VISION_TOKENS), None, CHAT_TEMPLATE)
TOKEN_IDS = TOKENIZER.token_ids
VOCAB_SIZE = TOKENIZER.size  # 4005


def layer_types(num_layers: int, interval: int) -> list[str]:
    """Qwen3.5's schedule: every ``interval``-th layer full attention, the others linear."""
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]


def mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """The (t, h, w) split of the rotary frequencies: 64 rotary dims -> [11, 11, 10] as Qwen's."""
    base, extra = divmod(int(head_dim * partial_rotary_factor) // 2, 3)
    return [base + (i < extra) for i in range(3)]


def text_model(*, tie_word_embeddings: bool, **shapes) -> dict:
    """A ``qwen3_5_text`` config (the text_config of a Hub checkpoint), keys sorted."""
    interval, rotary = 4, 0.25
    config = dict(
        model_type="qwen3_5_text",
        attention_bias=False,
        attention_dropout=0.0,
        attn_output_gate=True,
        full_attention_interval=interval,
        hidden_act="silu",
        initializer_range=0.02,
        layer_types=layer_types(shapes["num_hidden_layers"], interval),
        linear_conv_kernel_dim=4,
        mamba_ssm_dtype="float32",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        pad_token_id=None,
        partial_rotary_factor=rotary,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            mrope_interleaved=True,
            mrope_section=mrope_section(shapes["head_dim"], rotary),
            partial_rotary_factor=rotary,
            rope_theta=10000000,
            rope_type="default",
        ),
        tie_word_embeddings=tie_word_embeddings,
        use_cache=True,
        **IDS,
        **shapes,
    )
    return dict(sorted(config.items()))


def vision_model(**shapes) -> dict:
    config = dict(
        model_type="qwen3_5_vision",
        deepstack_visual_indexes=[],
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        initializer_range=0.02,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        **shapes,
    )
    return dict(sorted(config.items()))


def vlm(text: dict, vision: dict) -> dict:
    """A Qwen3_5ForConditionalGeneration config, laid out as the Hub's."""
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        language_model_only=False,
        text_config=text,
        tie_word_embeddings=text["tie_word_embeddings"],
        torch_dtype="bfloat16",
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_config=vision,
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
    )


TINY_TEXT = text_model(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # rotary dim 4 (partial_rotary_factor 0.25): mrope_section [1, 1, 0]
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=4096,
    tie_word_embeddings=True,  # as Qwen3.5-0.8B
)
# Qwen3.5-0.8B's text_config (Qwen/Qwen3.5-0.8B config.json).
_08B_TEXT = text_model(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
    max_position_embeddings=262144,
    tie_word_embeddings=True,
)

PRESETS: dict[str, dict] = {
    # Qwen3.5 as the Hub ships it (Qwen3_5ForConditionalGeneration), tiny: 3 DeltaNet layers + 1
    # full attention, a 2-block vision tower, one MTP layer, tied embeddings.
    "tiny-qwen3.5": vlm(
        TINY_TEXT,
        vision_model(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_position_embeddings=64,  # an 8 x 8 grid of learned positions
            out_hidden_size=TINY_TEXT["hidden_size"],
        ),
    ),
    # The same text model as a text-only checkpoint (Qwen3_5ForCausalLM: flat config, model.*).
    "tiny-qwen3.5-text": dict(architectures=["Qwen3_5ForCausalLM"], torch_dtype="bfloat16", **TINY_TEXT),
    # Exactly Qwen3.5-0.8B's shapes, vision tower included (tokenizer ours: ids < 4005 only).
    "qwen3.5-0.8b": vlm(
        _08B_TEXT,
        vision_model(
            depth=12,
            hidden_size=768,
            intermediate_size=3072,
            num_heads=12,
            num_position_embeddings=2304,
            out_hidden_size=_08B_TEXT["hidden_size"],
        ),
    ),
}


def dense_mlp(t: dict) -> list[TensorSpec]:
    h, inner = t["hidden_size"], t.get("intermediate_size", 0)
    return [
        ("mlp.down_proj.weight", (h, inner), "normal"),
        ("mlp.gate_proj.weight", (inner, h), "normal"),
        ("mlp.up_proj.weight", (inner, h), "normal"),
    ]


def decoder_layer(t: dict, layer_type: str, mlp: Callable[[dict], list[TensorSpec]]) -> list[TensorSpec]:
    """One Qwen3.5 decoder layer (names relative to the layer) with ``mlp(t)``'s tensors."""
    h = t["hidden_size"]
    if layer_type == "linear_attention":  # Gated DeltaNet
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv  # q, k, v channels, convolved depthwise
        mixer = [
            ("linear_attn.A_log", (nv,), "A_log"),
            ("linear_attn.conv1d.weight", (conv_dim, 1, t["linear_conv_kernel_dim"]), "normal"),
            ("linear_attn.dt_bias", (nv,), "norm"),  # ones, as transformers initialises it
            ("linear_attn.in_proj_a.weight", (nv, h), "normal"),
            ("linear_attn.in_proj_b.weight", (nv, h), "normal"),
            ("linear_attn.in_proj_qkv.weight", (conv_dim, h), "normal"),
            ("linear_attn.in_proj_z.weight", (nv * dv, h), "normal"),
            ("linear_attn.norm.weight", (dv,), "norm"),  # the gated RMSNorm: plain weight
            ("linear_attn.out_proj.weight", (h, nv * dv), "normal"),
        ]
    elif layer_type == "full_attention":
        nq, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        mixer = [
            ("self_attn.k_norm.weight", (hd,), "norm0"),
            ("self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
            ("self_attn.q_norm.weight", (hd,), "norm0"),
            ("self_attn.q_proj.weight", (nq * hd * 2, h), "normal"),  # per head: query, then gate
            ("self_attn.v_proj.weight", (nkv * hd, h), "normal"),
        ]
        if t.get("attention_bias"):  # biases on all four projections, as transformers builds them
            mixer += [
                ("self_attn.k_proj.bias", (nkv * hd,), "normal"),
                ("self_attn.o_proj.bias", (h,), "normal"),
                ("self_attn.q_proj.bias", (nq * hd * 2,), "normal"),
                ("self_attn.v_proj.bias", (nkv * hd,), "normal"),
            ]
    else:
        raise ValueError(f"unknown Qwen3.5 layer type {layer_type!r}")
    return [
        ("input_layernorm.weight", (h,), "norm0"),
        *mixer,
        *mlp(t),
        ("post_attention_layernorm.weight", (h,), "norm0"),
    ]


def tensor_specs(config: dict, mlp: Callable[[dict], list[TensorSpec]] = dense_mlp) -> list[TensorSpec]:
    """Qwen3.5 tensors under the Hub's names: text, then vision tower (VLM only), then MTP."""
    t = text_config(config)
    nested = "text_config" in config
    lm = "model.language_model." if nested else "model."
    h, vocab = t["hidden_size"], t["vocab_size"]
    if len(t["layer_types"]) != t["num_hidden_layers"]:
        raise ValueError(
            f"layer_types has {len(t['layer_types'])} entries for {t['num_hidden_layers']} layers"
        )

    specs: list[TensorSpec] = [(lm + "embed_tokens.weight", (vocab, h), "embed")]
    for i, layer_type in enumerate(t["layer_types"]):
        specs += [(f"{lm}layers.{i}.{n}", s, k) for n, s, k in decoder_layer(t, layer_type, mlp)]
    specs.append((lm + "norm.weight", (h,), "norm0"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, h), "embed"))

    if nested:
        v = config["vision_config"]
        vh, vi, c = v["hidden_size"], v["intermediate_size"], v["in_channels"]
        merged = vh * v["spatial_merge_size"] ** 2
        p = "model.visual."
        specs += [
            (
                p + "patch_embed.proj.weight",
                (vh, c, v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
                "normal",
            ),
            (p + "patch_embed.proj.bias", (vh,), "normal"),
            (p + "pos_embed.weight", (v["num_position_embeddings"], vh), "normal"),
        ]
        for i in range(v["depth"]):
            specs += [
                (f"{p}blocks.{i}.{n}", s, k)
                for n, s, k in [
                    ("attn.proj.bias", (vh,), "normal"),
                    ("attn.proj.weight", (vh, vh), "normal"),
                    ("attn.qkv.bias", (3 * vh,), "normal"),
                    ("attn.qkv.weight", (3 * vh, vh), "normal"),
                    ("mlp.linear_fc1.bias", (vi,), "normal"),
                    ("mlp.linear_fc1.weight", (vi, vh), "normal"),
                    ("mlp.linear_fc2.bias", (vh,), "normal"),
                    ("mlp.linear_fc2.weight", (vh, vi), "normal"),
                    ("norm1.bias", (vh,), "norm0"),
                    ("norm1.weight", (vh,), "norm"),
                    ("norm2.bias", (vh,), "norm0"),
                    ("norm2.weight", (vh,), "norm"),
                ]
            ]
        specs += [
            (p + "merger.linear_fc1.bias", (merged,), "normal"),
            (p + "merger.linear_fc1.weight", (merged, merged), "normal"),
            (p + "merger.linear_fc2.bias", (v["out_hidden_size"],), "normal"),
            (p + "merger.linear_fc2.weight", (v["out_hidden_size"], merged), "normal"),
            (p + "merger.norm.bias", (vh,), "norm0"),
            (p + "merger.norm.weight", (vh,), "norm"),
        ]

    # Multi-token prediction: norm the next token's embedding and the last hidden state, project
    # their concatenation back to h (fc), run full-attention layers, final norm; shares the
    # embeddings and lm_head with the main model.
    n_mtp = t.get("mtp_num_hidden_layers") or 0
    if n_mtp:
        specs.append(("mtp.fc.weight", (h, 2 * h), "normal"))
        for i in range(n_mtp):
            specs += [(f"mtp.layers.{i}.{n}", s, k) for n, s, k in decoder_layer(t, "full_attention", mlp)]
        specs += [
            ("mtp.norm.weight", (h,), "norm0"),
            ("mtp.pre_fc_norm_embedding.weight", (h,), "norm0"),
            ("mtp.pre_fc_norm_hidden.weight", (h,), "norm0"),
        ]
    return specs


def follow_overrides(config: dict, given: set[str]) -> None:
    """What depends on an overridden shape follows it unless given too: ``layer_types`` (from
    ``num_hidden_layers`` and ``full_attention_interval``), the rope's ``mrope_section`` (from
    ``head_dim``) and the vision tower's ``out_hidden_size`` (from ``hidden_size``; ``given``
    names a vision key ``vision.KEY``)."""
    text = text_config(config)
    shapes = ("num_hidden_layers", "full_attention_interval")
    if given & set(shapes) and "layer_types" not in given:
        text["layer_types"] = layer_types(text["num_hidden_layers"], text["full_attention_interval"])
    if given & {"head_dim", "partial_rotary_factor"} and "rope_parameters" not in given:
        rope = text["rope_parameters"]
        rope["partial_rotary_factor"] = text["partial_rotary_factor"]
        rope["mrope_section"] = mrope_section(text["head_dim"], text["partial_rotary_factor"])
    if text is not config and "hidden_size" in given and "vision.out_hidden_size" not in given:
        config["vision_config"]["out_hidden_size"] = text["hidden_size"]


FAMILY = Family(
    name="qwen3_5",
    model_types=frozenset({"qwen3_5", "qwen3_5_text"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=TOKENIZER,
    jittered=frozenset({"tiny-qwen3.5", "tiny-qwen3.5-text"}),
    follow_overrides=follow_overrides,
)
