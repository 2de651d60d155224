"""BertModel (absolute and token-type embeddings, post-LayerNorm, GELU), an embedding model with
mean pooling as all-MiniLM, in the sentence-transformers layout; our byte-level tokenizer."""

from __future__ import annotations

from makemodel import tokenizer_train as tt
from makemodel.families.common import IDS, TINY_VOCAB
from makemodel.family import Family, TensorSpec
from makemodel.vocab import Vocabulary

PRESETS: dict[str, dict] = {
    "tiny-bert": dict(
        architectures=["BertModel"],
        model_type="bert",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=1e-12,
        initializer_range=0.02,
        pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
        torch_dtype="float32",
        **IDS,
    ),
}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """BertModel's tensors (its own names: ``embeddings.*``, ``encoder.layer.N.*``, ``pooler.*``)."""
    h, inner = config["hidden_size"], config["intermediate_size"]
    specs: list[TensorSpec] = [
        ("embeddings.word_embeddings.weight", (config["vocab_size"], h), "embed"),
        ("embeddings.position_embeddings.weight", (config["max_position_embeddings"], h), "normal"),
        ("embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h), "normal"),
        ("embeddings.LayerNorm.weight", (h,), "norm"),
        ("embeddings.LayerNorm.bias", (h,), "norm0"),
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for x in ("query", "key", "value"):
            specs += [(f"{p}attention.self.{x}.weight", (h, h), "normal")]
            specs += [(f"{p}attention.self.{x}.bias", (h,), "normal")]
        specs += [
            (f"{p}attention.output.dense.weight", (h, h), "normal"),
            (f"{p}attention.output.dense.bias", (h,), "normal"),
            (f"{p}attention.output.LayerNorm.weight", (h,), "norm"),
            (f"{p}attention.output.LayerNorm.bias", (h,), "norm0"),
            (f"{p}intermediate.dense.weight", (inner, h), "normal"),
            (f"{p}intermediate.dense.bias", (inner,), "normal"),
            (f"{p}output.dense.weight", (h, inner), "normal"),
            (f"{p}output.dense.bias", (h,), "normal"),
            (f"{p}output.LayerNorm.weight", (h,), "norm"),
            (f"{p}output.LayerNorm.bias", (h,), "norm0"),
        ]
    return specs + [("pooler.dense.weight", (h, h), "normal"), ("pooler.dense.bias", (h,), "normal")]


FAMILY = Family(
    name="bert",
    model_types=frozenset({"bert"}),
    presets=PRESETS,
    tensor_specs=tensor_specs,
    tokenizer=Vocabulary(),
    jittered=frozenset({"tiny-bert"}),
    pooling={"tiny-bert": ("pooling_mode_mean_tokens", False)},
)
