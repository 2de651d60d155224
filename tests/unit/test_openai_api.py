"""Unit tests of the OpenAI surface: request validation, the response/chunk builders checked against
the official OpenAPI schemas in ../shared/specs, and the config object (the registry's
routing is tested in tests/unit/test_registry.py).

``check`` and ``schema_validator`` live in tests/helpers/openapi.py (tests/e2e use them too).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pantheon.api.openai import protocol as oa
from pantheon.api.openai.protocol import parse_chat_request
from pantheon.config.settings import ConfigError, build_config, parse_dies, parse_size
from pantheon.errors import ApiError, invalid_param, model_not_found, no_model_loaded, server_busy

from helpers.openapi import check, schema_validator
from helpers.paths import need_specs


def read_sse(path: Path) -> list:
    out = []
    for block in path.read_text().split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_real_streams_validate_after_nullable_fix():
    """The helper itself: OpenAI's own recorded chunks must pass, and null finish_reason with them."""
    SPECS = need_specs()
    for f in sorted(SPECS.glob("openai-stream-*.sse")):
        events = read_sse(f)
        assert events[-1] == "[DONE]"
        for ev in events[:-1]:
            check("CreateChatCompletionStreamResponse", ev)
    bad = read_sse(SPECS / "openai-stream-length-usage.sse")[0]
    bad = copy.deepcopy(bad)
    bad["choices"][0]["finish_reason"] = "bogus"
    assert list(schema_validator("CreateChatCompletionStreamResponse").iter_errors(bad))


# ---------------------------------------------------------------- request validation


def body(**kw):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    base.update(kw)
    return json.dumps(base).encode()


def bad(raw, param):
    with pytest.raises(ApiError) as ei:
        parse_chat_request(raw)
    e = ei.value
    assert e.status == 400
    assert e.type == "invalid_request_error"
    assert e.param == param, (e.param, e.message)
    check("ErrorResponse", e.body())
    return e


def test_minimal_request_defaults():
    r = parse_chat_request(body())
    assert r.model == "m" and r.n == 1 and r.temperature == 1.0 and not r.stream
    assert r.messages == [{"role": "user", "content": "hi"}]
    sp = r.sampling(max_tokens=10, stop_token_ids=[2])
    assert sp.temperature == 1.0 and sp.max_tokens == 10 and sp.stop_token_ids == [2]


def test_full_request():
    r = parse_chat_request(
        body(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ],
            max_completion_tokens=7,
            max_tokens=99,
            temperature=0,
            top_p=0.5,
            stop="END",
            seed=3,
            n=2,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
                    },
                }
            ],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={"type": "json_object"},
            user="u1",
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.1,
            min_tokens=2,
            ignore_eos=True,
            session_id="s1",
            chat_template_kwargs={"enable_thinking": False},
            some_unknown_field={"x": 1},
        )
    )
    assert r.messages[0]["role"] == "system"
    assert r.messages[1]["content"] == "a\nb"
    assert r.messages[2]["content"] == ""
    assert r.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # parsed by the renderer
    assert r.messages[3]["tool_call_id"] == "call_1"
    assert r.max_tokens == 7 and r.stop == ["END"] and r.include_usage
    assert r.tool_choice == "function" and r.tool_choice_name == "f" and r.tools_enabled
    assert r.response_format == "json_object" and r.session_id == "s1"
    sp = r.sampling(max_tokens=7, stop_token_ids=[])
    assert sp.temperature == 0.0 and sp.top_k == 5 and sp.min_tokens == 2 and sp.ignore_eos
    assert sp.logprobs and sp.top_logprobs == 3 and sp.seed == 3


def test_model_is_optional():
    r = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    assert r.model is None


def test_header_session_id():
    assert parse_chat_request(body(), header_session="h").session_id == "h"
    assert parse_chat_request(body(session_id="b"), header_session="h").session_id == "b"


@pytest.mark.parametrize(
    "raw,param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (body(messages=[]), "messages"),
        (body(messages="hi"), "messages"),
        (body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (body(messages=[{"role": "user"}]), "messages[0].content"),
        (body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0].type",
        ),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (body(model=5), "model"),
        (body(max_tokens="5"), "max_tokens"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_completion_tokens=-1), "max_completion_tokens"),
        (body(max_tokens=True), "max_tokens"),
        (body(temperature="hot"), "temperature"),
        (body(temperature=2.5), "temperature"),
        (body(top_p=1.5), "top_p"),
        (body(n=0), "n"),
        (body(n=1.5), "n"),
        (body(seed="x"), "seed"),
        (body(stop=5), "stop"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (body(presence_penalty=3), "presence_penalty"),
        (body(frequency_penalty=-3), "frequency_penalty"),
        (body(logprobs="yes"), "logprobs"),
        (body(top_logprobs=3), "top_logprobs"),
        (body(logprobs=True, top_logprobs=21), "top_logprobs"),
        (body(stream="yes"), "stream"),
        (body(stream_options={"include_usage": True}), "stream_options"),
        (body(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
        (body(tools={"type": "function"}), "tools"),
        (body(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0].type"),
        (body(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
        (body(tool_choice="sometimes"), "tool_choice"),
        (body(tool_choice="required"), "tool_choice"),
        (
            body(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice.function.name",
        ),
        (body(response_format={"type": "xml"}), "response_format.type"),
        (body(response_format="json"), "response_format"),
        (body(top_k="3"), "top_k"),
        (body(min_p=2), "min_p"),
        (body(repetition_penalty=0), "repetition_penalty"),
        (body(min_tokens=5, max_tokens=2), "min_tokens"),
        (body(ignore_eos="no"), "ignore_eos"),
        (body(user=5), "user"),
        (body(session_id=5), "session_id"),
    ],
)
def test_invalid_values_name_their_param(raw, param):
    bad(raw, param)


def test_stop_list_and_empty_strings():
    assert parse_chat_request(body(stop=["a", "", "b"])).stop == ["a", "b"]
    assert parse_chat_request(body(stop=None)).stop == []
    assert parse_chat_request(body(stop="")).stop == []


def test_tool_choice_none_disables_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = parse_chat_request(body(tools=tools, tool_choice="none"))
    assert r.tools and not r.tools_enabled
    r = parse_chat_request(body(tools=tools))
    assert r.tools_enabled and r.tools[0]["function"]["parameters"]["type"] == "object"


def test_valid_requests_conform_to_request_schema():
    """What we accept as valid the OpenAI request schema accepts too (a sanity check of tests)."""
    for raw in (
        body(),
        body(stop=["x"], n=2, seed=1, logprobs=True, top_logprobs=2),
        body(stream=True, stream_options={"include_usage": True}),
    ):
        check("CreateChatCompletionRequest", json.loads(raw))


# ---------------------------------------------------------------- builders against the schemas


def test_completion_shape():
    cid = oa.completion_id()
    assert cid.startswith("chatcmpl-") and len(cid) == len("chatcmpl-") + 32
    assert cid != oa.completion_id()
    lp = [oa.token_logprob("hi", -0.5, b"hi", [("hi", -0.5, b"hi"), ("ho", -1.0, b"ho")])]
    choices = [
        oa.choice(0, oa.message("hello", reasoning="hmm"), "stop", lp),
        oa.choice(1, oa.message("", tool_calls=[oa.tool_call(oa.tool_call_id(), "f", "{}")]), "tool_calls"),
        oa.choice(2, oa.message("x"), "length"),
    ]
    out = oa.chat_completion(cid, oa.now(), "m", "fp_x", choices, oa.usage(5, 3))
    check("CreateChatCompletionResponse", out)
    assert out["choices"][1]["message"]["content"] is None
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    check("CompletionUsage", out["usage"])
    # The OpenAI SDK parses it, strictly.
    from openai.types.chat import ChatCompletion

    parsed = ChatCompletion.model_validate(json.loads(oa.dumps(out)))
    assert parsed.choices[1].message.tool_calls[0].function.name == "f"


def test_chunk_shapes():
    cid, t = oa.completion_id(), oa.now()
    chunks = [
        oa.chunk(
            cid, t, "m", "fp", [oa.chunk_choice(0, {"role": "assistant", "content": ""})], include_usage=True
        ),
        oa.chunk(
            cid,
            t,
            "m",
            "fp",
            [oa.chunk_choice(0, {"content": "a"}, None, [oa.token_logprob("a", -0.1, b"a")])],
            include_usage=True,
        ),
        oa.chunk(
            cid,
            t,
            "m",
            "fp",
            [
                oa.chunk_choice(
                    0,
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_x",
                                "type": "function",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ]
                    },
                )
            ],
        ),
        oa.chunk(
            cid,
            t,
            "m",
            "fp",
            [oa.chunk_choice(0, {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})],
        ),
        oa.chunk(cid, t, "m", "fp", [oa.chunk_choice(0, {}, "stop")], include_usage=True),
        oa.chunk(cid, t, "m", "fp", [], include_usage=True, usage_=oa.usage(1, 2)),
    ]
    for c in chunks:
        check("CreateChatCompletionStreamResponse", c)
        s = oa.sse(c)
        assert s.startswith(b"data: ") and s.endswith(b"\n\n")
    assert chunks[0]["usage"] is None and "usage" not in chunks[2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 3
    from openai.types.chat import ChatCompletionChunk

    for c in chunks:
        ChatCompletionChunk.model_validate(json.loads(oa.dumps(c)))
    assert oa.SSE_DONE == b"data: [DONE]\n\n"


def test_models_and_errors_shapes():
    lst = oa.model_list([oa.model_object("a", 1, 4096), oa.model_object("b", 2, None)])
    check("ListModelsResponse", lst)
    assert lst["data"][0]["max_model_len"] == 4096
    for e in (model_not_found("x"), no_model_loaded(), server_busy(), invalid_param("stop", "bad")):
        check("ErrorResponse", e.body())
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert model_not_found("x").status == 404
    assert model_not_found("x").code == "model_not_found"
    assert server_busy().status == 429 and server_busy().code == "server_busy"
    assert no_model_loaded().status == 503


def test_logprob_non_finite_and_bytes():
    e = oa.token_logprob("bytes:\\xe2", float("-inf"), b"\xe2")
    assert e["logprob"] == -9999.0 and e["bytes"] == [0xE2]
    check("ChatCompletionTokenLogprob", e)


# ---------------------------------------------------------------- config


def test_config_defaults_and_flags_beat_env():
    c = build_config({}, {})
    assert c.slots == 8 and c.queue_depth == 32 and c.prefill_chunk == 512 and not c.single_user
    c = build_config(
        {"slots": 4, "queue_depth": 2, "prefill_chunk": 64},
        {"PANTHEON_BATCH_SLOTS": "0", "PANTHEON_QUEUE_DEPTH": "9", "PANTHEON_PREFILL_CHUNK": "16"},
    )
    assert (c.slots, c.queue_depth, c.prefill_chunk) == (4, 2, 64)


def test_config_env_and_aliases():
    assert build_config({}, {"PANTHEON_BATCH_SLOTS": "0"}).single_user
    assert build_config({}, {"QWEN35_BATCH_SLOTS": "0"}).single_user
    assert build_config({}, {"QWEN35_BATCH_SLOTS": "1"}).slots == 8
    assert build_config({}, {"PANTHEON_BATCH_SLOTS": "4", "QWEN35_BATCH_SLOTS": "0"}).slots == 4
    assert build_config({}, {"BS_QUEUE_DEPTH": "3"}).queue_depth == 3
    assert build_config({}, {"PANTHEON_QUEUE_DEPTH": "5", "BS_QUEUE_DEPTH": "3"}).queue_depth == 5
    assert build_config({}, {"QWEN35_BS_PREFILL_CHUNK": "32"}).prefill_chunk == 32
    assert build_config({"slots": 1}, {}).single_user


def test_config_refusals():
    with pytest.raises(ConfigError, match="QWEN35_GPU_FULL_LOGITS"):
        build_config({}, {"QWEN35_GPU_FULL_LOGITS": "1"})
    with pytest.raises(ConfigError, match="BS_QUEUE_DEPTH"):
        build_config({}, {"BS_QUEUE_DEPTH": "many"})
    with pytest.raises(ConfigError):
        build_config({"slots": 0}, {})
    with pytest.raises(ConfigError):
        build_config({"port": 70000}, {})
    with pytest.raises(ConfigError, match="cpu:3"):
        build_config({"cpu_dies": 2, "models": [{"path": "/m", "dies": "cpu:3"}]}, {})


def test_config_sizes_dies_and_models():
    assert parse_size("2GiB", "x") == 2 << 30
    assert parse_size("512MiB", "x") == 512 << 20
    assert parse_size("1000", "x") == 1000
    with pytest.raises(ConfigError):
        parse_size("lots", "x")
    assert parse_dies("0,1") == ("cuda:0", "cuda:1")
    assert parse_dies("cpu:0") == ("cpu:0",)
    with pytest.raises(ConfigError):
        parse_dies("gpu0")
    c = build_config(
        {
            "cpu_dies": 2,
            "cpu_die_budget": "1GiB",
            "models": [{"path": "/x/tiny"}, {"path": "/y", "name": "b", "dies": "cpu:1"}],
        },
        {},
    )
    assert c.cpu_die_budget == 1 << 30
    assert [(m.name, m.dies) for m in c.models] == [("tiny", ()), ("b", ("cpu:1",))]
    assert c.fingerprint.startswith("fp_")
    assert (
        c.fingerprint
        == build_config(
            {
                "cpu_dies": 2,
                "cpu_die_budget": "1GiB",
                "models": [{"path": "/x/tiny"}, {"path": "/y", "name": "b", "dies": "cpu:1"}],
            },
            {},
        ).fingerprint
    )


def test_repetition_window_is_a_request_field():
    def window(**kw):
        r = parse_chat_request(body(repetition_penalty=1.3, **kw))
        return r.repetition_window, r.sampling(max_tokens=4, stop_token_ids=[]).repetition_window

    assert window() == (64, 64)  # llama.cpp's repeat_last_n default
    assert window(repetition_window=256) == (256, 256)
    assert window(repeat_last_n=-1) == (-1, -1)  # llama.cpp's name; -1: the whole sequence
    assert window(repeat_last_n=0, repetition_window=8) == (8, 8)  # ours wins
    for bad in ({"repetition_window": -2}, {"repeat_last_n": "all"}, {"repetition_window": 1.5}):
        with pytest.raises(ApiError) as e:
            parse_chat_request(body(**bad))
        assert e.value.status == 400 and e.value.param == next(iter(bad))


def test_the_engine_penalizes_the_window_it_is_given():
    from workers.engine import _window

    toks = list(range(10))
    assert _window(toks, 3) == [7, 8, 9] and _window(toks, -1) == toks
    assert _window(toks, 0) == [] and _window(toks, 64) == toks


def test_deep_nesting_and_lone_surrogates_are_400s_not_500s():
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(ApiError) as e:
        parse_chat_request(deep)
    assert e.value.status == 400 and "nested deeper than 64" in e.value.message
    nested = {"x": 1}
    for _ in range(70):
        nested = {"x": nested}
    with pytest.raises(ApiError) as e:
        parse_chat_request(body(chat_template_kwargs=nested))
    assert e.value.status == 400 and "deeper than 64" in e.value.message
    lone = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    with pytest.raises(ApiError) as e:
        parse_chat_request(lone)
    assert e.value.status == 400 and e.value.param == "messages[0].content"
    assert "surrogate" in e.value.message
    # a pair is one character (an emoji), and fine
    ok = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert parse_chat_request(ok).messages[0]["content"] == "\U0001f600"


def test_logit_bias_is_checked_and_carried():
    r = parse_chat_request(body(logit_bias={"5": 10, "7": -100}))
    assert r.sampling(max_tokens=2, stop_token_ids=[]).logit_bias == {5: 10.0, 7: -100.0}
    for bad in ({"abc": 5}, {"-1": 5}, {"5": 101}, {"5": "x"}, {"5": True}, [1, 2]):
        with pytest.raises(ApiError) as e:
            parse_chat_request(body(logit_bias=bad))
        assert e.value.status == 400 and e.value.param == "logit_bias"
    with pytest.raises(ApiError, match="'abc' is not a token id"):
        parse_chat_request(body(logit_bias={"abc": 5}))
