"""Incremental detokenization: token ids in, final text out, one token at a time.

A token does not map to text on its own: byte-level BPE splits one UTF-8 character over several
tokens, and SentencePiece-style decoders render a token's leading space depending on what comes
before it. So each step decodes a small window, the last few already-emitted tokens (the *prefix*)
plus the tokens not yet emitted, and emits what the window adds beyond the prefix. The window stays
a few tokens long whatever the length of the output, so a step costs O(1).

Text is only emitted once it is final: while the window's text ends in U+FFFD (REPLACEMENT
CHARACTER) the last character is still incomplete, and it is held back until the tokens that
complete it arrive. ``flush`` then emits whatever is left, exactly as a full decode would render it.

This is the prefix-offset / read-offset technique of Hugging Face TGI and vLLM, with one more
hold-back rule for byte-fallback tokenizers: their decoder replaces a whole run of ``<0xNN>`` tokens
by U+FFFDs when the run as a whole is not valid UTF-8, so a later byte token can change how earlier
ones read. Text is therefore also held while the window ends in a byte token; it goes out with the
next ordinary token. That keeps the output identical to a full decode, even for invalid bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"

# SentencePiece byte-fallback pieces (Llama 2, Mistral): a character missing from the vocabulary is
# spelled as one ``<0xNN>`` token per UTF-8 byte.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# How many prompt tokens seed the window: context for the decoders' leading-space rules.
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas whose concatenation is ``tokenizer.decode(ids)``.

    ``prompt_ids`` (optional) are the tokens the output continues; their last few seed the window so
    that the first output token is rendered in context (its leading space, for instance), as it will
    be when the whole sequence is decoded. Only the output's text is ever returned.

    With ``skip_special_tokens`` (the default) tokens the tokenizer marks as special
    (``<|im_end|>``, ``<|endoftext|>``) produce no text. Added tokens that are not special
    (``<think>``, ``</think>``, ``<tool_call>`` in Qwen tokenizers) always come out as their text, so
    the emitter can split channels on them. With ``skip_special_tokens=False`` every token comes out
    as text. ``keep_special`` names special tokens that come out as their text even while the
    others are skipped: the markers of a format whose parser reads them (gpt-oss's Harmony
    ``<|channel|>``, ``<|message|>``, ...: ``HarmonyParser.keep_special``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
        keep_special: Iterable[str] = (),
    ):
        self._tokenizer = tokenizer
        kept = frozenset(keep_special)
        # Skipped special tokens are dropped before decoding, exactly as ``decode`` itself drops them,
        # so that they neither produce text nor make the window grow. With tokens to keep, the
        # others are dropped here and the window decoded with every special token's text.
        self._skip = skip_special_tokens and not kept
        self._special_ids: frozenset[int] = (
            frozenset(
                i
                for i, t in tokenizer.get_added_tokens_decoder().items()
                if t.special and t.content not in kept
            )
            if skip_special_tokens
            else frozenset()
        )
        # Only byte-fallback models have byte pieces; checked per token, since scanning a
        # 150k-entry vocabulary for each request would cost more than the request's decoding.
        model = getattr(tokenizer, "model", None)
        self._byte_fallback = bool(getattr(model, "byte_fallback", False))
        seed = [i for i in (prompt_ids or ()) if i not in self._special_ids][-_PROMPT_CONTEXT:]
        # ``_ids`` is the window: ``_ids[:_read]`` has been emitted (the prefix), the rest not yet.
        self._ids: list[int] = seed
        self._read = len(seed)
        self._prefix_text = self._decode(seed)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _is_byte_piece(self, token_id: int) -> bool:
        if not self._byte_fallback:
            return False
        piece = self._tokenizer.id_to_token(token_id)
        return piece is not None and _BYTE_PIECE.fullmatch(piece) is not None

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final ("" while a character is incomplete)."""
        if token_id in self._special_ids:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if (
            text.endswith(_REPLACEMENT)
            or len(text) <= len(self._prefix_text)
            or self._is_byte_piece(token_id)
        ):
            # An incomplete UTF-8 sequence at the end (or nothing new yet, or a byte run that may
            # still grow): wait for more tokens.
            return ""
        new = text[len(self._prefix_text) :]
        # Slide the window: the tokens just emitted become the prefix, older ones are forgotten.
        # The new window starts where the text was complete (no U+FFFD at its end), so decoding
        # it afresh renders the same characters as decoding from the very start.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def push_many(self, token_ids: Iterable[int]) -> str:
        """``push`` each token, return the joined text."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """End of output: return everything still held back (an incomplete character becomes U+FFFD,
        as in a full decode)."""
        text = self._decode(self._ids)
        new = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new
