"""One request model below HTTP (pantheon/core/request.py): each front end maps its body to a
``GenerationRequest`` whose errors name the caller's own field, and one ``fit()``
(pantheon/control/context.py) applies the model's defaults and the context rule, whatever the
front end. Torch-free: the tiny model's tokenizer and template, no worker."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pantheon.api.ollama import protocol as ol
from pantheon.api.openai import responses as R
from pantheon.api.openai.completions import parse_completion_request
from pantheon.api.openai.protocol import parse_chat_request
from pantheon.control.context import fit
from pantheon.control.registry import Instance
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError

from helpers.instances import ready_instance

ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "hi"}]


def chat(**body) -> GenerationRequest:
    return parse_chat_request({"messages": HI, **body})


def responses(**body) -> GenerationRequest:
    return R.parse_responses_request({"input": "hi", **body}).chat


def ollama(**body) -> GenerationRequest:
    b = ol.decode(json.dumps({"model": "m", "messages": HI, **body}).encode(), ol.ChatBody)
    return ol.chat_request(b, "m", reasoning=False).chat


def ollama_raw(prompt: str, **body) -> GenerationRequest:
    b = ol.decode(json.dumps({"model": "m", "prompt": prompt, "raw": True, **body}).encode(), ol.GenerateBody)
    return ol.generate_request(b, "m").chat


def completions(**body) -> GenerationRequest:
    return parse_completion_request(json.dumps(body)).chat


def refused(make, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        make(**body)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------- the layering


def test_the_request_model_and_its_fitting_import_no_http_layer():
    """core/request.py, control/ and models/ import nothing from pantheon.api (nor quart or
    torch): the request model sits below every front end."""
    code = (
        "import sys; import pantheon.core.request, pantheon.control.context, "
        "pantheon.models.generation_defaults; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'quart') "
        "or m.startswith('pantheon.api')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for folder in ("control", "models"):
        for f in sorted((ROOT / "pantheon" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    assert not node.module.startswith("pantheon.api"), (f, node.module)
                elif isinstance(node, ast.Import):
                    assert not any(a.name.startswith("pantheon.api") for a in node.names), f


# ---------------------------------------------------------------- mapping: one model, each API's names


def test_every_front_end_maps_to_the_same_request():
    want = (0.5, 0.9, 7, ["END"], 12, 1.1, 32)

    def got(r: GenerationRequest):
        return (
            r.temperature,
            r.top_p,
            r.seed,
            r.stop,
            r.max_tokens,
            r.repetition_penalty,
            r.repetition_window,
        )

    sampling = {"temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["END"]}
    extras = {"repetition_penalty": 1.1, "repetition_window": 32}
    assert got(chat(**sampling, **extras, max_tokens=12)) == want
    assert got(chat(**sampling, **extras, max_completion_tokens=12)) == want
    assert got(responses(**sampling, **extras, max_output_tokens=12)) == want
    assert got(completions(prompt="x", **sampling, **extras, max_tokens=12)) == want
    options = {**sampling, "num_predict": 12, "repeat_penalty": 1.1, "repeat_last_n": 32}
    assert got(ollama(options=options)) == want
    # what each left out is unset for the model's defaults, whichever API it came by
    for r in (chat(), responses(), ollama(), completions(prompt="x")):
        assert r.unset == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "repetition_window", "max_tokens"}  # fmt: skip


@pytest.mark.parametrize(
    "make, body, param",
    [
        (chat, {"max_tokens": 0}, "max_tokens"),
        (chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (responses, {"max_output_tokens": 0}, "max_output_tokens"),
        (completions, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        (ollama, {"options": {"num_predict": 2**64}}, "options.num_predict"),
    ],
)
def test_a_bad_max_tokens_names_the_callers_field(make, body, param):
    e = refused(make, **body)
    assert e.param == param and e.message.startswith(f"'{param}' ")


@pytest.mark.parametrize(
    "make, body, param",
    [
        (chat, {"temperature": 3}, "temperature"),
        (responses, {"temperature": 3}, "temperature"),
        (completions, {"prompt": "x", "temperature": 3}, "temperature"),
        (ollama, {"options": {"temperature": 3}}, "options.temperature"),
    ],
)
def test_a_range_is_one_check_naming_the_callers_field(make, body, param):
    e = refused(make, **body)
    assert (e.param, e.message) == (param, f"'{param}' must be between 0.0 and 2.0, got 3.0")


def test_nested_fields_are_named_where_the_caller_put_them():
    bad_schema = {"type": "object", "properties": {"a": {"type": "nope"}}}
    flat = {"type": "function", "name": "f", "parameters": bad_schema}
    assert refused(responses, tools=[flat], tool_choice="required").param == "tools[0].parameters"
    assert refused(chat, tools=[{"type": "function", "function": {"name": "f", "parameters": bad_schema}}],
                   tool_choice="required").param == "tools[0].function.parameters"  # fmt: skip
    assert (
        refused(responses, tools=[flat], tool_choice={"type": "function", "name": "g"}).param
        == "tool_choice.name"
    )
    fmt = {"type": "json_schema", "name": "x", "schema": bad_schema}
    assert refused(responses, text={"format": fmt}).param.startswith("text.format.schema")
    assert refused(ollama, format=bad_schema).param.startswith("format")
    e = refused(responses, reasoning={"effort": "lots"})
    assert e.param == "reasoning.effort" and e.message.startswith("'reasoning.effort' must be one of")
    e = refused(ollama, options={"stop": ["a", "b", "c", "d", "e"]})
    assert (e.param, e.message) == ("options.stop", "'options.stop' takes at most 4 sequences, got 5")


def test_the_request_keeps_the_callers_names_for_later_errors():
    assert chat(max_tokens=5).max_tokens_param == "max_tokens"
    assert chat(max_completion_tokens=5).max_tokens_param == "max_completion_tokens"
    assert responses().max_tokens_param == "max_output_tokens"
    assert ollama().max_tokens_param == "options.num_predict"
    assert completions(prompt="x").max_tokens_param == "max_tokens"
    assert responses(text={"format": {"type": "json_object"}}).param("response_format") == "text.format"
    assert ollama(format="json").param("response_format") == "format"
    assert ollama().param("stop") == "options.stop" and chat().param("stop") == "stop"


def test_messages_are_one_form_whichever_api():
    want = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"},
    ]  # fmt: skip
    openai = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"},
            ]
        }  # fmt: skip
    )
    assert openai.messages == want
    items = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
    ]
    assert R.parse_responses_request({"input": items}).chat.messages == want


# ---------------------------------------------------------------- fit(): defaults and the context rule, once


@pytest.fixture(scope="module")
def tiny_assets(model_factory):
    from pantheon.models.assets import ModelAssets

    return ModelAssets(model_factory("tiny"))


def _inst(assets, *, context: int = 64, pool: int | None = None, params: dict | None = None) -> Instance:
    inst = ready_instance(assets)
    inst.max_model_len, inst.kv_pool_tokens, inst.params = context, pool, dict(params or {})
    return inst


def too_large(limit: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested at least "
        f"{max_tokens + 1} tokens ({max_tokens} in the completion)."
    )


@pytest.mark.parametrize(
    "make, body, param",
    [
        (chat, {"max_tokens": 64}, "max_tokens"),
        (chat, {"max_completion_tokens": 64}, "max_completion_tokens"),
        (responses, {"max_output_tokens": 64}, "max_output_tokens"),
        (ollama, {"options": {"num_predict": 64}}, "options.num_predict"),
        (completions, {"prompt": "x", "max_tokens": 64}, "max_tokens"),
        (ollama_raw, {"prompt": "x", "options": {"num_predict": 64}}, "options.num_predict"),
    ],
)
def test_the_context_rule_is_one_and_names_the_callers_field(tiny_assets, make, body, param):
    with pytest.raises(ApiError) as e:
        fit(_inst(tiny_assets), make(**body))
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", param)
    assert e.value.message == too_large(64, 64)


def test_the_limit_is_the_pool_or_num_ctx_when_smaller(tiny_assets):
    with pytest.raises(ApiError) as e:
        fit(_inst(tiny_assets, pool=40), chat(max_tokens=40))
    assert e.value.message == too_large(40, 40)
    with pytest.raises(ApiError) as e:
        fit(_inst(tiny_assets), ollama(options={"num_ctx": 32, "num_predict": 40}))
    assert e.value.message == too_large(32, 40) and e.value.param == "options.num_predict"
    # without max_tokens a conversation's completion takes the rest of the limit
    prep = fit(_inst(tiny_assets), ollama(options={"num_ctx": 32}))
    assert len(prep.prompt_ids) + prep.max_tokens == 32


def test_fit_fills_the_models_defaults_and_caps_with_a_default_max_tokens(tiny_assets):
    inst = _inst(tiny_assets, params={"temperature": 0.25, "top_k": 20, "max_tokens": 5})
    for req in (chat(), responses(), ollama(), completions(prompt="hello"), ollama_raw("hello")):
        prep = fit(inst, req)
        assert (req.temperature, req.top_k, prep.max_tokens) == (0.25, 20, 5), req
        assert req.max_tokens is None  # a default is a ceiling, never a reservation
    given = chat(temperature=1.0, max_tokens=9)
    assert fit(inst, given).max_tokens == 9 and given.temperature == 1.0  # the client's stay
    assert fit(inst, given).max_tokens == 9  # exact to repeat (another replica, a retry)


def test_a_raw_prompt_must_fit_and_is_never_capped(tiny_assets):
    inst = _inst(tiny_assets)
    n = len(fit(inst, completions(prompt="hello world")).prompt_ids)
    assert fit(inst, completions(prompt="hello world")).max_tokens == 16  # OpenAI's, as if given
    assert fit(inst, ollama_raw("hello world")).max_tokens == 64 - n  # Ollama's: the rest
    assert fit(inst, completions(prompt=[1, 2, 3], max_tokens=61)).max_tokens == 61
    with pytest.raises(ApiError) as e:
        fit(inst, completions(prompt=[1, 2, 3], max_tokens=62))
    assert (e.value.param, e.value.message) == (
        "prompt",
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(3 in the prompt, 62 in the completion).",
    )
    scored = completions(prompt=[1, 2, 3], echo=True, max_tokens=0)
    assert scored.score_only and fit(inst, scored).max_tokens == 1  # one token, dropped
