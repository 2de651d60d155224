"""gpt-oss served end to end: ``tiny-gpt-oss`` (a 16-token sliding layer with sinks and a full
one, 8 experts top 4, Harmony template) through ``pantheon serve`` and the official ``openai``
client, with a conversation longer than the window, streamed and not.

Random weights, so the text is noise: the checks are token counts, finish reasons, a seeded
stream equal to the whole answer (through the prefix the first request cached), and the admin
view's total and active parameters. (The Harmony
output parser's reasoning and tool calls are tested where it lives.)
"""

from __future__ import annotations

import httpx
import pytest

from pantheon.core.sizing import read_shape

from helpers.serve import Server

pytestmark = pytest.mark.timeout(180)

NAME = "oss"
# with the template's system and developer messages, far past the 16-token window
LONG = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the weather like in Paris today, and should I take an umbrella?"},
]


@pytest.fixture(scope="module")
def oss_path(model_factory):
    return model_factory("tiny-gpt-oss")


@pytest.fixture(scope="module")
def oss(oss_path, tmp_path_factory):
    s = Server(
        ["--model", str(oss_path), "--name", NAME, "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("gpt-oss-logs") / "serve.log",
    )
    try:
        s.wait_ready((NAME,))
        yield s
    finally:
        s.stop()


def test_a_chat_past_the_window_streams_what_the_whole_answer_says(oss):
    c = oss.client()
    kw = dict(model=NAME, messages=LONG, max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens > 16  # past the window
    chunks = list(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})  # pyright: ignore[reportCallIssue, reportArgumentType]
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (whole.choices[0].message.content or "")
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    usage = next(ch.usage for ch in chunks if ch.usage is not None)
    assert usage.completion_tokens == 8 and usage.prompt_tokens == whole.usage.prompt_tokens
    # the second request restored the first's prefix (full layers' blocks, the ring's checkpoint)
    # and still wrote the same seeded answer
    assert usage.prompt_tokens_details is not None and (usage.prompt_tokens_details.cached_tokens or 0) > 16


def test_admin_shows_total_and_active_parameters(oss, oss_path):
    desc = read_shape(oss_path)
    (inst,) = httpx.get(oss.url + "/admin/models", timeout=10).json()["data"]
    assert inst["params"] == {"total": desc.total_params, "active": desc.active_params}
    assert desc.active_params < desc.total_params
