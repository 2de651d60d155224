"""Quantized KV cache types served (issue 27), end to end: one server whose ``--kv-cache-dtype``
is q8_0, the same tiny model (heads of 32 values: one q8_0/q4_0 block each) loaded again under
q4_0 and auto by the admin API, all in the same ``--kv-budget``. Each answers through the
official client; the pool's tokens, ``max_model_len``, ``/v1/models``, ``/admin/models`` and
``/admin/dies`` count each type's real bytes; a request no auto pool can hold is served by the
q4_0 one; a type the model's heads or the die cannot hold is a 400."""

from __future__ import annotations

import httpx
import pytest

from helpers.serve import Server, check_error

pytestmark = pytest.mark.timeout(180)

BUDGET = 256 << 10  # bytes of KV pool per load, whatever its type
# the tiny preset with heads of 32: 2 layers x 2 KV heads; fp32 path (forced: the same on every
# host), so auto stores 2 x 2 x 2 x 32 x 4 = 1024 B a token, q8_0 2 x 2 x 2 x 34 = 272, q4_0 144
TOKENS = {
    "auto": BUDGET // (16 * 1024) * 16,
    "q8_0": BUDGET // (16 * 272) * 16,
    "q4_0": BUDGET // (16 * 144) * 16,
}
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def folder(model_factory):
    return model_factory("tiny", head_dim=32)


@pytest.fixture(scope="module")
def srv(tmp_path_factory, folder):
    tmp = tmp_path_factory.mktemp("kvtypes")
    s = Server(
        ["--model", str(folder), "--name", "tiny", "--dies", "cpu:0", "--cpu-dies", "1", "--slots", "2"]
        + ["--kv-cache-dtype", "q8_0", "--kv-budget", str(BUDGET), "--cpu-path", "fp32"],
        tmp / "serve.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def _load(s: Server, **body) -> httpx.Response:
    return httpx.post(s.url + "/admin/models/load", json=body, timeout=120)


def _greedy(s: Server, model: str, max_tokens: int = 12) -> str:
    c = s.client()
    r = c.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=max_tokens)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model=model, messages=MSG, temperature=0, max_tokens=max_tokens, stream=True
        )
        if ch.choices
    )
    assert streamed == r.choices[0].message.content  # greedy over the quantized cache: the same twice
    return streamed


def test_each_type_serves_and_counts_its_own_bytes(srv, folder):
    for name, kv in (("tiny-q4", "q4_0"), ("tiny-auto", "auto"), ("tiny-kv", "q8_0/q4_0")):
        r = _load(srv, path=str(folder), name=name, dies=["cpu:0"], kv_cache_dtype=kv)
        assert r.status_code == 200, r.text
        assert r.json()["kv_cache_dtype"] == kv
    rows = {m["name"]: m for m in httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]}
    listed = {m["id"]: m for m in srv.client().models.list().model_dump()["data"]}
    for name, kv in (("tiny", "q8_0"), ("tiny-q4", "q4_0"), ("tiny-auto", "auto")):
        assert rows[name]["kv_cache_dtype"] == kv and listed[name]["kv_cache_dtype"] == kv
        assert rows[name]["kv_pool_tokens"] == TOKENS[kv], (name, rows[name])
        assert rows[name]["max_model_len"] == 4096  # the model's own; requests fit the pool
        assert listed[name]["max_model_len"] == TOKENS[kv]  # what a request can really get
        assert rows[name]["kv_bytes"] <= BUDGET
        _greedy(srv, name)
    # K and V apart: 2 x 2 x (34 + 18) = 208 B a token
    assert rows["tiny-kv"]["kv_pool_tokens"] == BUDGET // (16 * 208) * 16
    assert TOKENS["q4_0"] / TOKENS["auto"] > 7 and TOKENS["q8_0"] / TOKENS["auto"] > 3.7  # vs fp32
    die = httpx.get(srv.url + "/admin/dies", timeout=10).json()["data"][0]
    assert {i["name"]: i["kv_cache_dtype"] for i in die["instances"]}["tiny-q4"] == "q4_0"
    # a completion no auto pool in this budget can hold: 400 there, served under q4_0
    c = srv.client()
    check_error(
        httpx.post(
            srv.url + "/v1/chat/completions",
            json={"model": "tiny-auto", "messages": MSG, "max_tokens": 400},
            timeout=30,
        ),
        400,
        code="context_length_exceeded",
    )
    r = c.chat.completions.create(
        model="tiny-q4", messages=MSG, max_tokens=400, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 400


def test_a_type_the_model_or_die_cannot_hold_is_a_400(srv, folder, model_factory):
    err = check_error(
        _load(srv, path=str(folder), name="tiny-q5", kv_cache_dtype="q5_1"), 400, param="kv_cache_dtype"
    )
    assert "q8_0" in err["message"]
    # heads of 16 values are not whole q4_0 blocks: the router refuses before any worker loads
    err = check_error(
        _load(srv, path=str(model_factory("tiny")), name="tiny16", kv_cache_dtype="q4_0"),
        400,
        param="kv_cache_dtype",
    )
    assert "16" in err["message"]
    # fp8_e4m3 is for CUDA dies: the worker's refusal comes back as the load's error
    err = check_error(_load(srv, path=str(folder), name="tiny-fp8", kv_cache_dtype="fp8_e4m3"), 400)
    assert "fp8_e4m3" in err["message"] and "CUDA" in err["message"]
    names = {m["name"] for m in httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]}
    assert not names & {"tiny-q5", "tiny16", "tiny-fp8"}
    assert "Traceback" not in srv.output()
