"""A GGUF file's vocabulary as a ``tokenizers`` JSON that gives the ids llama.cpp gives.

llama.cpp's converter writes four kinds of vocabulary for the families Pantheon serves
(``tokenizer.ggml.model``), each translated here into the fast Rust library's own terms so that
serving never tokenizes in Python:

- ``gpt2``: byte-level BPE (Llama 3, Qwen2/3/3.5, gpt-oss, SmolLM, Mistral's tekken, DeepSeek).
  Its pre-tokenizer (``tokenizer.ggml.pre``) names the split regexes the merges were learned with:
  ``PRE_TOKENIZERS`` holds llama.cpp's list for each name (``src/llama-vocab.cpp``), applied in
  order as ``Split`` steps, and whether whole pieces found in the vocabulary skip the merges
  (``ignore_merges``, Llama 3 and tekken). Tokens outside GPT-2's byte alphabet are respelled into it.
- ``gemma4``: BPE over raw UTF-8 with ``<0xHH>`` byte fallback, spaces as U+2581, split at newlines.
- ``llama``: SentencePiece (Llama 2, Mistral 7B, Phi-3, Gemma 3). llama.cpp merges the adjacent
  pair whose concatenation is a token of the highest score; a BPE whose merges are every two-token
  split of every token, ranked by that token's score, merges the same pairs. A space is prepended
  to every text run (``tokenizer.ggml.add_space_prefix``, default on) and spaces become U+2581;
  characters outside the vocabulary fall back to their ``<0xHH>`` bytes.
- ``bert``: WordPiece (BGE and the other BERT embeddings). The converter stores word-initial
  pieces with a leading U+2581 ("phantom space") and continuations bare; the WordPiece model wants
  them bare and ``##``-prefixed, so they are respelled back. BERT's normalizer (lowercase, accents
  stripped, Chinese characters split) and pre-tokenizer are what llama.cpp's WPM does.

Anything else (another model, a pre-tokenizer of a family we do not serve) is refused with a
``GGUFError("unsupported", ...)`` naming the field, its value and what is supported.
tests/unit/test_gguf_vocab_suite.py checks every vocabulary against llama.cpp's own suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pantheon.core.gguf import (
    TOKEN_CONTROL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    GGUFError,
    GGUFFile,
    byte_alphabet,
    token_id,
)


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's pre-tokenizer for one ``tokenizer.ggml.pre`` name: its split regexes, each
    applied to the pieces the previous one left, whether a piece that is itself a token is taken
    whole, before any merge (``ignore_merges``), and whether BOS is added when the file does not
    say (``tokenizer.ggml.add_bos_token`` absent)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# llama.cpp spells "(?i:'s|'t|...)" out case by case: the inline flag would also fold "ſ" into "s"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: combining marks belong to words (Vietnamese, Hindi written decomposed)
QWEN35_SPLIT = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gpt-4o (o200k, gpt-oss) and tekken (Mistral Nemo, Small 3.x): the regexes of their own
# tokenizer.json / tiktoken, which llama.cpp approximates for its std::regex engine ("a letter not
# in a-z" for \p{Lu}...: wrong for non-ASCII lowercase letters); Oniguruma runs the originals
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's letter classes, spelled as escapes: written out, an editor's Unicode normalization
# turns some ends of their ranges into other characters (U+1FD3 into U+0390: an empty range)
_DEEPSEEK_LATIN = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_SPLIT,))
_GPT2 = PreTokenizer((GPT2_SPLIT,))
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", GPT2_SPLIT))  # each digit alone, then GPT-2's regex
# llama.cpp's names (src/llama-vocab.cpp) for the families Pantheon serves; the first name of
# each regex is the canonical one (tests/helpers/llama_convert.py names a tokenizer.json by it)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "smaug-bpe": PreTokenizer((LLAMA3_SPLIT,)),
    "dbrx": PreTokenizer((LLAMA3_SPLIT,)),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "qwen35": PreTokenizer((QWEN35_SPLIT,)),
    "gpt-4o": PreTokenizer((GPT4O_SPLIT,)),
    "llama4": PreTokenizer((GPT4O_SPLIT,)),
    "tekken": PreTokenizer((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2,
    "deepseek-llm": PreTokenizer((r"[\r\n]", _DEEPSEEK_LATIN, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer(
        (
            r"[\p{P}\$\+<=>\^~\|`]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"[0-9][0-9][0-9]",
        )
    ),
    # llama.cpp's fallback for a BPE vocabulary its converter could not name
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")),
}

# llama.cpp's gemma4 pre-tokenizer: lines and newline runs
GEMMA4_SPLIT = r"[^\n]+|[\n]+"

MODELS = {
    "gpt2": "byte-level BPE",
    "gemma4": "SentencePiece-style BPE",
    "llama": "SentencePiece",
    "bert": "WordPiece",
}


def _unsupported(g: GGUFFile, field: str, value: object, supported: str) -> GGUFError:
    return GGUFError(
        "unsupported", f"{g.path}: metadata field {field!r} is {value!r}; supported: {supported}"
    )


def pre_tokenizer(g: GGUFFile) -> PreTokenizer:
    """The file's ``tokenizer.ggml.pre`` (llama.cpp reads a missing one as "default")."""
    pre = g.meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise _unsupported(g, "tokenizer.ggml.pre", pre, ", ".join(PRE_TOKENIZERS))
    return PRE_TOKENIZERS[pre]


def _list(g: GGUFFile, key: str, n: int | None, kinds: tuple[type, ...]) -> list:
    v = g.meta.get(f"tokenizer.ggml.{key}")
    if not isinstance(v, list) or (n is None and not v) or not all(isinstance(x, kinds) for x in v):
        raise GGUFError("invalid", f"{g.path}: missing metadata field 'tokenizer.ggml.{key}'")
    if n is not None and len(v) != n:
        raise GGUFError(
            "invalid",
            f"{g.path}: metadata field 'tokenizer.ggml.{key}' does not have one entry per token ({n})",
        )
    return v


def _flag(g: GGUFFile, key: str, default: bool) -> bool:
    v = g.meta.get(f"tokenizer.ggml.{key}")
    return v if isinstance(v, bool) else default


def _split_regexes(splits: tuple[str, ...]) -> list[dict]:
    return [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in splits
    ]


def _merges(g: GGUFFile) -> list[list[str]]:
    out = []
    for i, m in enumerate(_list(g, "merges", None, (str,))):
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(
                "invalid",
                f"{g.path}: metadata field 'tokenizer.ggml.merges' entry #{i} is not two tokens: {m!r}",
            )
        out.append(parts)
    return out


def _score_merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """SentencePiece's merges as BPE merges: every split of a token into two tokens, ranked by
    the merged token's score, highest first (llama.cpp's ``llm_tokenizer_spm_session`` merges the
    pair whose concatenation scores highest, into any token of the vocabulary). Equal scores rank
    by token id where llama.cpp takes the leftmost pair; SentencePiece's BPE models give every
    mergeable piece a score of its own, so only the 0-scored control tokens tie."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                ranked.append((-scores[i], i, a, b))
    ranked.sort()
    return [[a, b] for _, _, a, b in ranked]


def _added(tokens: list[str], types: list[int], vocab: dict[str, int], byte_level: bool) -> list[dict]:
    """CONTROL and UNKNOWN tokens as special added tokens, USER_DEFINED ones as plain added tokens
    (both are matched before the model runs, as llama.cpp's ``tokenizer_st_partition`` does)."""
    alphabet = set(byte_alphabet().values()) if byte_level else None
    out = []
    for i, (t, kind) in enumerate(zip(tokens, types)):
        special = kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        if (
            special
            and (alphabet is None or set(t) <= alphabet)
            or (kind == TOKEN_USER_DEFINED and vocab.get(t) == i)
        ):
            out.append(
                {
                    "id": i,
                    "content": t,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": special,
                }
            )
    return out


def _first_id(g: GGUFFile, *keys: str, default: int) -> int:
    """The first of these ``tokenizer.ggml.<key>`` ids the file names, else ``default``."""
    return next((t for k in keys if (t := token_id(g, k)) is not None), default)


def _post_processor(g: GGUFFile, tokens: list[str], model: str) -> dict:
    """BOS / CLS before, EOS / SEP after, as the file's flags (llama.cpp's defaults where absent)
    say: what ``encode(add_special_tokens=True)`` adds. WordPiece (``bert``) ignores the flags,
    as llama.cpp's WPM tokenizer does: always BOS (the CLS token; an older converter wrote it as
    ``cls_token_id``; default 101) before and SEP (default 102) after."""
    bos_default = model in ("llama", "bert") or (model == "gpt2" and pre_tokenizer(g).add_bos)
    single: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    specials: dict[str, dict] = {}
    bert = model == "bert"
    plan = (
        (
            (True, _first_id(g, "bos_token_id", "cls_token_id", default=101), False),
            (True, _first_id(g, "seperator_token_id", default=102), True),
        )
        if bert
        else (
            (_flag(g, "add_bos_token", bos_default), token_id(g, "bos_token_id"), False),
            (_flag(g, "add_eos_token", False), token_id(g, "eos_token_id"), True),
            (_flag(g, "add_sep_token", False), token_id(g, "seperator_token_id"), True),
        )
    )
    for add, tid, at_end in plan:
        if not add or tid is None or tid >= len(tokens):
            continue
        tok = tokens[tid]
        specials[tok] = {"id": tok, "ids": [tid], "tokens": [tok]}
        if at_end:
            single.append({"SpecialToken": {"id": tok, "type_id": 0}})
            pair.insert(
                pair.index({"Sequence": {"id": "B", "type_id": 1}}),
                {"SpecialToken": {"id": tok, "type_id": 0}},
            )
            pair.append({"SpecialToken": {"id": tok, "type_id": 1}})
        else:
            single.insert(0, {"SpecialToken": {"id": tok, "type_id": 0}})
            pair.insert(0, {"SpecialToken": {"id": tok, "type_id": 0}})
            pair.insert(
                pair.index({"Sequence": {"id": "B", "type_id": 1}}),
                {"SpecialToken": {"id": tok, "type_id": 1}},
            )
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def _bpe(
    vocab: dict[str, int],
    merges: list[list[str]],
    *,
    unk: str | None,
    byte_fallback: bool,
    ignore_merges: bool,
) -> dict:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }


_SPACE_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ],
}


def tokenizer_json(g: GGUFFile) -> str:
    """A ``tokenizers`` JSON for the file's vocabulary (see the module's docstring): the ids
    llama.cpp's ``llama_tokenize`` gives, special tokens included, with ``encode`` adding what
    llama.cpp adds under ``add_special``."""
    model = g.meta.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise _unsupported(
            g, "tokenizer.ggml.model", model, ", ".join(f"{k!r} ({v})" for k, v in MODELS.items())
        )
    tokens: list[str] = _list(g, "tokens", None, (str,))
    types: list[int] = (
        _list(g, "token_type", len(tokens), (int,))
        if "tokenizer.ggml.token_type" in g.meta
        else [1] * len(tokens)
    )
    unk_id = token_id(g, "unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    normalizer: dict | None = None
    if model == "gpt2":
        pre = pre_tokenizer(g)
        spell = byte_alphabet()
        alphabet = set(spell.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        pre_tok: dict | None = {
            "type": "Sequence",
            "pretokenizers": [
                *_split_regexes(pre.splits),
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        }
        decoder: dict = {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        }
        tok_model = _bpe(vocab, _merges(g), unk=None, byte_fallback=False, ignore_merges=pre.ignore_merges)
        added = _added(tokens, types, vocab, byte_level=True)
    elif model == "gemma4":
        # llama.cpp's gemma4 model: spaces as U+2581, split only at newline runs, merges over raw
        # UTF-8, pieces outside the vocabulary as their <0xHH> byte tokens
        vocab = {t: i for i, t in enumerate(tokens)}
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        pre_tok = _split_regexes((GEMMA4_SPLIT,))[0]
        decoder = _SPACE_DECODER
        tok_model = _bpe(vocab, _merges(g), unk=unk, byte_fallback=True, ignore_merges=False)
        added = _added(tokens, types, vocab, byte_level=False)
    elif model == "llama":
        scores: list[float] = _list(g, "scores", len(tokens), (int, float))
        vocab = {t: i for i, t in enumerate(tokens)}
        # llama.cpp puts the space before every text run (the start, and after each special token),
        # as Prepend does before each run between added tokens
        steps: list[dict] = (
            [{"type": "Prepend", "prepend": "\u2581"}] if _flag(g, "add_space_prefix", True) else []
        )
        steps.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
        normalizer = {"type": "Sequence", "normalizers": steps}
        pre_tok = None
        decoder = _SPACE_DECODER
        merges = _score_merges(tokens, scores)
        tok_model = _bpe(vocab, merges, unk=unk, byte_fallback=True, ignore_merges=False)
        added = _added(tokens, types, vocab, byte_level=False)
    else:  # bert
        # the converter's phantom spaces back to WordPiece's spelling: "▁word" -> "word" (a word's
        # start), "ing" -> "##ing" (a continuation); control tokens ([CLS], [SEP]...) as they are
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if types[i] == TOKEN_CONTROL else t[1:] if t.startswith("\u2581") else "##" + t
            vocab.setdefault(key, i)
        normalizer = {
            "type": "BertNormalizer",
            "clean_text": True,
            "handle_chinese_chars": True,
            "strip_accents": None,
            "lowercase": True,
        }
        pre_tok = {"type": "BertPreTokenizer"}
        decoder = {"type": "WordPiece", "prefix": "##", "cleanup": True}
        tok_model = {
            "type": "WordPiece",
            "unk_token": unk or "[UNK]",
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 1 << 30,  # llama.cpp has no limit
            "vocab": vocab,
        }
        added = _added(tokens, types, vocab, byte_level=False)
    return msgspec.json.encode(
        {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tok,
            "post_processor": _post_processor(g, tokens, model),
            "decoder": decoder,
            "model": tok_model,
        },
    ).decode()  # (json.dumps: 0.09 s of 0.37 for Qwen3.5's 248k tokens)
