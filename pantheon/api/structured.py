"""Structured outputs: a request's constraint turned into an llguidance grammar, checked here.

What a request may constrain its output with (at most one of them):

- ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``. With ``strict: false`` keywords the engine does
  not implement are ignored; otherwise they are a 400.
- vLLM's extras: ``guided_json`` (a schema, object or string), ``guided_regex``, ``guided_choice``
  (a list of strings), ``guided_grammar`` (Lark, or GBNF/EBNF as llama.cpp writes it), and the
  same under ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``).
- tools: ``tool_choice`` ``"required"`` or a named function constrain the output to a call of
  the tools' parameter schemas in the model's ``<tool_call>`` format (:func:`tool_grammar`): JSON,
  or Qwen3.5's XML (``<function=NAME>`` and one ``<parameter=P>`` element per argument), or
  Gemma 4's ``call:NAME{key:value,...}`` (its template's argument syntax).

JSON is written compactly, with ``", "`` and ``": "`` as separators and no other whitespace: a
small model given free whitespace can spend its whole budget on newlines. For the same reason its
numbers have bounded digit runs (:mod:`pantheon.core.json_numbers`).

The JSON Schema subset is llguidance's (https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md):
types, ``properties`` / ``required`` / ``additionalProperties``, ``enum`` / ``const``, ``anyOf`` /
``oneOf`` / ``allOf``, ``$ref`` / ``$defs``, ``items`` / ``prefixItems`` / ``minItems`` /
``maxItems``, string ``minLength`` / ``maxLength`` / ``pattern`` / ``format``, number ranges.

Every grammar is compiled once here, before any slot is taken (a bad one is a 400 naming the
parameter), and the verdict is cached by the grammar's hash. Size is bounded (``MAX_GRAMMAR_BYTES``)
and so is compile work (llguidance's parser limits, ``LIMITS``), so no request can stall the router.

Compiling is not enough: llguidance finds some limits only while it matches (a lexer that builds
too many expressions for ``a{1000000}``, a row of more than ``max_items_in_row`` Earley items for
a 6000-way alternative), and the worker would then mask every token and end the output early. So
:func:`check` also runs a matcher, with the worker's limits, over a byte-level vocabulary for a
few steps (:func:`probe`: each step computes the mask and takes the first allowed token), and
:func:`check_for_model` does the same with the model's own tokenizer (``Generation`` calls it
when it is made, before the worker sees the request), which is where a grammar whose text the
vocabulary cannot spell fails. What passes can still fail deeper in an output; the worker then
ends the request with an error, never a ``stop``.

``LIMITS`` must equal the worker's (``workers.grammar.LIMITS``, which cannot import this module;
tests/unit/test_grammar_bounds.py compares them). ``verbose_errors`` is off on both sides: with
it, an error message carries the whole grammar.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark

from pantheon.chat import toolformats
from pantheon.chat.toolformats import JSON_STYLE, call_schema, parameters
from pantheon.chat.tools import JSON_TOOL_FORMAT
from pantheon.core.gguf import byte_alphabet
from pantheon.core.grammar_vocab import LIMIT_VALUES, grammar_tokenizer_json
from pantheon.core.json_numbers import bound_numbers
from pantheon.errors import invalid_param

MAX_GRAMMAR_BYTES = 65536  # a schema / regex / grammar longer than this is a 400
MAX_CHOICES = 256

LIMITS = llg.LLParserLimits(**LIMIT_VALUES)
PROBE_STEPS = 128  # tokens a probe matches at most
PROBE_SECONDS = 0.25  # and for how long: past it, what it saw is the verdict
MAX_ERROR_CHARS = 300  # of an llguidance error quoted to a client or a log

_verdicts: OrderedDict[str, str] = OrderedDict()  # (tokenizer, grammar) hash -> "" (valid) or the error
_lock = threading.Lock()  # big bodies are parsed on threads


def short_error(message: str) -> str:
    """An llguidance error's first line, cut to ``MAX_ERROR_CHARS``."""
    first = message.strip().split("\n", 1)[0]
    return first[:MAX_ERROR_CHARS] + ("..." if len(first) > MAX_ERROR_CHARS else "")


def probe(tokenizer: llg.LLTokenizer, grammar: str, eos: Sequence[int] = ()) -> str:
    """What goes wrong when a matcher of ``grammar`` over ``tokenizer`` runs (as the worker's
    does, with ``LIMITS``): its error, or "" when none shows in ``PROBE_STEPS`` tokens. Each step
    computes the mask (where llguidance meets most of its limits) and takes the first allowed
    token that is not an end of sequence; a mask that allows nothing where the grammar may not
    end means the vocabulary cannot spell what the grammar demands."""
    m = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    deadline = time.monotonic() + PROBE_SECONDS
    ends = {t for t in eos if 0 <= t < tokenizer.vocab_size}
    ends.update(t for t in tokenizer.eos_tokens if 0 <= t < tokenizer.vocab_size)
    for _ in range(PROBE_STEPS):
        if m.is_error():
            return m.get_error()
        if m.is_stopped() or time.monotonic() > deadline:
            return ""
        mask = bytearray(m.compute_bitmask())
        if m.is_error():
            return m.get_error()
        for t in ends:
            mask[t // 8] &= ~(1 << (t % 8)) & 0xFF
        token = _first_set(mask, tokenizer.vocab_size)
        if token is None:
            if m.is_accepting():
                return ""
            return "no token of the model's vocabulary can continue the output the grammar demands"
        if not m.consume_token(token):
            return m.get_error() or f"the grammar refused token {token} that its own mask allowed"
    return m.get_error() if m.is_error() else ""


def _first_set(mask: bytearray, n: int) -> int | None:
    for i, b in enumerate(mask):
        if b:
            t = i * 8 + (b & -b).bit_length() - 1
            return t if t < n else None
    return None


# a byte-level BPE with no merges and an end of sequence: one token per byte, so every text spells
_BYTES_TOKENIZER = json.dumps(
    {
        "version": "1.0",
        "added_tokens": [{"id": 256, "content": "<eos>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {c: i for i, c in enumerate(byte_alphabet().values())}, "merges": []},
    }
)  # fmt: skip
_bytes_tokenizer: llg.LLTokenizer | None = None


def _bytes() -> llg.LLTokenizer:
    global _bytes_tokenizer
    if _bytes_tokenizer is None:
        _bytes_tokenizer = llg.LLTokenizer(_BYTES_TOKENIZER, eos_token=256)
    return _bytes_tokenizer


def _verdict(key: str, judge: Callable[[], str]) -> str:
    with _lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        verdict = judge()
        with _lock:
            _verdicts[key] = verdict
            while len(_verdicts) > 1024:
                _verdicts.popitem(last=False)
    return verdict


def _judge(grammar: str) -> str:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS)
    if is_error:
        return messages[0]
    return probe(_bytes(), grammar)


def check(grammar: str, param: str) -> str:
    """``grammar`` if it compiles and a byte-level matcher runs it, else a 400 naming ``param``."""
    if len(grammar) > 4 * MAX_GRAMMAR_BYTES:
        raise invalid_param(param, f"'{param}' is too large to compile")
    verdict = _verdict(hashlib.sha256(grammar.encode()).hexdigest(), lambda: _judge(grammar))
    if verdict:
        raise invalid_param(param, f"'{param}' cannot be enforced: {short_error(verdict)}")
    return grammar


class ModelTokenizer:
    """A model's vocabulary as llguidance's worker-side matcher sees it: the same tokenizer
    JSON, vocabulary size and end-of-sequence ids. Built on first use (~0.3 s for 50k tokens)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: Sequence[int]):
        self.key = hashlib.sha256(f"{tokenizer_json}\0{n_vocab}\0{list(eos)}".encode()).hexdigest()
        self._json, self.n_vocab, self.eos = tokenizer_json, n_vocab, list(eos)
        self._tok: llg.LLTokenizer | None = None
        self._built = threading.Lock()

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        with self._built:
            if self._tok is None:
                self._tok = llg.LLTokenizer(
                    grammar_tokenizer_json(self._json), n_vocab=self.n_vocab, eos_token=self.eos
                )
            return self._tok


def check_for_model(grammar: str, model: ModelTokenizer, param: str) -> None:
    """400 naming ``param`` when a matcher of ``grammar`` over ``model``'s vocabulary fails in
    :func:`probe` (a text its tokens cannot spell, a limit its longer tokens reach)."""
    key = hashlib.sha256(f"{model.key}\0{grammar}".encode()).hexdigest()
    try:
        verdict = _verdict(key, lambda: probe(model.tokenizer, grammar, model.eos))
    except Exception as e:  # a tokenizer llguidance cannot read: the worker says so too
        verdict = f"this model cannot enforce grammars: {e}"
    if verdict:
        raise invalid_param(param, f"'{param}' cannot be enforced with this model: {short_error(verdict)}")


def _sized(text: str, param: str) -> str:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise invalid_param(param, f"'{param}' is longer than {MAX_GRAMMAR_BYTES} bytes")
    return text


def json_schema_grammar(schema: object, param: str, *, strict: bool = True) -> str:
    """The grammar of one JSON Schema (an object, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(_sized(schema, param))
        except ValueError:
            raise invalid_param(param, f"'{param}' is not valid JSON") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise invalid_param(param, f"'{param}' must be a JSON Schema object")
    _sized(json.dumps(schema), param)
    style = dict(JSON_STYLE, lenient=not strict)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(bound_numbers(schema), overrides=style)  # type: ignore[arg-type]
    except ValueError as e:
        raise invalid_param(param, f"'{param}' is not a valid schema: {e}") from None
    return check(grammar, param)


def regex_grammar(regex: object, param: str) -> str:
    if not isinstance(regex, str) or not regex:
        raise invalid_param(param, f"'{param}' must be a non-empty string")
    return check(llg.LLMatcher.grammar_from_regex(_sized(regex, param)), param)


def choice_grammar(choices: object, param: str) -> str:
    if (
        not isinstance(choices, list)
        or not choices
        or len(choices) > MAX_CHOICES
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise invalid_param(param, f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings")
    alts = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return check(llg.LLMatcher.grammar_from_lark(_sized(f"start: {alts}\n", param)), param)


def lark_grammar(text: object, param: str) -> str:
    """A Lark grammar, or a GBNF one (``root ::= ...``) converted to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise invalid_param(param, f"'{param}' must be a non-empty grammar string")
    _sized(text, param)
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises what its parser raises
            raise invalid_param(param, f"'{param}' is not a valid GBNF grammar: {e}") from None
    return check(llg.LLMatcher.grammar_from_lark(text), param)


def response_format(
    rf: object, p: str = "response_format", schema_p: str | None = None
) -> tuple[str, str | None]:
    """OpenAI's ``response_format`` object at ``p`` -> (the format's type, its grammar or None
    for text); its ``json_schema`` fields (``name``, ``schema``, ``strict``) are at ``schema_p``
    (``response_format.json_schema``; on Responses, ``text.format`` itself)."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid_param(p, f"'{p}' must be an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return kind, None
    if kind == "json_object":
        return kind, json_schema_grammar({"type": "object"}, p)
    if kind == "json_schema":
        js = rf.get("json_schema")
        jp = schema_p or f"{p}.json_schema"
        if not isinstance(js, dict):
            raise invalid_param(jp, f"'{jp}' must be an object")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_param(f"{jp}.name", f"'{jp}.name' is required")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_param(f"{jp}.strict", "'strict' must be a boolean")
        if "schema" not in js:  # OpenAI: no schema means any JSON
            return kind, json_schema_grammar({}, f"{jp}.schema")
        return kind, json_schema_grammar(js["schema"], f"{jp}.schema", strict=strict is not False)
    raise invalid_param(f"{p}.type", f"{p} type {kind!r} is not supported (text, json_object, json_schema)")


_GUIDED = {  # vLLM's request extras, and their names under ``structured_outputs``
    "guided_json": ("json", lambda v, p: json_schema_grammar(v, p)),
    "guided_regex": ("regex", regex_grammar),
    "guided_choice": ("choice", choice_grammar),
    "guided_grammar": ("grammar", lark_grammar),
}


def request_grammar(body: dict) -> tuple[str, str | None]:
    """The constraint of a chat / completion request body: (what it is, its grammar or None).

    Raises a 400 for a malformed or unenforceable constraint, or for more than one of them."""
    found: list[tuple[str, str, str | None]] = []  # (param, kind, grammar)
    if body.get("response_format") is not None:
        kind, grammar = response_format(body["response_format"])
        if grammar is not None:
            found.append(("response_format", kind, grammar))
    for key, (short, build) in _GUIDED.items():
        if body.get(key) is not None:
            found.append((key, short, build(body[key], key)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid_param("structured_outputs", "'structured_outputs' must be an object")
        for _key, (short, build) in _GUIDED.items():
            if so.get(short) is not None:
                found.append(
                    (f"structured_outputs.{short}", short, build(so[short], f"structured_outputs.{short}"))
                )
        if so.get("json_object"):
            found.append(
                (
                    "structured_outputs.json_object",
                    "json_object",
                    json_schema_grammar({"type": "object"}, "structured_outputs"),
                )
            )
    if len(found) > 1:
        names = ", ".join(f"'{p}'" for p, _k, _g in found)
        raise invalid_param(found[1][0], f"only one output constraint is allowed per request, got {names}")
    if not found:
        return "text", None
    return found[0][1], found[0][2]


# ---------------------------------------------------------------- tool calls


def check_tool_schemas(
    tools: Sequence[dict], names: Sequence[str] | None = None, paths: Sequence[str] | None = None
) -> None:
    """400 if a tool a call may be forced to has parameters that cannot be enforced, naming
    ``paths[i].parameters`` (where the client put tool i's fields; ``tools[i].function``)."""
    for i, tool in enumerate(tools):
        fn = tool.get("function", {})
        if names is None or fn.get("name") in names:
            p = f"tools[{i}].function" if paths is None else paths[i]
            json_schema_grammar(parameters(tool), f"{p}.parameters", strict=fn.get("strict") is not False)


def call_or_reply_grammar(tools: Sequence[dict], *, parallel: bool = True, prose: bool = False) -> str:
    """The grammar of a call-or-reply answer (``pantheon.chat.answer_form``): one JSON object,
    ``{"response": "..."}`` (a non-empty string), ``{"tool_call": CALL}`` or, with ``parallel``,
    ``{"tool_calls": [CALL, ...]}``, each CALL one of ``tools`` with arguments of its schema.
    With ``prose`` it is lazy, as llama.cpp's tool grammars are: an answer that does not open
    with ``{`` is free text (a reply as the model writes it), one that does is held to the forms
    from there. The schemas are read leniently: the client asked for no enforcement, and an
    agent's schema with a keyword llguidance lacks should still get its calls (``required``
    checks them strictly up front, ``protocol.parse_chat_request``)."""
    text = json.dumps({"type": "string", "minLength": 1, "x-guidance": JSON_STYLE})
    forms = ['"{\\"response\\": " text "}"', '"{\\"tool_call\\": " call "}"']
    if parallel:
        forms.append('"{\\"tool_calls\\": [" call (", " call)* "]}"')
    rules = [f"text: %json {text}", f"call: %json {json.dumps(call_schema(tools, lenient=True))}"]
    if prose:  # text whose first character is neither "{" (a form's) nor a blank (no form's)
        forms.insert(0, "PROSE")
        rules.append("PROSE: /[^{\\s][\\s\\S]*/")
    lark = f"start: {' | '.join(forms)}\n" + "".join(r + "\n" for r in rules)
    return check(llg.LLMatcher.grammar_from_lark(lark), "tools")


def tool_grammar(
    tools: Sequence[dict],
    forced: str | None,
    prefix: str,
    tool_format: str = JSON_TOOL_FORMAT,
    *,
    token_id: Callable[[str], int | None] | None = None,
) -> str:
    """The grammar of what the model writes after ``prefix`` (already in the prompt) when a
    call is demanded, in the model's format (``tool_format``, ``ChatTemplate.tool_format``):
    ``forced`` named, only that function; else one call of any of ``tools``.

    ``token_id`` gives the id of each of the format's special-token markers in the model's
    vocabulary (None where it has none): a grammar spells those as tokens (llguidance matches no
    special token against text), and only a matcher over that vocabulary can check it
    (``check_for_model``), not the byte-level ``check``."""
    spell = MarkerSpeller(token_id)
    lark = toolformats.get(tool_format).call_lark(tools, forced, prefix, spell)
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    return grammar if spell.tokens else check(grammar, "tools")


class MarkerSpeller:
    """Spells a format's marker in a grammar (``toolformats.Speller``): as the model's special
    token (``<[ID]>``) where ``token_id`` knows it, else as text. ``tokens``: whether it used one."""

    def __init__(self, token_id: Callable[[str], int | None] | None):
        self._token_id = token_id
        self.tokens = False

    def __call__(self, marker: str) -> str:
        tid = None if self._token_id is None else self._token_id(marker)
        if tid is None:
            return json.dumps(marker)
        self.tokens = True
        return f"<[{tid}]>"
