"""``/v1/completions`` (the legacy text API) on a real server, through the official client and
against OpenAI's schema: prompt forms, echo, logprobs, stop, n, seeds, streaming, and 400s.
(``echo`` with ``logprobs``, and prompt logprobs: tests/e2e/test_prompt_logprobs_served.py.)"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers.openapi import check
from helpers.serve import Server, check_error

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    s = Server(
        ["--model", str(model_factory("tiny")), "--name", "tiny", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("completions") / "serve.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def post(s: Server, body: dict) -> httpx.Response:
    return httpx.post(s.url + "/v1/completions", json=body, timeout=60)


def test_a_completion_through_the_official_client(srv):
    c = srv.client().completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
    assert c.usage.prompt_tokens > 0 and isinstance(c.choices[0].text, str)
    r = post(
        srv,
        {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    check("CreateCompletionResponse", r.json())
    assert r.json()["choices"][0]["text"] == c.choices[0].text  # greedy: the same text


def test_default_max_tokens_is_16_and_token_ids_work(srv):
    r = post(srv, {"model": "tiny", "prompt": [5, 17, 300, 41], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": 4, "completion_tokens": 16}
    r = post(srv, {"model": "tiny", "prompt": [[5, 17, 300, 41]], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4


def test_echo_logprobs_n_and_seeds(srv):
    body = {
        "model": "tiny",
        "prompt": "The sky is",
        "max_tokens": 6,
        "echo": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = post(srv, body).json()
    assert r["choices"][0]["text"].startswith("The sky is")
    lp = post(srv, {**body, "echo": False, "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6
    assert all(len(t) <= 3 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    seeded = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    a, b = post(srv, seeded).json(), post(srv, seeded).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1]
    check("CreateCompletionResponse", a)


def test_streamed(srv):
    # not strict: the SDK's Completion type says finish_reason is never null, yet OpenAI's own
    # streamed chunks carry null until the last one, as ours do
    loose = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(
        loose.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=10,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = post(
        srv, {"model": "tiny", "prompt": "Hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    ).json()
    assert text == whole["choices"][0]["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True},
    ) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert (
        lines[-1] == "data: [DONE]" and len(lines) >= 2
    )  # a chunk at least (tokens may come in one), [DONE]
    assert all(json.loads(x[6:])["object"] == "text_completion" for x in lines[:-1])


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": -1}, "max_tokens"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 5000}, "max_tokens"),  # no context holds it
    ],
)
def test_bad_requests_are_400s(srv, body, param):
    check_error(post(srv, {"model": "tiny", **body}), 400, param=param)
    assert post(srv, {"model": "tiny", "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_the_client_sees_a_400_as_bad_request(srv):
    with pytest.raises(openai.BadRequestError):
        srv.client().completions.create(model="tiny", prompt="a", suffix="b")
