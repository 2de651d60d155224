"""``ModelAssets``: what the router itself reads of a model folder (tokenizer, chat template, EOS
ids, token pieces for logprobs, the sampling defaults its authors recommend) or of a GGUF file (the same, from its metadata: ``pantheon.core.gguf``).
The worker reads the weights; the router never does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pantheon.chat.template import ChatTemplate
from pantheon.chat.tools import JSON_TOOL_FORMAT
from pantheon.core.gguf import (
    byte_alphabet,
    chat_template,
    eos_token_ids,
    find_gguf,
    read_gguf,
    special_tokens,
)
from pantheon.core.gguf_tokenizer import tokenizer_json
from pantheon.models import generation_defaults

LONG_TEXT = 65536  # characters: a text this long is encoded without holding the GIL


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the ByteLevel pre-tokenizer's alphabet."""
    return {c: b for b, c in byte_alphabet().items()}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


class ModelAssets:
    """What the router needs of a model folder: tokenizer, chat template, eos ids."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        gguf_file = find_gguf(self.path)
        if gguf_file is not None:  # a GGUF file: everything comes from its metadata
            g = read_gguf(gguf_file)
            self.tokenizer = Tokenizer.from_str(tokenizer_json(g))
            self.template = ChatTemplate(
                chat_template(g),
                tool_use_template=chat_template(g, "tool_use"),
                special_tokens=special_tokens(g),
                reasoning="<think>" in g.meta.get("tokenizer.ggml.tokens", ()),
                name=f"the chat template of {gguf_file.name} (tokenizer.chat_template)",
            )
            eos = eos_token_ids(g)
            self.generation_defaults = generation_defaults.from_gguf(g.meta, str(gguf_file))
            self._byte_level = g.meta.get("tokenizer.ggml.model") == "gpt2"  # else raw UTF-8
        else:
            self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
            self.template = ChatTemplate.from_model_dir(self.path)
            eos = []
            for name in ("generation_config.json", "config.json"):
                eos += _ids(_read_json(self.path / name).get("eos_token_id"))
            self.generation_defaults = generation_defaults.from_generation_config(
                self.path / "generation_config.json"
            )
            tj = _read_json(self.path / "tokenizer.json")
            self._byte_level = "ByteLevel" in json.dumps(tj.get("decoder") or {})
        # What a tokenizer file says of padding and truncation (all-MiniLM's pads every text
        # to 128 and cuts it there) is for batching in the trainer's framework: ours never pads
        # (the engine batches without pad tokens) and cuts only where the model says
        # (the context; an embedding model's max_seq_length: pantheon.core.embedding)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        # a template that would stall every request is refused here, at load (a 400 from the
        # admin API): one render of a sample conversation under tighter bounds than a request's
        self.template.check_cost()
        # whether it renders tools (else the generic tool prompt), and whether it reads a call's
        # arguments as an object or as text: sample renders, at load rather than on a first request
        self.template.takes_tools  # noqa: B018
        self.template.object_arguments  # noqa: B018
        # at load, not on a first request: reading a real vocabulary (Qwen3.5's 152k tokens) takes
        # ~0.7 s, which inside that request's render bound (0.5 s) refused it
        self.max_token_chars  # noqa: B018
        src = (self.template.source or "") + (self.template.tool_use_source or "")
        fmt = self.template.tool_syntax
        # a Harmony model (gpt-oss) always reasons (its analysis channel); Gemma 4 thinks in its
        # thought channel (when the template's enable_thinking is on); others where the template
        # writes the format's reasoning marker
        self.reasoning = (
            (fmt.think is not None and fmt.think[0] in src)
            or (self.template.is_fallback and self.template.reasoning)
            or fmt.always_reasons
        )
        # calls can be forced where the template teaches a format (Hermes': where it writes
        # <tool_call>) or the generic tool prompt does
        self.tool_call_markup = (
            fmt.name != JSON_TOOL_FORMAT or "<tool_call>" in src or self.template.is_fallback
        )
        ends = [self.template.eos_token] if self.template.eos_token else []
        ends += fmt.ends
        for end in ends:
            tid = self.tokenizer.token_to_id(end)
            if tid is not None:
                eos.append(tid)
        self.eos_ids = list(dict.fromkeys(eos))
        self._bd = _byte_decoder() if self._byte_level else {}
        self._added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def add_eos(self, ids: list[int]) -> None:
        self.eos_ids = list(dict.fromkeys(self.eos_ids + list(ids)))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (a bound: a text of ``c``
        characters is at least ``c / max_token_chars`` tokens)."""
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:
            # encode_batch lets go of the GIL while it works (encode does not): a long prompt
            # tokenized on a thread then leaves the event loop free
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's own text and bytes, for logprobs (``bytes:\\x..`` when not valid UTF-8)."""
        got = self._pieces.get(token_id)
        if got is not None:
            return got
        if token_id in self._added:
            raw = self._added[token_id].encode()
        else:
            tok = self.tokenizer.id_to_token(token_id) or ""
            if self._byte_level and all(c in self._bd for c in tok):
                raw = bytes(self._bd[c] for c in tok)
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                raw = bytes([int(tok[3:5], 16)])
            else:
                raw = tok.replace("\u2581", " ").encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._pieces[token_id] = (text, raw)
        return text, raw
