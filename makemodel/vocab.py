"""The tokenizer files of a folder: ours plus a family's markers (``Vocabulary``), or a real
vocabulary read from a GGUF file (``RealVocab``)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from makemodel import tokenizer_train as tt
from makemodel.writer import write_json


@dataclass(frozen=True)
class Vocabulary:
    """Our trained tokenizer plus a family's ``markers`` as special tokens (ids from
    ``tt.VOCAB_SIZE`` on, in their order), ``eos`` as its EOS token (None: ours) and its chat
    template."""

    markers: tuple[str, ...] = ()
    eos: str | None = None
    template: str = tt.CHAT_TEMPLATE

    @property
    def size(self) -> int:
        """The ids the tokenizer produces: embedding rows from here on are zero."""
        return tt.VOCAB_SIZE + len(self.markers)

    @property
    def token_ids(self) -> dict[str, int]:
        """Our added tokens' ids and the markers'."""
        return {**tt.TOKEN_IDS, **{t: tt.VOCAB_SIZE + i for i, t in enumerate(self.markers)}}

    def json(self) -> str:
        """``tokenizer.json``."""
        return _tokenizer_with_specials(self.markers) if self.markers else tt.tokenizer_json()

    def config(self, model_max_length: int) -> dict:
        """``tokenizer_config.json``: the markers as special added tokens, the EOS, the template."""
        config = tt.tokenizer_config(model_max_length)
        for i, content in enumerate(self.markers):
            config["added_tokens_decoder"][str(tt.VOCAB_SIZE + i)] = {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        if self.eos is not None:
            config["eos_token"] = self.eos
        config["chat_template"] = self.template
        return config

    def write(self, out: Path, model_max_length: int) -> None:
        (out / "tokenizer.json").write_text(self.json(), encoding="utf-8")
        write_json(out / "tokenizer_config.json", self.config(model_max_length))


@functools.lru_cache(maxsize=8)
def _tokenizer_with_specials(tokens: tuple[str, ...]) -> str:
    """Our trained tokenizer plus ``tokens`` as special tokens, ids from ``tt.VOCAB_SIZE`` on in
    their order."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tt.tokenizer_json())
    for content in tokens:  # one by one: ids in list order
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    want = {t: tt.VOCAB_SIZE + i for i, t in enumerate(tokens)}
    ids = {t: tok.token_to_id(t) for t in tokens}
    if ids != want:
        raise RuntimeError(f"added token ids {ids} differ from {want}")
    return tok.to_str(pretty=True)


# ------------------------------------------------------------------------------ a real vocabulary


@dataclass(frozen=True)
class RealVocab:
    """A GGUF file's vocabulary for ``make_model(vocab=...)``: its ``tokenizers`` JSON (exact:
    ``pantheon.core.gguf_tokenizer``), size, special tokens and chat template."""

    path: Path
    tokenizer_json: str
    size: int
    specials: dict[str, str]  # bos_token, eos_token, unk_token, pad_token: those the file names
    bos_id: int | None
    eos_ids: list[int]
    template: str | None

    @property
    def overrides(self) -> dict:
        """The config keys that follow the vocabulary."""
        out: dict = {"vocab_size": self.size}
        if self.eos_ids:
            out["eos_token_id"] = self.eos_ids[0]
        if self.bos_id is not None:
            out["bos_token_id"] = self.bos_id
        return out


def read_vocab(path: Path | str) -> RealVocab:
    from pantheon.core.gguf import chat_template, eos_token_ids, read_gguf, special_tokens, token_id
    from pantheon.core.gguf_tokenizer import tokenizer_json

    g = read_gguf(path)
    return RealVocab(
        path=Path(path),
        tokenizer_json=tokenizer_json(g),
        size=len(g.meta["tokenizer.ggml.tokens"]),
        specials=special_tokens(g),
        bos_id=token_id(g, "bos_token_id"),
        eos_ids=eos_token_ids(g),
        template=chat_template(g),
    )


def write_vocab(out: Path, real: RealVocab, model_max_length: int) -> int:
    """The folder's tokenizer files replaced by ``real``'s: ``tokenizer.json`` as llama.cpp
    tokenizes it, ``tokenizer_config.json`` with its special tokens and its chat template (else the
    family's, which the preset's config already holds). Returns the vocabulary's size."""
    family = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = json.loads(real.tokenizer_json)["added_tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in added
        },
        **{k: real.specials.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": real.template or family.get("chat_template"),
    }
    (out / "tokenizer.json").write_text(real.tokenizer_json, encoding="utf-8")
    write_json(out / "tokenizer_config.json", config)
    return real.size
