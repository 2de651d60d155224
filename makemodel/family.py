"""What a model family gives ``make_model``: its presets, its tensors and its tokenizer.

Each family is a module of ``makemodel/families/`` named as its twin in ``pantheon/core/archs/``
(the description the engine reads back) and ``workers/models/`` (the torch layers); its
``FAMILY`` is one line of ``makemodel.families.FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from makemodel.vocab import Vocabulary
from makemodel.writer import ChunksOf

# (HF tensor name, shape, kind). ``kind`` is ``"normal"`` (std 0.02: linears, convolutions,
# biases), ``"embed"`` (std 0.02 for the tokenizer's ids, zero rows for the padding ids past it),
# ``"norm"`` (a norm weight applied as ``x * w``: ones), ``"norm0"`` (a zero-centred norm weight,
# ``x * (1 + w)``, or a LayerNorm bias: zeros) or ``"A_log"`` (a DeltaNet's decay: log of
# uniform(0.01, 16), as transformers').
TensorSpec = tuple[str, tuple[int, ...], str]

# Std of the random multiplicative jitter on norm weights (1 + jitter * N(0, 1)) of a family's
# ``jittered`` presets (the tiny ones), so that a wrong norm implementation shows up in tests;
# the others get plain ones.
NORM_JITTER = 0.1


@dataclass(frozen=True)
class Family:
    name: str  # as the module under pantheon/core/archs/ and workers/models/
    model_types: frozenset[str]  # the config.json model_types it writes (top level)
    presets: Mapping[str, dict]  # preset name -> HF config.json contents
    tensor_specs: Callable[[dict], list[TensorSpec]]  # every tensor a config needs, in file order
    tokenizer: Vocabulary  # tokenizer.json and tokenizer_config.json of its folders
    jittered: frozenset[str] = frozenset()  # presets whose norm weights get NORM_JITTER
    # embedding presets -> (sentence-transformers pooling mode, normalised): their folders get
    # the sentence-transformers files (makemodel.sentence_transformers)
    pooling: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    # generation_config.json's EOS ids before <|endoftext|>; empty: the config's eos_token_id
    turn_ends: tuple[int, ...] = ()
    # After config overrides: make what depends on an overridden key follow it, unless it was
    # given too (``(config, keys given)``; Qwen3.5's layer_types after num_hidden_layers).
    follow_overrides: Callable[[dict, set[str]], None] | None = None
    # The tokenizer ``make_model(gemma_tokenizer=True)`` writes instead (Gemma 4's own kind).
    converter_tokenizer: Vocabulary | None = None
    # Writes the folder's weights with its experts as MXFP4 (``make_model(mxfp4=True)``;
    # gpt-oss): ``mxfp4(out, config, chunks_of, fast)``, ``chunks_of`` as ``writer.write_weights``'.
    mxfp4: Callable[[Path, dict, ChunksOf, bool], None] | None = None


def text_config(config: dict) -> dict:
    """The text model's part of a config: its ``text_config`` if nested (Qwen3.5 VLM), else itself."""
    return config.get("text_config", config)
