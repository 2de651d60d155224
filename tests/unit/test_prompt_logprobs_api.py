"""The router's side of prompt logprobs (issue 26 §3), exactly: which requests ask the worker
for them and for how many alternatives, the 400s, and vLLM's ``prompt_logprobs`` form."""

from __future__ import annotations

import pytest

from pantheon.api.openai import protocol as oa
from pantheon.api.openai.completions import parse_completion_request
from pantheon.core.protocol import PromptLogprobs
from pantheon.errors import ApiError

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "worker_k", "client_k", "score_only"),
    [
        ({"prompt": "a"}, None, None, False),
        ({"prompt": "a", "logprobs": 3}, None, None, False),  # the completion's only
        ({"prompt": "a", "echo": True}, None, None, False),  # the text only
        ({"prompt": "a", "echo": True, "logprobs": 3}, 3, None, False),
        ({"prompt": "a", "echo": True, "logprobs": 0, "max_tokens": 0}, 0, None, True),
        ({"prompt": "a", "echo": True, "logprobs": 2, "prompt_logprobs": 7}, 7, 7, False),
        ({"prompt": "a", "echo": True, "logprobs": 5, "prompt_logprobs": 1}, 5, 1, False),
        ({"prompt": "a", "prompt_logprobs": 0}, 0, 0, False),
    ],
)
def test_what_a_completion_asks_the_worker(body, worker_k, client_k, score_only):
    creq = parse_completion_request(oa.dumps(body))
    assert creq.chat.prompt_logprobs == worker_k
    assert creq.prompt_logprobs == client_k and creq.score_only is score_only
    if score_only:
        assert creq.chat.max_tokens is None and "max_tokens" in creq.chat.unset


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # scoring needs echo
        ({"prompt": "a", "echo": True, "max_tokens": False}, "max_tokens"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_completion_400s(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion_request(oa.dumps(body))
    assert (e.value.status, e.value.param) == (400, param)


def test_chat_takes_prompt_logprobs_up_to_20_and_not_streamed():
    assert oa.parse_chat_request({"messages": MSG, "prompt_logprobs": 20}).prompt_logprobs == 20
    assert oa.parse_chat_request({"messages": MSG}).prompt_logprobs is None
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": "2"}, {"prompt_logprobs": 2, "stream": True}):
        with pytest.raises(ApiError) as e:
            oa.parse_chat_request({"messages": MSG, **bad})
        assert e.value.param == "prompt_logprobs"


def test_max_completion_tokens_is_named_as_given():
    req = oa.parse_chat_request({"messages": MSG, "max_completion_tokens": 9})
    assert (req.max_tokens, req.max_tokens_param) == (9, "max_completion_tokens")
    assert oa.parse_chat_request({"messages": MSG, "max_tokens": 9}).max_tokens_param == "max_tokens"


def test_vllm_form():
    got = PromptLogprobs(
        logprobs=[-1.5, -0.25], ranks=[3, 1], top=[[(9, -0.5), (4, -1.0)], [(6, -0.25), (2, -2.0)]]
    )
    out = oa.prompt_logprobs([1, 5, 6], got, 1, lambda t: f"<{t}>")
    assert out == [
        None,
        {  # the prompt's own token first (rank 3), then the top 1
            "5": {"logprob": -1.5, "rank": 3, "decoded_token": "<5>"},
            "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
        },
        {"6": {"logprob": -0.25, "rank": 1, "decoded_token": "<6>"}},  # it is the top 1
    ]
    assert oa.prompt_logprobs([1, 5, 6], None, 1, str) == [None, None, None]  # none came back
    worst = PromptLogprobs(logprobs=[float("-inf")], ranks=[7], top=[[]])
    assert oa.prompt_logprobs([1, 2], worst, 0, str)[1] == {
        "2": {"logprob": -9999.0, "rank": 7, "decoded_token": "2"}
    }
