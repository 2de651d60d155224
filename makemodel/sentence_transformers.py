"""The sentence-transformers layout of an embedding preset's folder.

modules.json: the Transformer at the root, a Pooling module in 1_Pooling/ and, when it
normalises, a Normalize module; loadable as it is by sentence-transformers' SentenceTransformer.
"""

from __future__ import annotations

import json
from pathlib import Path

from makemodel.writer import write_json

_MODES = (
    "cls_token",
    "mean_tokens",
    "max_tokens",
    "mean_sqrt_len_tokens",
    "weightedmean_tokens",
    "lasttoken",
)


def write_sentence_transformers(out: Path, config: dict, mode: str, normalize: bool) -> None:
    """The sentence-transformers files: ``mode`` is the pooling (``pooling_mode_lasttoken``...)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    pooling = {f"pooling_mode_{m}": f"pooling_mode_{m}" == mode for m in _MODES}
    (out / "1_Pooling").mkdir(exist_ok=True)
    write_json(
        out / "1_Pooling" / "config.json",
        {"word_embedding_dimension": config["hidden_size"], **pooling, "include_prompt": True},
    )
    write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": config["max_position_embeddings"], "do_lower_case": False},
    )
