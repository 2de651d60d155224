"""The Ollama API's pure half (pantheon/api/ollama): request bodies -> ``GenerationRequest`` (options,
format, think, tools, messages, the refusals, errors renamed to Ollama's fields), the response
objects (read back with the official ``ollama`` client's own types), durations in nanoseconds,
tool calls assembled from the emitter's deltas, a stream that fails midway, the listing's
numbers, and the middleware's rules for ``/api/*``."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from types import SimpleNamespace

import msgspec
import ollama
import pytest

from pantheon import errors
from pantheon.api import middleware
from pantheon.api.generation import Piece, _pool_error
from pantheon.api.ollama import listing
from pantheon.api.ollama import protocol as ol
from pantheon.api.ollama.generation import OllamaGeneration
from pantheon.chat.emitter import Delta
from pantheon.control.context import Prepared
from pantheon.control.residency import FOREVER
from pantheon.core.description import read_description
from pantheon.errors import ApiError

USER = [{"role": "user", "content": "hi"}]


def chat(body: dict, reasoning: bool | None = True) -> ol.Request:
    b = ol.decode(json.dumps(body).encode(), ol.ChatBody)
    return ol.chat_request(b, ol.model_name(b), reasoning=reasoning)


def generate(body: dict, reasoning: bool | None = True) -> ol.Request:
    b = ol.decode(json.dumps(body).encode(), ol.GenerateBody)
    return ol.generate_request(b, ol.model_name(b), reasoning=reasoning)


def refused(fn, body: dict, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body, **kw)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------- requests


def test_options_map_onto_the_chat_requests_sampling_fields():
    r = chat(
        {
            "model": "m",
            "messages": USER,
            "options": {
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 40,
                "min_p": 0.05,
                "num_predict": 12,
                "num_ctx": 2048,
                "seed": 7,
                "stop": ["\n\n", "END"],
                "repeat_penalty": 1.1,
                "repeat_last_n": 32,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "mirostat": 2,  # not ours: ignored, as Ollama ignores what it does not know
                "num_gpu": 99,
            },
        }
    )
    c = r.chat
    assert (c.temperature, c.top_p, c.top_k, c.min_p) == (0.5, 0.9, 40, 0.05)
    assert (c.max_tokens, c.seed, c.stop) == (12, 7, ["\n\n", "END"])
    assert (c.repetition_penalty, c.repetition_window) == (1.1, 32)
    assert (c.presence_penalty, c.frequency_penalty) == (0.5, 0.25)
    assert r.num_ctx == 2048 and c.model == "m"


def test_ollamas_unlimited_and_random_values_are_our_defaults():
    for n in (-1, -2, 0):
        r = chat({"model": "m", "messages": USER, "options": {"num_predict": n, "seed": -1, "num_ctx": 0}})
        assert r.chat.max_tokens is None and r.chat.seed is None and r.num_ctx is None
    r = chat({"model": "m", "messages": USER, "options": {"stop": "x", "top_k": 40.0, "num_predict": 8.0}})
    assert r.chat.stop == ["x"] and r.chat.top_k == 40 and r.chat.max_tokens == 8


def test_defaults_stream_and_keep_alive():
    r = chat({"model": "m", "messages": USER})
    assert r.chat.stream is True and r.chat.keep_alive is None and r.chat.n == 1
    assert chat({"model": "m", "messages": USER, "stream": False}).chat.stream is False
    assert chat({"model": "m", "messages": USER, "keep_alive": "5m"}).chat.keep_alive == 300.0
    assert chat({"model": "m", "messages": USER, "keep_alive": -1}).chat.keep_alive == FOREVER
    assert chat({"model": "m", "messages": USER, "keep_alive": 0}).chat.keep_alive == 0.0


def test_messages_map_thinking_tool_calls_and_tool_turns():
    msgs = [
        {"role": "System", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "look it up",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    r = chat({"model": "m", "messages": msgs})
    assert r.chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
            "reasoning_content": "look it up",
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "", "name": "get_weather"},
    ]


def test_format_json_and_schema_are_constraints():
    r = chat({"model": "m", "messages": USER, "format": "json"})
    assert r.chat.response_format == "json_object" and r.chat.grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = chat({"model": "m", "messages": USER, "format": schema})
    assert r.chat.response_format == "json_schema" and r.chat.grammar
    assert chat({"model": "m", "messages": USER, "format": ""}).chat.grammar is None
    e = refused(chat, {"model": "m", "messages": USER, "format": "yaml"})
    assert e.param == "format" and 'expected "json" or a JSON schema' in e.message
    odd = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    e = refused(chat, {"model": "m", "messages": USER, "format": odd})  # strict: not enforceable
    assert e.param.startswith("format") and "response_format" not in e.message


def test_think_follows_the_models_template():
    kw = lambda body, reasoning: (
        chat({"model": "m", "messages": USER, **body}, reasoning).chat.chat_template_kwargs
    )
    assert kw({}, True) == {"enable_thinking": True}  # Ollama thinks by default on a thinking model
    assert kw({"think": False}, True) == {"enable_thinking": False}
    assert kw({"think": "max"}, True) == {"enable_thinking": True, "reasoning_effort": "high"}
    assert kw({"think": "low"}, True) == {"enable_thinking": True, "reasoning_effort": "low"}
    assert kw({}, False) == {} and kw({"think": False}, False) == {}
    assert kw({"think": True}, None) == {"enable_thinking": True}  # not routable yet: admit answers
    e = refused(chat, {"model": "m", "messages": USER, "think": True}, reasoning=False)
    assert e.param == "think" and e.message == '"m" does not support thinking'
    assert refused(chat, {"model": "m", "messages": USER, "think": "very"}).param == "think"


def test_tools_logprobs_and_the_tool_choice_extension():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    r = chat(
        {
            "model": "m",
            "messages": USER,
            "tools": tools,
            "tool_choice": "required",
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    assert r.chat.tools == tools and r.chat.tool_choice == "required"
    assert r.chat.logprobs and r.chat.top_logprobs == 3
    assert chat({"model": "m", "messages": USER, "tools": tools}).chat.tool_choice == "auto"


def test_chat_parser_errors_are_renamed_to_ollamas_fields():
    cases = [
        ({"options": {"temperature": 7}}, "options.temperature"),
        ({"options": {"top_k": 1.5}}, "options.top_k"),
        ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        ({"options": {"stop": ["a", "b", "c", "d", "e"]}}, "options.stop"),
        ({"options": {"num_predict": 2.5}}, "options.num_predict"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"keep_alive": "soon"}, "keep_alive"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ]
    for extra, param in cases:
        e = refused(chat, {"model": "m", "messages": USER, **extra})
        assert e.param == param, (extra, e.param, e.message)
        assert "'" + param.split("[")[0] in e.message or param == "keep_alive", e.message
    # an error after mapping (the context rule) names Ollama's field too: the request keeps it
    req = chat({"model": "m", "messages": USER, "options": {"num_predict": 80}}).chat
    e = errors.max_tokens_too_large(64, 80, req.max_tokens_param)
    assert e.param == "options.num_predict" and "'max_tokens'" not in e.message


def test_wrong_types_and_a_missing_model_are_400s_naming_the_field():
    e = refused(chat, {"model": "m", "messages": USER, "options": {"temperature": "hot"}})
    assert e.param == "options.temperature" and "Expected `float | null`, got `str`" in e.message
    assert refused(chat, {"model": "m", "messages": USER, "stream": "yes"}).param == "stream"
    assert refused(chat, {"model": "m", "messages": [{"content": "no role"}]}).param == "messages[0]"
    with pytest.raises(ApiError) as ex:
        ol.model_name(ol.decode(b'{"messages": []}', ol.ChatBody))
    assert ex.value.param == "model" and ex.value.message == "model is required"
    with pytest.raises(ApiError) as ex:
        ol.decode(b"[1]", ol.ChatBody)
    assert ex.value.status == 400


def test_images_are_refused_clearly():
    e = refused(chat, {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]})
    assert e.param == "messages[0].images" and "reads text only" in e.message
    e = refused(generate, {"model": "m", "prompt": "x", "images": ["aGk="]})
    assert e.param == "images"


def test_generate_is_one_turn_under_the_template_or_raw():
    r = generate({"model": "m", "prompt": "hello", "system": "be brief"})
    assert r.chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    assert r.prompt is None and r.where == ["system", "prompt"]
    r = generate({"model": "m", "prompt": "<|im_start|>raw", "raw": True, "options": {"num_predict": 3}})
    assert r.prompt == "<|im_start|>raw" and r.chat.max_tokens == 3
    # raw: no template, and no reasoning (a format's grammar starts at the first token)
    assert r.chat.chat_template_kwargs == {"enable_thinking": False}
    assert generate({"model": "m", "prompt": "x", "raw": True, "think": True}).chat.chat_template_kwargs == {
        "enable_thinking": False
    }


def test_generate_refuses_what_it_does_not_do():
    assert refused(generate, {"model": "m", "prompt": "x", "suffix": "y"}).param == "suffix"
    assert refused(generate, {"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}).param == "template"
    e = refused(generate, {"model": "m", "prompt": "x", "context": [1, 2, 3]})
    assert e.param == "context" and "/api/chat" in e.message
    e = refused(generate, {"model": "m", "prompt": "x", "raw": True, "system": "s"})
    assert e.param == "system" and "raw mode" in e.message


def test_a_bad_message_of_generate_names_prompt_or_system():
    # generate's messages are its system and prompt, checked as such (nothing is renamed after)
    assert refused(generate, {"model": "m", "prompt": 5}).param == "prompt"
    assert refused(generate, {"model": "m", "prompt": "x", "system": ["s"]}).param == "system"
    assert generate({"model": "m", "prompt": "x", "system": "s"}).where == ["system", "prompt"]


# ---------------------------------------------------------------- responses


def _json(obj) -> dict:
    return json.loads(ol.line(obj))


def test_a_chat_chunk_and_its_final_line_are_ollamas_shapes():
    chunk = _json(ol.output("chat", "m", content="Hel", thinking="hmm"))
    assert chunk.keys() == {"model", "created_at", "message", "done"}
    assert chunk["message"] == {"role": "assistant", "content": "Hel", "thinking": "hmm"}
    assert chunk["created_at"].endswith("Z") and chunk["done"] is False
    ollama.ChatResponse(**chunk)
    stats = ol.timing(
        arrived=10.0, placed=10.5, first_token=10.75, ended=11.0, prompt_tokens=7, eval_tokens=3
    )
    final = _json(ol.output("chat", "m", done=True, reason="stop", stats=stats))
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["done"] is True and final["done_reason"] == "stop"
    assert (final["total_duration"], final["load_duration"]) == (1_000_000_000, 500_000_000)
    assert (final["prompt_eval_duration"], final["eval_duration"]) == (250_000_000, 250_000_000)
    assert (final["prompt_eval_count"], final["eval_count"]) == (7, 3)
    assert all(isinstance(final[k], int) for k in ("total_duration", "eval_duration"))
    r = ollama.ChatResponse(**final)
    assert r.done and r.eval_count == 3 and r.message.content == ""


def test_a_generate_line_and_timing_without_a_token():
    g = _json(ol.output("generate", "m", content="abc"))
    assert g == {"model": "m", "created_at": g["created_at"], "response": "abc", "done": False}
    ollama.GenerateResponse(**g)
    stats = ol.timing(arrived=0.0, placed=0.25, first_token=None, ended=1.0, prompt_tokens=4, eval_tokens=0)
    assert (stats.prompt_eval_duration, stats.eval_duration) == (750_000_000, 0)
    final = _json(ol.output("generate", "m", done=True, reason="length", stats=stats))
    assert "eval_count" not in final and final["done_reason"] == "length"  # 0: left out, as Ollama
    assert "context" not in final
    load = _json(ol.output("generate", "m", done=True, reason="load"))
    assert load == {
        "model": "m",
        "created_at": load["created_at"],
        "response": "",
        "done": True,
        "done_reason": "load",
    }


def test_done_reason():
    assert [ol.done_reason(f) for f in ("stop", "length", "tool_calls", None)] == [
        "stop",
        "length",
        "stop",
        "stop",
    ]


def test_logprobs_keep_the_chat_routes_fields():
    lp = [
        {
            "token": "a",
            "logprob": -0.5,
            "bytes": [97],
            "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": None}],
        }
    ]
    out = _json(ol.output("chat", "m", content="a", lps=ol.logprobs(lp)))
    assert out["logprobs"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "b", "logprob": -1.0}]}
    ]
    assert ollama.ChatResponse(**out).logprobs[0].top_logprobs[0].token == "b"


def _call(i, name=None, args="", id=None):
    return Delta("tool_call", index=i, id=id, name=name, arguments=args)


def test_tool_calls_come_out_whole_with_object_arguments():
    calls = ol.ToolCalls()
    assert calls.feed([_call(0, "f", "", "call_1"), _call(0, args='{"a": '), Delta("content", "x")]) == []
    done = calls.feed([_call(0, args="1}"), _call(1, "g", "", "call_2"), _call(1, args="{}")])
    assert [msgspec.to_builtins(c) for c in done] == [
        {"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
    ]
    rest = calls.finish()
    assert [(c.function.index, c.function.name, c.function.arguments) for c in rest] == [(1, "g", {})]
    assert calls.finish() == []
    cut = ol.ToolCalls()
    cut.feed([_call(0, "f", '{"city": "Par')])  # cut off by num_predict
    (c,) = cut.finish()
    assert c.function.arguments == {}
    msg = _json(ol.output("chat", "m", calls=done))["message"]
    assert msg["tool_calls"] == [
        {"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
    ]
    assert ollama.ChatResponse(model="m", message=msg).message.tool_calls[0].function.arguments == {"a": 1}


def test_errors_are_ollamas_error_object():
    e = errors.ollama_model_not_found("llama3")
    assert e.ollama_body() == {"error": e.message}
    assert e.status == 404 and 'model "llama3" not found' in e.message and "/api/tags" in e.message
    e = errors.ollama_manage_unsupported("/api/pull")
    assert e.status == 501 and "--models-dir" in e.message
    r = ollama.ResponseError(json.dumps(e.ollama_body()), e.status)
    assert r.error == e.message and r.status_code == 501


class _Failing(OllamaGeneration):
    async def _all_pieces(self):  # type: ignore[override]
        yield Piece(0, [Delta("content", "Hel")], None)
        raise _pool_error(ConnectionError("gone"), self.id)


def test_a_stream_that_fails_midway_ends_with_an_error_line():
    req = chat({"model": "m", "messages": USER}).chat
    gen = _Failing(None, SimpleNamespace(name="m"), req, Prepared([1, 2, 3], "", False, 8), "fp", kind="chat")

    async def run() -> list[bytes]:
        return [c async for c in gen.stream_chunks()]

    lines = [json.loads(x) for x in asyncio.run(run())]
    assert lines[0]["message"]["content"] == "Hel" and lines[0]["done"] is False
    assert list(lines[-1]) == ["error"] and "internal error" in lines[-1]["error"].lower()
    assert len(lines) == 2


# ---------------------------------------------------------------- the listing


def test_human_numbers_are_ollamas():
    assert [listing.human_number(n) for n in (7_000_000_000, 7_241_732_096, 135_070_000, 134_000_000)] == [
        "7B",
        "7.2B",
        "135.07M",
        "134M",
    ]
    assert [listing.human_number(n) for n in (332_160, 999, 0)] == ["332K", "999", "0"]


def test_a_models_parameters_and_files(tiny_model):
    raw = (tiny_model / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    counted = sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    shape = read_description(tiny_model)
    assert listing.parameter_count(shape) == counted  # exactly the checkpoint's tensors
    files = listing.files_of(str(tiny_model))
    assert files.format == "safetensors" and files.gguf_info is None
    assert files.size == sum(f.stat().st_size for f in tiny_model.iterdir() if f.is_file())
    assert len(files.digest) == 64 and files.digest == listing.files_of(str(tiny_model)).digest
    served = listing.Served("tiny", str(tiny_model), ())
    d = listing.details(served, files, shape)
    assert (d.format, d.family, d.families, d.quantization_level) == (
        "safetensors",
        "qwen3",
        ["qwen3"],
        "BF16",
    )
    info = listing.model_info(files, shape)
    assert info["general.architecture"] == "qwen3" and info["qwen3.context_length"] == shape.context_limit
    assert listing.capabilities(served) == ["completion"]  # not loaded: its template is not known


def test_a_gguf_files_type_name():
    assert listing._file_type(3, []) == "Q4_1" and listing._file_type(15, []) == "Q4_K_M"
    assert listing._file_type(None, ["F32", "Q8_0", "Q8_0"]) == "Q8_0"
    assert listing._file_type(None, []) == ""


# ---------------------------------------------------------------- the middleware's rules


def test_ollamas_routes_ask_json_of_browsers_only():
    assert not middleware.takes_json("POST", "/api/chat")  # curl -d, Ollama's own examples
    assert middleware.takes_json("POST", "/api/chat", browser=True)
    assert middleware.takes_json("POST", "/v1/chat/completions")
    assert not middleware.takes_json("GET", "/api/tags", browser=True)
    err = errors.shutting_down()
    assert middleware.error_json("/api/chat", err) == {"error": err.message}
    assert middleware.error_json("/v1/models", err) == err.body()
