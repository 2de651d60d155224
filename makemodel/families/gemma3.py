"""Gemma 3's text model (Gemma3ForCausalLM, as Gemma 3 1B ships): five sliding-window layers to one
global, each kind with its own RoPE base; four zero-centred norms per layer plus q/k norms; GeGLU.
The tokenizer is ours plus Gemma's turn markers (special, ids 4000, 4001; Gemma's own are 105,
106), and the chat template writes Gemma 3's turn format (our text: the shipped template is not
in ../shared/specs; <end_of_turn> ends a turn and is the EOS, the assistant's role is "model").
"""

from __future__ import annotations

from makemodel import tokenizer_train as tt
from makemodel.families.common import TINY_VOCAB
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary

TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]

# Gemma 3's turn format, our own text: an optional system message is folded into the first user
# turn, the assistant's role is "model", each turn ends "<end_of_turn>\n"; text parts of list
# contents are joined, image parts become Gemma's image marker (which this tokenizer lacks).
CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content | trim -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part.type == 'image' or 'image_url' in part -%}{{- '<start_of_image>' -}}
      {%- elif 'text' in part -%}{{- part.text | trim -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set msgs = messages -%}
{%- set prefix = '' -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set prefix = render(messages[0].content) + '\n\n' -%}
  {%- set msgs = messages[1:] -%}
{%- endif -%}
{%- for m in msgs -%}
  {{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' -}}
  {%- if loop.first -%}{{- prefix -}}{%- endif -%}
  {{- render(m.content) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

TOKENIZER = Vocabulary(tuple(TURN_TOKENS), "<end_of_turn>", CHAT_TEMPLATE)
TOKEN_IDS = TOKENIZER.token_ids
VOCAB_SIZE = TOKENIZER.size  # 4002


def text_model(**shapes) -> dict:
    """A ``gemma3_text`` config as the Hub writes Gemma 3 1B's (transformers 4 spelling), keys sorted."""
    config = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=None,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=TOKEN_IDS["<end_of_turn>"],
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.02,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-6,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        rope_theta=1000000.0,
        sliding_window_pattern=6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


PRESETS: dict[str, dict] = {
    # Gemma 3, tiny: six layers (five sliding with a 16-token window, one global), so that
    # prompts a few dozen tokens long go past the window; query_pre_attn_scalar is the head dim
    # (as Gemma 3 1B/4B/12B, and as llama.cpp assumes for a GGUF file).
    "tiny-gemma3": text_model(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=4096,
    ),
}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Gemma 3's text model (``Gemma3ForCausalLM`` names); every norm is zero-centred."""
    h, inner = config["hidden_size"], config["intermediate_size"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (config["vocab_size"], h), "embed")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm0"),
            (p + "self_attn.q_proj.weight", (nq * hd, h), "normal"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.o_proj.weight", (h, nq * hd), "normal"),
            (p + "self_attn.q_norm.weight", (hd,), "norm0"),
            (p + "self_attn.k_norm.weight", (hd,), "norm0"),
            (p + "post_attention_layernorm.weight", (h,), "norm0"),
            (p + "pre_feedforward_layernorm.weight", (h,), "norm0"),
            (p + "mlp.gate_proj.weight", (inner, h), "normal"),
            (p + "mlp.up_proj.weight", (inner, h), "normal"),
            (p + "mlp.down_proj.weight", (h, inner), "normal"),
            (p + "post_feedforward_layernorm.weight", (h,), "norm0"),
        ]
    specs.append(("model.norm.weight", (h,), "norm0"))
    if not config.get("tie_word_embeddings", True):
        specs.append(("lm_head.weight", (config["vocab_size"], h), "embed"))
    return specs


FAMILY = Family(
    name="gemma3",
    model_types=frozenset({"gemma3", "gemma3_text"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=TOKENIZER,
    jittered=frozenset({"tiny-gemma3"}),
)
