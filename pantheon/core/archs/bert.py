"""The BERT family's description (``BertModel``: all-MiniLM, bge, e5): an encoder that only
embeds. Every layer is bidirectional self-attention over the whole input (no KV cache: nothing
is kept between steps, so its cache spec is an empty per-slot state) and a GELU MLP, each
followed by a LayerNorm (post-norm); absolute position and token-type embeddings are added to
the word embeddings, then normalised. Its embedding is sentence-transformers' (the folder's
``modules.json``) or, without that layout, mean pooling as sentence-transformers defaults to
(``pantheon/core/embedding.py``); a GGUF file's is its ``bert.pooling_type``, normalised, as
llama.cpp serves it. Torch side: ``workers/models/bert.py``."""

from __future__ import annotations

from dataclasses import dataclass

from pantheon.core.archs import Family
from pantheon.core.description import (
    LayerSpec,
    ModelDescription,
    ModelError,
    RecurrentState,
    RopeConfig,
    pos_int,
    torch_dtype,
)
from pantheon.core.embedding import EmbeddingSpec
from pantheon.core.gguf import GGUFError, GGUFFile, _field

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True, kw_only=True)
class BertDescription(ModelDescription):
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str  # gelu (erf) | gelu_new / gelu_pytorch_tanh (tanh)


def describe(raw: dict, gen: dict, where: str, arch: str) -> BertDescription:
    hidden = pos_int(raw, "hidden_size", where)
    heads = pos_int(raw, "num_attention_heads", where)
    if hidden % heads:
        raise ModelError("invalid", f"{where}: hidden_size {hidden} is not a multiple of {heads} heads")
    inter = pos_int(raw, "intermediate_size", where)
    layers = pos_int(raw, "num_hidden_layers", where)
    act = raw.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ModelError(
            "unsupported", f"{where}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})"
        )
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelError(
            "unsupported", f"{where}: position_embedding_type {kind!r} is not supported (absolute)"
        )
    # q, k, v fused; output; MLP up and down. small: their biases and the two LayerNorms.
    small = 3 * hidden + hidden + inter + hidden + 4 * hidden
    spec = LayerSpec(
        kind="attention",
        linears=((3 * hidden, hidden), (hidden, hidden), (inter, hidden), (hidden, inter)),
        small=small,
        cache=RecurrentState(()),  # no cache: each pass reads its whole input at once
    )
    return BertDescription(
        family="bert",
        arch=arch,
        vocab_size=pos_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        max_position_embeddings=pos_int(raw, "max_position_embeddings", where, default=512),
        rope=RopeConfig(),  # unused: positions are learned embeddings
        tie_word_embeddings=True,  # no head: never asked for logits
        torch_dtype=torch_dtype(raw, where),
        bos_token_id=None,
        eos_token_ids=(),
        layers=tuple(spec for _ in range(layers)),
        embedding=EmbeddingSpec("mean", False),
        can_generate=False,
        type_vocab_size=pos_int(raw, "type_vocab_size", where, default=2),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        hidden_act=act,
    )


def gguf_config(g: GGUFFile, raw: dict) -> None:
    """A ``bert`` GGUF file's own fields, as llama.cpp's converter writes them
    (``conversion/bert.py``): ``attention.layer_norm_epsilon``; the token-type table's rows
    (``token_types.weight``, else ``tokenizer.ggml.token_type_count``). The activation is not
    stored: BERT's is GELU (erf), as ``BertModel``'s default. ``attention.causal`` must be false:
    the family is bidirectional."""
    a = g.arch
    if g.meta.get(f"{a}.attention.causal") is True:
        raise GGUFError(
            "unsupported", f"{g.path}: metadata field '{a}.attention.causal' is true (BERT is bidirectional)"
        )
    types = g.tensors.get("token_types.weight")
    raw.update(
        layer_norm_eps=float(_field(g, f"{a}.attention.layer_norm_epsilon", float, 1e-12)),
        type_vocab_size=types.shape[0]
        if types is not None and len(types.shape) == 2
        else _field(g, "tokenizer.ggml.token_type_count", default=2),
        hidden_act="gelu",
    )


FAMILY = Family(
    name="bert",
    hf_architectures={"BertModel": "bert"},
    model_types={"bert": "bert"},
    gguf_architectures={"bert": ("BertModel", "bert")},
    describe=describe,
    gguf_config=gguf_config,
)
