"""A mixture of experts served end to end: ``tiny-qwen3-moe`` (3 layers of 8 experts, top 2) through
``pantheon serve`` and the official ``openai`` client, streamed and not; the admin view shows its
parameters in all and those a token reads, and books every expert's weights."""

from __future__ import annotations

import httpx
import pytest

from pantheon.core.sizing import read_shape

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(180)

NAME = "moe"


@pytest.fixture(scope="module")
def moe_path(model_factory):
    return model_factory("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def moe(moe_path, tmp_path_factory):
    s = Server(
        ["--model", str(moe_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("qwen3-moe-logs") / "serve.log",
    )
    try:
        s.wait_ready((NAME,))
        yield s
    finally:
        s.stop()


def test_chat_streamed_and_not(moe):
    c = moe.client()
    r = c.chat.completions.create(
        model=NAME, messages=MSG, max_tokens=8, seed=1, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    chunks = list(
        c.chat.completions.create(
            model=NAME,
            messages=MSG,
            max_tokens=8,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = next(ch.usage for ch in chunks if ch.usage is not None)
    assert usage.completion_tokens == 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_admin_shows_total_and_active_parameters(moe, moe_path):
    desc = read_shape(moe_path)
    (inst,) = httpx.get(moe.url + "/admin/models", timeout=10).json()["data"]
    assert inst["params"] == {"total": desc.total_params, "active": desc.active_params}
    assert desc.active_params < desc.total_params
    # all 8 experts of each layer are resident: the booking holds them (bf16 or wider)
    experts = sum(s.experts.params for s in desc.layers if s.experts)
    assert inst["weights_bytes"] >= 2 * experts
