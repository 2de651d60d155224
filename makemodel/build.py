"""A preset's ``config.json`` (``build_config``) and its whole folder (``make_model``)."""

from __future__ import annotations

import copy
from pathlib import Path

from makemodel import tokenizer_train as tt
from makemodel.families import PRESETS, family_of
from makemodel.family import NORM_JITTER, TensorSpec, text_config
from makemodel.sentence_transformers import write_sentence_transformers
from makemodel.vocab import read_vocab, write_vocab
from makemodel.writer import DTYPES, write_json, write_weights

GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


def tensor_specs(config: dict) -> list[TensorSpec]:
    """``(name, shape, kind)`` of every tensor a config needs, in file order, HF names (the kinds:
    ``makemodel.family.TensorSpec``)."""
    return family_of(config).tensor_specs(config)


def _apply_overrides(config: dict, overrides: dict) -> None:
    """Apply config overrides in place.

    A flat config takes them as they are. A nested one (Qwen3.5 VLM) sends a key of its
    ``text_config`` there (``tie_word_embeddings`` to both levels), merges a dict given for
    ``text_config`` / ``vision_config`` into that sub-config, and puts anything else at the top.
    Then the family makes what depends on an overridden key follow it (``Family.follow_overrides``:
    Qwen3.5's ``layer_types``, ``mrope_section`` and vision ``out_hidden_size``, gpt-oss's
    ``layer_types``).
    """
    overrides = copy.deepcopy(overrides)
    text = text_config(config)
    nested = text is not config
    given: set[str] = set()
    for key, value in overrides.items():
        if nested and key in ("text_config", "vision_config") and isinstance(value, dict):
            config[key].update(value)
            given |= set(value) if key == "text_config" else {f"vision.{k}" for k in value}
            if key == "text_config" and "tie_word_embeddings" in value:
                config["tie_word_embeddings"] = value["tie_word_embeddings"]
        elif nested and key in text and key != "model_type":
            text[key] = value
            if key in config:
                config[key] = value
            given.add(key)
        else:
            config[key] = value
            given.add(key)
    follow = family_of(config).follow_overrides
    if follow is not None:
        follow(config, given)


def build_config(preset: str, *, dtype: str | None = None, **config_overrides) -> dict:
    """The HF ``config.json`` contents ``make_model`` writes for a preset (see there)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    config = copy.deepcopy(PRESETS[preset])
    _apply_overrides(config, config_overrides)
    if dtype is not None:
        config["torch_dtype"] = dtype
    if config["torch_dtype"] not in DTYPES:
        raise ValueError(f"unsupported dtype {config['torch_dtype']!r}; use bfloat16, float16 or float32")
    config["torch_dtype"] = DTYPES[config["torch_dtype"]][0]
    config["dtype"] = config["torch_dtype"]  # transformers 5 spelling; 4.x reads torch_dtype
    if "text_config" in config:  # where the Hub's Qwen3.5 configs keep it
        config["text_config"] = dict(sorted({**config["text_config"], "dtype": config["dtype"]}.items()))
    text = text_config(config)
    vocab = family_of(config).tokenizer.size
    if text["vocab_size"] < vocab:
        raise ValueError(f"vocab_size {text['vocab_size']} < tokenizer size {vocab}")
    return dict(sorted(config.items()))


def make_model(
    preset: str,
    out: Path | str,
    *,
    seed: int = 0,
    dtype: str | None = None,
    shard_bytes: int | None = None,
    mxfp4: bool = False,
    gemma_tokenizer: bool = False,
    fast: bool = False,
    vocab: Path | str | None = None,
    **config_overrides,
) -> Path:
    """Write the preset's folder into `out` (created if missing) and return it (as a Path).

    ``seed`` seeds the weights (same seed, same bytes). ``dtype`` (bfloat16 / float16 / float32)
    replaces the preset's. ``shard_bytes`` splits the weights into ``model-0000i-of-0000n``
    shards of at most that many bytes, with ``model.safetensors.index.json``.
    ``mxfp4``: a gpt-oss folder's experts stored as MXFP4 blocks and scales, as the Hub ships them
    (``Family.mxfp4``). ``config_overrides`` replace (or add) keys of the preset's HF config, e.g.
    ``num_hidden_layers=3``, ``tie_word_embeddings=False``, ``rope_scaling={...}``; for a nested
    (Qwen3.5 VLM) config see ``_apply_overrides``. ``gemma_tokenizer``: a Gemma 4 folder with
    Gemma's kind of tokenizer (``Family.converter_tokenizer``), which llama.cpp's converter takes.
    ``fast``: the weights are windows of one pool of random values (``writer._tensor_chunks``),
    written at the disk's speed: for timing runs (an 8B folder in seconds), not for reference tests.
    ``vocab``: a GGUF file (llama.cpp's ``ggml-vocab-*.gguf``, or any model's) whose vocabulary
    replaces the preset's tokenizer (``vocab.write_vocab``): ``vocab_size`` and the BOS/EOS ids
    follow it.
    """
    real = read_vocab(vocab) if vocab is not None else None
    if real is not None:
        config_overrides = {**real.overrides, **config_overrides}
    config = build_config(preset, dtype=dtype, **config_overrides)
    family = family_of(config)
    tokenizer = family.tokenizer
    if gemma_tokenizer:
        if family.converter_tokenizer is None:
            raise ValueError("gemma_tokenizer is for the Gemma 4 presets")
        tokenizer = family.converter_tokenizer
    write_mxfp4 = family.mxfp4 if mxfp4 else None
    if mxfp4 and write_mxfp4 is None:
        raise ValueError("mxfp4 folders are gpt-oss's only")
    if mxfp4 and shard_bytes:
        raise ValueError("mxfp4 folders are written unsharded")
    text = text_config(config)
    max_length = text["max_position_embeddings"]

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    tokenizer.write(out, max_length)
    real_vocab = tokenizer.size
    endoftext = tt.TOKEN_IDS["<|endoftext|>"]
    generation = dict(
        bos_token_id=text["bos_token_id"],
        eos_token_id=[*(family.turn_ends or [text["eos_token_id"]]), endoftext],
        pad_token_id=endoftext,
        **GENERATION_DEFAULTS,
    )
    if real is not None:
        real_vocab = write_vocab(out, real, max_length)
        generation["eos_token_id"] = real.eos_ids
    write_json(out / "generation_config.json", generation)
    write_weights(
        out,
        family.tensor_specs(config),
        config["torch_dtype"],
        seed=seed,
        jitter=NORM_JITTER if preset in family.jittered else 0.0,
        real_vocab=real_vocab,
        shard_bytes=shard_bytes,
        fast=fast,
        whole=None if write_mxfp4 is None else lambda chunks_of: write_mxfp4(out, config, chunks_of, fast),
    )
    if preset in family.pooling:
        write_sentence_transformers(out, config, *family.pooling[preset])
    return out
