"""Gemma 4's text model (Gemma4ForCausalLM, transformers 5's gemma4_text).

Tiny: six layers (two sliding with a 16-token window, a global, two sliding, a global), and every
text feature of the family switched on at once, so that each test exercises all of them: global
layers with their own head dim and KV heads, K as V (attention_k_eq_v), proportional RoPE,
per-layer embeddings (P = 16), the last two layers sharing the KV of layers 3 and 2 with a
double-wide MLP. ``tiny-gemma4-moe`` adds the 26B-A4B's routed experts beside each dense MLP. The
tokenizer is ours plus Gemma 4's turn and channel markers (special, ids 4000-4004), and the chat
template writes Gemma 4's turn format (our text; ../shared/specs/gemma-4-31B-it.chat_template.jinja
is the shipped one): <turn|> ends a turn and is the EOS, the assistant's role is "model", a system
turn first when there is a system message or thinking is on (then it starts with <|think|>), and
without thinking the generation prompt closes an empty thought channel.
"""

from __future__ import annotations

import functools
import json

from makemodel import tokenizer_train as tt
from makemodel.families.common import TINY_VOCAB
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary

MARKERS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]

# Gemma 4's turn format in our own words (see the block's comment).
CHAT_TEMPLATE = """\
{%- macro render(content) -%}
  {%- if content is string -%}{{- content | trim -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if 'text' in part -%}{{- part.text | trim -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{{- bos_token -}}
{%- set msgs = messages -%}
{%- if thinking or (messages and messages[0].role in ['system', 'developer']) -%}
  {{- '<|turn>system\\n' -}}
  {%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}
  {%- if messages and messages[0].role in ['system', 'developer'] -%}
    {{- render(messages[0].content) -}}
    {%- set msgs = messages[1:] -%}
  {%- endif -%}
  {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for m in msgs -%}
  {{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + render(m.content) + '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|turn>model\\n' -}}
  {%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""

TOKENIZER = Vocabulary(tuple(MARKERS), "<turn|>", CHAT_TEMPLATE)
TOKEN_IDS = TOKENIZER.token_ids
VOCAB_SIZE = TOKENIZER.size  # 4005


def text_model(**shapes) -> dict:
    """A ``gemma4_text`` config in the Hub's spelling (``global_head_dim``,
    ``num_global_key_value_heads``, ``rope_parameters`` by layer kind), keys sorted."""
    config = dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
        eos_token_id=TOKEN_IDS["<turn|>"],
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.02,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_bidirectional_attention=None,
        use_cache=True,
        **shapes,
    )
    return dict(sorted(config.items()))


_S, _F = "sliding_attention", "full_attention"
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    layer_types=[_S, _S, _F, _S, _S, _F],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=16,
    hidden_size_per_layer_input=16,  # a multiple of 16: int8 layers keep torch's kernel (workers/quant.py)
    vocab_size_per_layer_input=TINY_VOCAB,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    enable_moe_block=False,
    num_experts=None,
    top_k_experts=None,
    moe_intermediate_size=None,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=4096,
)
PRESETS: dict[str, dict] = {
    "tiny-gemma4": text_model(**_TINY),
    "tiny-gemma4-moe": text_model(
        **{
            **_TINY,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        }
    ),
}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Gemma 4's text model (``Gemma4ForCausalLM`` names, transformers 5's stacked experts); every
    norm is plain (``x * w``), and so are ``layer_scalar`` and the router's scales."""
    from pantheon.core.archs.gemma4 import describe

    d = describe(config, {}, "config", "gemma4")
    h, nq, p, n = d.hidden_size, d.num_heads, d.ple_dim, d.num_layers
    specs: list[TensorSpec] = [("model.embed_tokens.weight", (d.vocab_size, h), "embed")]
    if p:
        specs += [
            ("model.embed_tokens_per_layer.weight", (d.ple_vocab, n * p), "embed"),
            ("model.per_layer_model_projection.weight", (n * p, h), "normal"),
            ("model.per_layer_projection_norm.weight", (p,), "norm"),
        ]
    for i, a in enumerate(d.attn):
        pre, hd, kv, inner = f"model.layers.{i}.", a.head_dim, a.kv_heads * a.head_dim, a.intermediate
        layer = [
            ("input_layernorm.weight", (h,), "norm"),
            ("self_attn.q_proj.weight", (nq * hd, h), "normal"),
        ]
        if a.shares is None:
            layer.append(("self_attn.k_proj.weight", (kv, h), "normal"))
            if not a.k_eq_v:
                layer.append(("self_attn.v_proj.weight", (kv, h), "normal"))
        layer += [
            ("self_attn.o_proj.weight", (h, nq * hd), "normal"),
            ("self_attn.q_norm.weight", (hd,), "norm"),
        ]
        if a.shares is None:
            layer.append(("self_attn.k_norm.weight", (hd,), "norm"))
        layer += [
            ("post_attention_layernorm.weight", (h,), "norm"),
            ("pre_feedforward_layernorm.weight", (h,), "norm"),
            ("mlp.gate_proj.weight", (inner, h), "normal"),
            ("mlp.up_proj.weight", (inner, h), "normal"),
            ("mlp.down_proj.weight", (h, inner), "normal"),
            ("post_feedforward_layernorm.weight", (h,), "norm"),
            ("layer_scalar", (1,), "norm"),
        ]
        ex = d.moe_experts
        if ex is not None:
            layer += [
                ("router.proj.weight", (ex.count, h), "normal"),
                ("router.scale", (h,), "norm"),
                ("router.per_expert_scale", (ex.count,), "norm"),
                ("experts.gate_up_proj", (ex.count, 2 * ex.intermediate, h), "normal"),
                ("experts.down_proj", (ex.count, h, ex.intermediate), "normal"),
                ("post_feedforward_layernorm_1.weight", (h,), "norm"),
                ("pre_feedforward_layernorm_2.weight", (h,), "norm"),
                ("post_feedforward_layernorm_2.weight", (h,), "norm"),
            ]
        if p:
            layer += [
                ("per_layer_input_gate.weight", (p, h), "normal"),
                ("per_layer_projection.weight", (h, p), "normal"),
                ("post_per_layer_input_norm.weight", (h,), "norm"),
            ]
        specs += [(pre + name, shape, kind) for name, shape, kind in layer]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not d.tie_word_embeddings:
        specs.append(("lm_head.weight", (d.vocab_size, h), "embed"))
    return specs


# Gemma's own kind of tokenizer, for the Gemma 4 presets written with ``gemma_tokenizer=True``:
# llama.cpp's converter reads a Gemma 4 vocabulary only as one (``gguf.LlamaHfVocab``: a BPE with
# byte fallback and a Sequence decoder) and stores it as its ``gemma4`` tokenizer model, which it
# runs as SentencePiece-style BPE: spaces become U+2581 ("▁"), the text is split only at newline
# runs, merges run over raw UTF-8, and a piece outside the vocabulary falls back to its <0xHH>
# byte tokens. This one is that pipeline trained on our corpus, with the same ids as the default
# one where it matters: ids 0-255 are the byte tokens, the learned pieces run up to
# ``tt.BPE_VOCAB_SIZE``, then ours and Gemma 4's added tokens as in ``TOKENIZER``.
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


@functools.lru_cache(maxsize=1)
def spm_tokenizer_json() -> str:
    """Gemma-style tokenizer (see above): deterministic, trained in a fraction of a second."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from pantheon.core.gguf_tokenizer import GEMMA4_SPLIT  # the split llama.cpp's gemma4 tokenizer makes

    def pipeline(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_SPLIT), behavior="isolated")
        return tok

    learned = pipeline(Tokenizer(models.BPE(byte_fallback=True)))
    trainer = trainers.BpeTrainer(
        vocab_size=tt.BPE_VOCAB_SIZE - 256, min_frequency=2, show_progress=False, special_tokens=[]
    )
    learned.train_from_iterator(tt.corpus_documents(), trainer)
    model = json.loads(learned.to_str())["model"]
    if len(model["vocab"]) != tt.BPE_VOCAB_SIZE - 256:
        raise RuntimeError(f"BPE learned {len(model['vocab'])} tokens, wanted {tt.BPE_VOCAB_SIZE - 256}")
    vocab = {t: i for i, t in enumerate(BYTE_TOKENS)}
    vocab.update((t, 256 + i) for t, i in model["vocab"].items())
    merges = [tuple(m) for m in model["merges"]]
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    for content, special in [*tt.ADDED_TOKENS, *((t, True) for t in MARKERS)]:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    want = {**tt.TOKEN_IDS, **TOKEN_IDS}
    if (ids := {t: tok.token_to_id(t) for t in want}) != want:
        raise RuntimeError(f"added token ids {ids} differ from {want}")
    bos = tt.BOS_TOKEN  # prepended, as Gemma's tokenizer (and llama.cpp's gemma4) does
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tt.TOKEN_IDS[bos])]
    )
    return tok.to_str(pretty=True)


class SpmVocabulary(Vocabulary):
    """``TOKENIZER``'s markers, EOS and template in Gemma's kind of tokenizer (see above)."""

    def json(self) -> str:
        return spm_tokenizer_json()

    def config(self, model_max_length: int) -> dict:
        """Gemma's tokenizer class (so transformers keeps the file's pipeline), BOS added, no mask
        token, and the special added tokens listed (``extra_special_tokens``: what transformers,
        and so the converter, counts as special; it still marks Gemma 4's channel markers
        user-defined, as for the real model)."""
        config = super().config(model_max_length)
        special = [t for t, s in tt.ADDED_TOKENS if s] + MARKERS
        return config | {
            "tokenizer_class": "GemmaTokenizer",
            "add_bos_token": True,
            "mask_token": None,
            "extra_special_tokens": [t for t in special if t not in (tt.BOS_TOKEN, "<turn|>")],
        }


SPM_TOKENIZER = SpmVocabulary(TOKENIZER.markers, TOKENIZER.eos, TOKENIZER.template)

FAMILY = Family(
    name="gemma4",
    model_types=frozenset({"gemma4", "gemma4_text"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=TOKENIZER,
    jittered=frozenset({"tiny-gemma4", "tiny-gemma4-moe"}),
    converter_tokenizer=SPM_TOKENIZER,
)
