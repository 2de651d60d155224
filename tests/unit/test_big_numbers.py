"""Integers the worker's wire cannot carry, numeric-string keys too long for ``int()``, template
kwargs the renderer sets itself, and token ids outside the vocabulary: each is a 400 naming the
field on every route that reads it (chat, completions, responses, tokenize), never a 500.

(The same bodies through a real server, streamed too: ``tests/e2e/test_faults.py``.)
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from pantheon.api import fields
from pantheon.api.flow import check_token_ids
from pantheon.api.generation import vocab_size
from pantheon.api.openai import protocol as oa
from pantheon.api.openai.completions import CompletionRequest, _prepare, parse_completion_request
from pantheon.api.openai.responses import parse_responses_request
from pantheon.api.openai.tokenize import _tokenize
from pantheon.control.registry import Instance
from pantheon.core.protocol import Loaded, SamplingParams
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError

from helpers.instances import ready_instance

MSG = [{"role": "user", "content": "hi"}]
HUGE = (2**64, 2**63, -(2**64), -(2**63) - 1, 10**400)


def _chat(extra: dict) -> Any:
    return oa.parse_chat_request(json.dumps({"model": "m", "messages": MSG, **extra}))


def _completions(extra: dict) -> Any:
    return parse_completion_request(json.dumps({"model": "m", "prompt": "hi", **extra}))


def _responses(extra: dict) -> Any:
    return parse_responses_request(json.dumps({"model": "m", "input": "hi", **extra}))


def _tokenize_route(extra: dict) -> Any:
    # the body's checks come before the tokenizer is touched: no assets needed to reach them
    return _tokenize(None, {"model": "m", "messages": MSG, **extra})


ROUTES = {"chat": _chat, "completions": _completions, "responses": _responses}
TEMPLATE_ROUTES = {"chat": _chat, "responses": _responses, "tokenize": _tokenize_route}


def refused(fn: Any, extra: dict, param: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(extra)
    err = e.value
    assert err.status == 400 and err.param == param, (err.status, err.param, err.message)
    body = err.body()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]
    assert len(body["message"]) < 300, body["message"]  # a 5,000-digit key is not echoed whole
    return err


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("field", ["top_k", "repetition_window", "min_tokens", "seed", "max_tokens"])
@pytest.mark.parametrize("value", HUGE)
def test_an_integer_past_int64_is_a_400_naming_its_field(route, field, value):
    if route == "responses" and field == "max_tokens":
        field = "max_output_tokens"  # (its name there)
    refused(ROUTES[route], {field: value}, field)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_the_largest_int64_still_packs_for_the_worker(route):
    """The bound is the wire's: 2**63 - 1 passes the parser and msgspec packs it."""
    got = ROUTES[route]({"top_k": 2**63 - 1, "repetition_window": 2**63 - 1})
    chat = got if isinstance(got, GenerationRequest) else got.chat
    params = chat.sampling(max_tokens=4, stop_token_ids=[])
    assert params.top_k == 2**63 - 1
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).top_k == 2**63 - 1


def test_past_int64_msgspec_itself_overflows():
    """What the checks guard against: the 500 the worker's packing raised."""
    p = GenerationRequest(model="m", messages=MSG)
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(
            msgspec.structs.replace(p.sampling(max_tokens=4, stop_token_ids=[]), top_k=2**64)
        )


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("key", ["1" * 5000, "9" * 4301, str(2**64), str(2**63), "0" * 21 + "5", str(10**30)])
def test_a_logit_bias_key_too_big_for_any_vocabulary_is_a_400(route, key):
    refused(ROUTES[route], {"logit_bias": {key: 1}}, "logit_bias")


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_logit_bias_key_in_range_is_carried(route):
    got = ROUTES[route]({"logit_bias": {str(2**63 - 1): 5, "00007": -1}})
    chat = got if isinstance(got, GenerationRequest) else got.chat
    assert chat.logit_bias == {2**63 - 1: 5.0, 7: -1.0}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_float_too_large_for_a_float_is_a_400(route):
    refused(ROUTES[route], {"temperature": 10**400}, "temperature")


@pytest.mark.parametrize("route", sorted(TEMPLATE_ROUTES))
@pytest.mark.parametrize("key", fields.RESERVED_TEMPLATE_KWARGS)
def test_a_reserved_template_kwarg_is_a_400_naming_it(route, key):
    err = refused(TEMPLATE_ROUTES[route], {"chat_template_kwargs": {key: []}}, f"chat_template_kwargs.{key}")
    assert f"chat_template_kwargs.{key}" in err.message


def test_the_reserved_names_are_the_renderers():
    """Each name the server passes the template itself is refused in chat_template_kwargs."""
    from pantheon.chat import template

    assert set(fields.RESERVED_TEMPLATE_KWARGS) >= template._RESERVED_KWARGS  # pyright: ignore[reportPrivateUsage]


@pytest.mark.parametrize("route", sorted(TEMPLATE_ROUTES))
def test_other_template_kwargs_pass(route):
    got = TEMPLATE_ROUTES[route] if route != "tokenize" else _chat
    req = got({"chat_template_kwargs": {"enable_thinking": False, "tools_extra": 1}})
    chat = req if isinstance(req, GenerationRequest) else req.chat
    assert chat.chat_template_kwargs == {"enable_thinking": False, "tools_extra": 1}


@pytest.mark.parametrize("prompt", [[2**64], [[2**63]], [1, 2, 10**30]])
def test_completion_prompt_ids_past_int64_are_a_400(prompt):
    refused(_completions, {"prompt": prompt}, "prompt")


# ---------------------------------------------------------------- the vocabulary, once routed


@pytest.fixture(scope="module")
def tiny_assets(model_factory):
    from pantheon.models.assets import ModelAssets

    return ModelAssets(model_factory("tiny"))


def _inst(assets, vocab: int | None) -> Instance:
    """The tiny model's published instance; ``vocab``: what its worker reported (None: no
    report yet, so the tokenizer's vocabulary counts)."""
    inst = ready_instance(assets)
    if vocab is not None:
        inst.loaded = Loaded(
            instance=inst.instance_id,
            weight_bytes=0,
            kv_bytes=0,
            max_model_len=64,
            num_slots=1,
            vocab_size=vocab,
            eos_token_ids=[],
        )
    return inst


def test_the_vocabulary_is_the_workers_else_the_tokenizers(tiny_assets):
    assert vocab_size(_inst(tiny_assets, 128)) == 128
    tokenizer = tiny_assets.tokenizer.get_vocab_size(with_added_tokens=True)
    assert tokenizer != 128 and vocab_size(_inst(tiny_assets, None)) == tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_completion_prompt_ids_outside_the_vocabulary_are_a_400_before_any_slot(stream, tiny_assets):
    creq = _completions({"prompt": [1, 2, 128], "stream": stream})
    with pytest.raises(ApiError) as e:
        _prepare(_inst(tiny_assets, 128), creq)  # runs before acquire_slot, streamed or not
    assert e.value.status == 400 and e.value.param == "prompt" and "128" in e.value.message
    ok = _completions({"prompt": [1, 2, 127], "stream": stream})
    check_token_ids(_inst(tiny_assets, 128), ok.chat, list(ok.prompt))  # the last id is in


def test_logit_bias_outside_the_vocabulary_is_a_400_on_every_route(tiny_assets):
    for route in ROUTES.values():
        got = route({"logit_bias": {"128": 1}})
        chat = got.chat if isinstance(got, (CompletionRequest,)) or hasattr(got, "chat") else got
        with pytest.raises(ApiError) as e:
            check_token_ids(_inst(tiny_assets, 128), chat)
        assert e.value.status == 400 and e.value.param == "logit_bias"
        inside = route({"logit_bias": {"127": 1}})
        check_token_ids(_inst(tiny_assets, 128), inside.chat if hasattr(inside, "chat") else inside)
