"""Which models embed, and how: read torch-free from a model folder (the router and the worker
both call it through ``description.read_description``).

- A **sentence-transformers layout** (``modules.json`` listing a ``Pooling`` module, whose
  ``config.json`` says ``pooling_mode_*``, and maybe a ``Normalize`` module): Qwen3-Embedding
  (last token), all-MiniLM (mean), bge (CLS). That pooling and normalisation are the model's.
- A **BERT** checkpoint without that layout: mean pooling, not normalised (sentence-transformers'
  default for a plain Hugging Face model).
- A **GGUF file** whose ``<arch>.pooling_type`` says how (llama.cpp's: 1 mean, 2 CLS, 3 last;
  0 none and 4 rank are not embeddings): normalised, as llama.cpp's server answers by default.
- **Any chat model** whose load asks for it (``embeddings: true``): mean pooling, normalised.

``dimensions`` (truncation then renormalisation, OpenAI's Matryoshka parameter) is allowed only
for a model trained for it: ``config.json``'s ``is_matryoshka: true`` or
``matryoshka_dimensions`` (then only those sizes), as vLLM reads them.

A sentence-transformers folder's ``sentence_bert_config.json`` gives ``max_seq_length``: a text
is cut to that many tokens (its special tokens included), as ``SentenceTransformer.encode`` cuts
it. (Its ``tokenizer.json`` may say otherwise, padding and truncating to some fixed length:
``pantheon.models.assets`` turns both off, since a tokenizer file's padding reaching the encoder
would be pooled as if it were text.)

Base models whose ``architectures`` name the model without its head (``Qwen3Model``,
``Qwen2Model``, ``LlamaModel``, ``MistralModel``, as sentence-transformers saves them and vLLM
serves them as embedding models) embed: with the folder's sentence-transformers pooling, else
``BASE_MODEL`` (the last token, normalised: vLLM's default for a decoder), and never generate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Pooling = Literal["last", "mean", "cls"]  # the same names as pantheon.core.protocol.Pooling

# sentence-transformers' pooling_mode_* keys -> ours (the others: max, mean_sqrt_len, weightedmean)
_ST_MODES: dict[str, Pooling] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


class EmbeddingError(Exception):
    """A sentence-transformers layout that cannot be served (``kind``: invalid | unsupported)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class EmbeddingSpec:
    """How a model embeds: its pooling, whether the vector is L2-normalised, and the sizes
    ``dimensions`` may ask for (None: none; ``()``: any size up to the hidden size)."""

    pooling: Pooling
    normalize: bool
    matryoshka: tuple[int, ...] | None = None
    max_tokens: int | None = None  # sentence_bert_config.json's max_seq_length: longer texts are cut


def matryoshka_of(raw: dict) -> tuple[int, ...] | None:
    """The ``dimensions`` a ``config.json`` allows (see the module docstring)."""
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(dims))
    return () if raw.get("is_matryoshka") is True else None


def read_sentence_transformers(folder: Path, raw: dict) -> EmbeddingSpec | None:
    """The embedding a sentence-transformers folder declares; None when ``folder`` has no
    ``modules.json`` or it lists no ``Pooling`` module."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EmbeddingError("invalid", f"{modules_path}: not valid JSON ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EmbeddingError("invalid", f"{modules_path}: not a list of modules")
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return None
    cfg_path = folder / str(pooling.get("path") or "") / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EmbeddingError(
            "invalid", f"{cfg_path}: the Pooling module's config cannot be read ({e})"
        ) from None
    on = (
        [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        if isinstance(cfg, dict)
        else []
    )
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise EmbeddingError(
            "unsupported",
            f"{cfg_path}: pooling {', '.join(on) or 'none'} is not supported (one of {', '.join(_ST_MODES)})",
        )
    if cfg.get("include_prompt", True) is not True:
        raise EmbeddingError("unsupported", f"{cfg_path}: include_prompt false is not supported")
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    return EmbeddingSpec(_ST_MODES[on[0]], normalize, matryoshka_of(raw), _max_seq_length(folder))


def _max_seq_length(folder: Path) -> int | None:
    """``sentence_bert_config.json``'s ``max_seq_length`` (None: no such file or value)."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EmbeddingError("invalid", f"{path}: not valid JSON ({e})") from None
    n = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise EmbeddingError("invalid", f"{path}: max_seq_length must be a positive integer, got {n!r}")
    return n


_GGUF_POOLING: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*


def gguf_embedding(meta: dict) -> EmbeddingSpec | None:
    """The embedding a GGUF file's metadata declares (``<arch>.pooling_type``), else None."""
    arch = meta.get("general.architecture", "")
    kind = meta.get(f"{arch}.pooling_type")
    if not isinstance(kind, int) or isinstance(kind, bool) or kind not in _GGUF_POOLING:
        return None
    return EmbeddingSpec(_GGUF_POOLING[kind], True)


ASKED = EmbeddingSpec("mean", True)
"""A chat model loaded with ``embeddings: true``."""

BASE_MODEL = EmbeddingSpec("last", True)
"""A decoder saved as its base model (``Qwen3Model``...) without a sentence-transformers layout."""


def served_embedding(own: EmbeddingSpec | None, asked: bool) -> EmbeddingSpec | None:
    """How an instance embeds: its model's own embedding, else mean pooling when its load asked
    for embeddings, else None (it cannot embed)."""
    if own is not None:
        return own
    return ASKED if asked else None
