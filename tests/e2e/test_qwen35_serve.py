"""A hybrid model served end to end: ``tiny-qwen3.5`` (Gated DeltaNet layers with a recurrent state
per slot, one full-attention layer on the paged KV cache; the Hub's
Qwen3_5ForConditionalGeneration layout, vision tower and MTP head included and skipped at load),
through the official ``openai`` client.

Random weights, so the text is noise: the checks are on structure, token counts and finish
reasons, reasoning on and off, tool calls forced in the model's XML format (arguments valid
against the schema), the router's books (the state pools beside the KV pool, in ``/admin/dies``,
``/admin/state`` and ``/metrics``), the advertised context, a media part refused naming the model,
and batched decode across slots (each of four concurrent seeded requests writes what it writes
alone).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from pantheon.core.sizing import estimate, read_shape
from pantheon.snapshot import decode_snapshot

from helpers.serve import Server, check_error

pytestmark = pytest.mark.timeout(180)

NAME = "q35"
MSG = [{"role": "user", "content": "What is the weather like?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}

# Only bounded values: a raw-text string parameter of the XML format runs until max_tokens on
# random weights, an enum and a ranged integer end.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "h24": {"type": "boolean"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def q35_path(model_factory):
    return model_factory("tiny-qwen3.5")


@pytest.fixture(scope="module")
def q35(q35_path, tmp_path_factory):
    s = Server(
        ["--model", str(q35_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("qwen35-logs") / "serve.log",
    )
    try:
        s.wait_ready((NAME,))
        yield s
    finally:
        s.stop()


def _gauge(text: str, series: str) -> float:
    """The value of one sample (``name{labels}``) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def _die(s: Server) -> dict:
    return {d["die"]: d for d in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]}["cpu:0"]


def test_the_die_books_the_state_pools_beside_the_kv_pool(q35, q35_path):
    d = _die(q35)
    inst = d["instances"][0]
    iid = inst["instance"]
    booked = d["bookings"][iid]
    assert booked["state_bytes"] > 0 and booked["kv_bytes"] > 0 and booked["weights_bytes"] > 0
    assert d["state_bytes"] == booked["state_bytes"] == inst["state_bytes"]
    assert d["used_bytes"] == d["weights_bytes"] + d["kv_bytes"] + d["state_bytes"]
    # the state pools hold whole slots' states (the worker's real figure), and tokens are the
    # KV pool's alone: only the attention layer keeps K and V
    est = estimate(read_shape(q35_path), cpu_path=inst.get("cpu_path") or "fp32")
    assert booked["state_bytes"] % est.state_per_slot == 0
    assert booked["state_bytes"] // est.state_per_slot > inst["slots"]
    assert inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token
    snap = decode_snapshot(httpx.get(q35.url + "/admin/state", timeout=10).content)
    die = next(x for x in snap.dies if x.id == "cpu:0")
    assert die.state_bytes == booked["state_bytes"] and die.kv_bytes == booked["kv_bytes"]
    assert next(i for i in snap.instances if i.id == iid).state_bytes == booked["state_bytes"]
    metrics = httpx.get(q35.url + "/metrics", timeout=10).text
    assert _gauge(metrics, 'pantheon_die_memory_state_bytes{die="cpu:0"}') == booked["state_bytes"]
    assert _gauge(metrics, 'pantheon_die_memory_kv_cache_bytes{die="cpu:0"}') == booked["kv_bytes"]
    inst_series = f'pantheon_instance_state_bytes{{instance="{iid}",model_name="{NAME}"}}'
    assert _gauge(metrics, inst_series) == booked["state_bytes"]
    # the load log says what of the checkpoint the engine left out
    out = q35.log.read_text(errors="replace")
    assert "the vision tower (model.visual.*)" in out and "(mtp.*)" in out


def test_models_advertises_the_context_the_kv_pool_holds(q35, q35_path):
    (m,) = q35.client().models.list().data
    mml = (m.model_extra or {})["max_model_len"]
    cfg = json.loads((q35_path / "config.json").read_text())
    assert mml == cfg["text_config"]["max_position_embeddings"]  # the pool holds the full context
    inst = _die(q35)["instances"][0]
    assert mml <= inst["kv_pool_tokens"]
    # a prompt and completion of that length is taken; one token more is not
    r = httpx.post(
        q35.url + "/v1/chat/completions",
        json={"model": NAME, "messages": MSG, "max_tokens": mml},
        timeout=30,
    )
    check_error(r, 400, code="context_length_exceeded")
    assert str(mml) in r.json()["error"]["message"]


def test_chat_thinks_by_default_and_not_when_told(q35):
    c = q35.client()
    # sampled, seeded: greedy on random weights writes only newlines, which no parser keeps
    r = c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=12, seed=1, extra_body={"ignore_eos": True}
    )
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 12
    assert (ch.message.model_extra or {}).get("reasoning_content")  # the template opened <think>
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 12

    r = c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=12, seed=1, extra_body={**NO_THINK, "ignore_eos": True}
    )
    ch = r.choices[0]
    assert not (ch.message.model_extra or {}).get("reasoning_content")
    assert ch.message.content and ch.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12


def test_a_stream_says_what_the_whole_answer_says(q35):
    c = q35.client()
    # seeded: the same tokens whether streamed or not
    kw = dict(model=NAME, messages=MSG, max_tokens=10, seed=3, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(
        (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices
    )
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10 and not chunks[-1].choices
    msg = whole.choices[0].message
    assert reasoning and reasoning == (msg.model_extra or {}).get("reasoning_content")
    assert content == (msg.content or "")
    assert whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_is_one_valid_call(q35, stream):
    c = q35.client()
    kw = dict(
        model=NAME,
        messages=MSG,
        max_tokens=64,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for ch in c.chat.completions.create(**kw, stream=True):
            if not ch.choices:
                continue
            for tc in ch.choices[0].delta.tool_calls or []:
                got = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    got["name"] += tc.function.name or ""
                    got["arguments"] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        assert list(calls) == [0]
        name, args = calls[0]["name"], calls[0]["arguments"]
    else:
        r = c.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        (call,) = r.choices[0].message.tool_calls or []
        assert call.id.startswith("call_") and call.type == "function"
        name, args = call.function.name, call.function.arguments
    assert finish == "tool_calls"
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER)


def test_a_required_tool_choice_is_a_valid_call_of_one_of_the_tools(q35):
    r = q35.client().chat.completions.create(
        model=NAME, messages=MSG, max_tokens=64, tools=TOOLS, tool_choice="required"
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_a_media_part_is_a_400_naming_the_model(q35, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as ei:
        q35.client().chat.completions.create(model=NAME, messages=messages, max_tokens=4)  # pyright: ignore[reportArgumentType]
    err = ei.value.body
    assert isinstance(err, dict)
    assert err["param"] == "messages[0].content[1].type"
    assert repr(NAME) in err["message"] and "text only" in err["message"]


def test_n_and_concurrent_requests_decode_together(q35):
    c = q35.client()
    r = c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=8, n=2, extra_body={**NO_THINK, "ignore_eos": True}
    )
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 16

    prompts = [f"Tell me about {w}." for w in ("the sea", "mountains", "a city at night", "bread")]

    async def one(ac: openai.AsyncOpenAI, i: int, salt: str):
        return await ac.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=16,
            seed=i,  # a seeded request draws the same tokens whatever shares its batch
            extra_body={**NO_THINK, "ignore_eos": True, "cache_salt": salt},
        )

    async def run():
        ac = q35.aclient()
        alone = [await one(ac, i, f"alone{i}") for i in range(len(prompts))]
        together = await asyncio.gather(*(one(ac, i, f"together{i}") for i in range(len(prompts))))
        return alone, together

    alone, together = asyncio.run(run())
    for a, t in zip(alone, together):
        assert t.choices[0].finish_reason == "length"
        assert t.usage is not None and t.usage.completion_tokens == 16
        # each slot's recurrent state is its own: batched, a request writes what it writes alone
        assert t.choices[0].message.content and t.choices[0].message.content == a.choices[0].message.content
