"""The model's shape, read once from a Hugging Face ``config.json`` or a GGUF file's metadata
(``pantheon.models.gguf`` turns it into the same dict). No torch here.

Supports the Llama family as transformers names it: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``
(q/k/v biases) and ``Qwen3ForCausalLM`` (per-head q/k RMSNorm). RoPE settings come in two
styles: the older ``rope_theta`` + ``rope_scaling`` pair, and transformers 5's
``rope_parameters``; either may say ``type`` or ``rope_type``.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from pantheon.models.gguf import GGUFError, GGUFFile, find_gguf, hf_config, read_gguf
from pantheon.protocol import LoadFailKind
from workers.errors import LoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = {"default", "linear", "dynamic", "llama3", "yarn"}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; ``scaling`` holds the type-specific fields (factor, ...)."""

    theta: float = 10000.0
    type: str = "default"
    scaling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2 always, Llama/Qwen3 when attention_bias is set)
    o_bias: bool  # o_proj bias: Llama/Qwen3 with attention_bias; never in Qwen2
    qk_norm: bool  # Qwen3's per-head RMSNorm on q and k
    torch_dtype: str  # the checkpoint's dtype name: bfloat16 | float16 | float32
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantized_source: bool = False  # a GGUF file whose weights are all stored quantized
    int4_source: bool = False  # ... and its decoder linears in 4-bit groups of 32 (Q4_0/Q4_1/Q4_K)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes


def _rope_from(raw: dict, where: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    src = {}
    if isinstance(params, dict):
        src = dict(params)
    if isinstance(scaling, dict):
        src.update(scaling)
    if theta is None:
        theta = src.get("rope_theta", 10000.0)
    rope_type = src.pop("rope_type", None) or src.pop("type", None) or "default"
    src.pop("rope_type", None)
    src.pop("type", None)
    src.pop("rope_theta", None)
    if rope_type not in ROPE_TYPES:
        raise LoadError(
            "unsupported",
            f"{where}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(sorted(ROPE_TYPES))})",
        )
    if rope_type != "default" and "factor" not in src:
        raise LoadError("invalid", f"{where}: rope_scaling type {rope_type!r} needs 'factor'")
    return RopeConfig(theta=float(theta), type=rope_type, scaling=src)


def _eos_ids(raw: dict, gen: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen, raw):
        v = src.get("eos_token_id")
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def load_config(model_path: str | Path) -> ModelConfig:
    """Read and check a model's config: a Hugging Face folder's ``config.json`` (and
    ``generation_config.json`` for EOS ids), or a GGUF file's metadata (the file, or the one
    ``.gguf`` in a folder)."""
    model_path = Path(model_path)
    with gguf_errors():
        found = find_gguf(model_path)
        if found is not None:
            return gguf_config(read_gguf(found))
    if not model_path.is_dir():
        raise LoadError("not_found", f"{model_path}: no such model folder or .gguf file")
    path = model_path / "config.json"
    if not path.is_file():
        raise LoadError("not_found", f"{path}: missing config.json (and no .gguf file)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError("invalid", f"{path}: not valid JSON ({e})") from None
    gen_path = model_path / "generation_config.json"
    gen = {}
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise LoadError("invalid", f"{gen_path}: not valid JSON ({e})") from None
    return config_from_dict(raw, gen, str(path))


@contextmanager
def gguf_errors():
    """``GGUFError`` (pantheon.models.gguf) raised inside becomes the same ``LoadError``."""
    try:
        yield
    except GGUFError as e:
        raise LoadError(cast(LoadFailKind, e.kind), e.reason) from None  # a subset of the kinds


def gguf_config(g: GGUFFile) -> ModelConfig:
    """The config of a parsed GGUF file (its metadata as a ``config.json``, checked as one)."""
    with gguf_errors():
        raw = hf_config(g)
    return config_from_dict(raw, {}, f"{g.path} (GGUF metadata)")


def config_from_dict(raw: dict, gen: dict, where: str) -> ModelConfig:
    """Check a ``config.json`` dict (``gen``: ``generation_config.json``, for EOS ids); errors
    name ``where``."""
    if not isinstance(raw, dict):
        raise LoadError("invalid", f"{where}: not a JSON object")
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise LoadError(
            "unsupported",
            f"{where}: field 'architectures' is {archs!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES),
        )

    def need(key: str, kind=int):
        if key not in raw:
            raise LoadError("invalid", f"{where}: missing field {key!r}")
        v = raw[key]
        if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise LoadError("invalid", f"{where}: field {key!r} must be a positive integer, got {v!r}")
        return v

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise LoadError(
            "invalid",
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
        )
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise LoadError("unsupported", f"{where}: field 'torch_dtype' {dtype!r} is not supported")
    return ModelConfig(
        arch=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope=_rope_from(raw, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        torch_dtype=dtype,
        quantized_source=bool(raw.get("quantized_source", False)),
        int4_source=bool(raw.get("int4_source", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw, gen),
    )
