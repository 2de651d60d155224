"""Grammar-constrained decoding in the engine (workers/grammar.py), on a random-weight model with
a real trained tokenizer: whatever the weights want, the output matches the grammar; sampling
options still work under a mask; an unconstrained request is untouched by a constrained one
beside it; a bad grammar is refused before it takes a slot.

The router's half (what a request body becomes, and its 400s) is tests/unit/test_structured_router.py;
the same on SmolLM2 through HTTP is tests/e2e/test_structured.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import Tokenizer

from pantheon.api import structured
from pantheon.core.protocol import SamplingParams
from workers.engine import Engine, RequestRejected
from workers.grammar import Constraint, _bit, apply_masks

PROMPT = [5, 17, 300, 41, 9]


@pytest.fixture(scope="module")
def path(model_factory):
    return str(model_factory("tiny-llama", dtype="float32"))


@pytest.fixture(scope="module")
def engine(path):
    return Engine(path, dtype="float32", kv_budget_bytes=8 << 20)


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_file(f"{path}/tokenizer.json")


def run(engine: Engine, reqs: dict[str, SamplingParams], prompt=PROMPT) -> dict[str, tuple[list[int], str]]:
    for rid, p in reqs.items():
        engine.submit(rid, list(prompt), p)
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    fin: dict[str, str] = {}
    while engine.has_work():
        for o in engine.step():
            if o.token >= 0:
                out[o.request_id].append(o.token)
            if o.finish:
                fin[o.request_id] = o.finish
    return {rid: (out[rid], fin[rid]) for rid in reqs}


def text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "tag": {"enum": ["x", "yy", "zzz"]}},
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}  # fmt: skip


def test_random_weights_still_write_what_the_grammar_allows(engine, tok):
    rx = structured.regex_grammar(REGEX, "r")
    js = structured.json_schema_grammar(SCHEMA, "s")
    ch = structured.choice_grammar(["alpha", "beta", "gamma"], "c")
    reqs = {
        "greedy-rx": SamplingParams(temperature=0.0, max_tokens=40, grammar=rx),
        "hot-rx": SamplingParams(temperature=1.5, max_tokens=40, seed=1, grammar=rx),
        "topk-js": SamplingParams(temperature=1.0, top_k=5, max_tokens=80, seed=2, grammar=js),
        "topp-js": SamplingParams(temperature=0.9, top_p=0.5, max_tokens=80, seed=3, grammar=js),
        "minp-ch": SamplingParams(temperature=1.0, min_p=0.1, max_tokens=20, seed=4, grammar=ch),
        "pen-ch": SamplingParams(temperature=1.0, repetition_penalty=1.5, max_tokens=20, seed=5, grammar=ch),
    }
    got = run(engine, reqs)
    for rid, (ids, finish) in got.items():
        assert finish == "stop", (rid, text(tok, ids))  # the grammar ended the request
        out = text(tok, ids)
        if rid.endswith("rx"):
            assert re.fullmatch(REGEX, out), (rid, out)
        elif rid.endswith("js"):
            import jsonschema

            jsonschema.validate(json.loads(out), SCHEMA)
        else:
            assert out in ("alpha", "beta", "gamma"), (rid, out)


def test_a_seeded_constrained_request_repeats_and_n_seeds_differ(engine, tok):
    js = structured.json_schema_grammar(SCHEMA, "s")
    a = run(
        engine,
        {f"s{i}": SamplingParams(temperature=1.2, max_tokens=80, seed=i, grammar=js) for i in range(4)},
    )
    b = run(
        engine,
        {f"s{i}": SamplingParams(temperature=1.2, max_tokens=80, seed=i, grammar=js) for i in range(4)},
    )
    assert a == b
    assert len({tuple(ids) for ids, _f in a.values()}) > 1  # four seeds, not one output


def test_an_unconstrained_neighbour_is_untouched(engine):
    """Greedy tokens of a free request: the same beside a free request and beside a
    constrained one (the mask touches only its own row)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rx = structured.regex_grammar(REGEX, "r")
    free = run(engine, {"a": greedy, "b": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)})
    guided = run(engine, {"a": greedy, "b": SamplingParams(temperature=0.0, max_tokens=24, grammar=rx)})
    assert guided["a"] == free["a"]
    assert guided["b"] != free["b"]


def test_the_compiled_grammar_is_cached_by_hash(engine):
    g = structured.regex_grammar("q[0-9]{5}z", "r")
    before = engine.grammars.compiled
    run(engine, {f"c{i}": SamplingParams(temperature=0.0, max_tokens=10, grammar=g) for i in range(3)})
    assert engine.grammars.compiled == before + 1
    assert engine.grammars.hits >= 2


def test_a_grammar_that_does_not_compile_is_refused_before_a_slot(engine):
    with pytest.raises(RequestRejected) as ei:
        engine.submit("bad", list(PROMPT), SamplingParams(max_tokens=5, grammar="start: nope_undefined"))
    assert ei.value.kind == "invalid" and "grammar" in ei.value.reason
    assert not engine.has_work() and all(s is None for s in engine.scheduler.slots)
    got = run(engine, {"after": SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)})
    assert len(got["after"][0]) == 3  # the engine is fine


def test_the_grammar_starts_after_the_reasoning_ends(engine, tok):
    """``grammar_after``: tokens before the marker are free (here a logit bias forces token 7
    first, which the grammar would never allow), the rest match the grammar."""
    rx = structured.regex_grammar("[0-9]{4}", "r")
    marker = tok.encode("Hello", add_special_tokens=False).ids
    bias = {marker[0]: 100.0}  # the first free token is the marker's (a -inf mask beats +100 later)
    got = run(
        engine,
        {
            "r": SamplingParams(
                temperature=0.0, max_tokens=30, grammar=rx, grammar_after=marker[:1], logit_bias=bias
            )
        },
    )
    ids, finish = got["r"]
    assert ids[0] == marker[0] and finish == "stop"
    assert re.fullmatch("[0-9]{4}", text(tok, ids[1:])), text(tok, ids)


def test_constraint_waits_for_its_marker():
    class Never:  # the matcher must not be touched before the marker
        def __getattr__(self, name):
            raise AssertionError(name)

    c = Constraint(Never(), frozenset({0}), after=(5, 6), state="reasoning")  # type: ignore[arg-type]
    assert [c.advance(t) for t in (6, 5, 9, 5)] == [False] * 4 and not c.masking
    assert c.advance(6) is False and c.state == "active" and c.masking
    opened = Constraint(Never(), frozenset(), after=(6,), opening=4, state="undecided")  # type: ignore[arg-type]
    assert opened.masking and opened.advance(4) is False and opened.state == "reasoning"
    assert opened.advance(6) is False and opened.state == "active"


def test_the_model_may_open_its_reasoning_or_answer_at_once(engine, tok):
    """``grammar_opening``: the first token may open the reasoning (forced here by a bias),
    then the output is free until ``grammar_after``; without it the grammar holds from the
    first token, and the opening id is allowed only there."""
    rx = structured.regex_grammar("[0-9]{4}", "r")
    # A biased token opens the reasoning and, written again, closes it.
    open_id = tok.encode("Hello", add_special_tokens=False).ids[0]
    close, bias = [open_id], {open_id: 100.0}
    got = run(
        engine,
        {
            "opened": SamplingParams(
                temperature=0.0, max_tokens=40, grammar=rx, grammar_after=close, grammar_opening=open_id,
                logit_bias=bias,
            ),
            "direct": SamplingParams(temperature=0.0, max_tokens=40, grammar=rx, grammar_after=close,
                                     grammar_opening=open_id),
        },
    )  # fmt: skip
    ids, finish = got["opened"]
    assert ids[:2] == [open_id, open_id] and finish == "stop"
    assert re.fullmatch("[0-9]{4}", text(tok, ids[2:])), text(tok, ids)
    ids, finish = got["direct"]
    if ids[0] != open_id:  # the model did not open a reasoning: digits at once
        assert re.fullmatch("[0-9]{4}", text(tok, ids)), text(tok, ids)


def test_apply_masks_unpacks_every_bit_including_the_sign_bit():
    V = 70  # three words, the last one partial
    allowed = [0, 31, 32, 63, 64, 69]
    mask = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        mask[0, t // 32] |= _bit(t % 32)
    logits = torch.zeros(2, V)
    apply_masks(logits, [1], mask)
    assert torch.isfinite(logits[1]).nonzero()[:, 0].tolist() == allowed
    assert torch.isfinite(logits[0]).all()  # row 0 was not asked for
