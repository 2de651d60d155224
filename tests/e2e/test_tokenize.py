"""``/tokenize`` and ``/detokenize`` as vLLM has them, on a real server: the router's tokenizer
and template, the same count a chat request's prompt has, and 400s for bad bodies."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    s = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("tokenize") / "serve.log",
    )
    s.tiny = tiny
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def post(s: Server, path: str, body) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=30)


def test_tokenize_a_prompt_and_back(srv):
    tok = Tokenizer.from_file(str(srv.tiny / "tokenizer.json"))
    text = "Hello, tokenizer: ünïcode and spaces  here."
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=True).ids
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    assert got["token_strs"] == [tok.id_to_token(i) for i in got["tokens"]]
    back = post(srv, "/detokenize", {"model": "tiny", "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_a_chat_prompt_holds(srv):
    r = post(srv, "/tokenize", {"model": "tiny", "messages": MSG})
    assert r.status_code == 200, r.text
    n = r.json()["count"]
    chat = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == n
    without = post(
        srv, "/tokenize", {"model": "tiny", "messages": MSG, "add_generation_prompt": False}
    ).json()["count"]
    assert without < n


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"model": "tiny"}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": 5}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MSG}, "prompt"),
        ("/tokenize", {"model": "tiny", "messages": []}, "messages"),
        ("/tokenize", {"model": "tiny", "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"model": "tiny", "tokens": "abc"}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, True]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [10**9]}, "tokens"),
    ],
)
def test_bad_bodies_are_400s(srv, path, body, param):
    check_error(post(srv, path, body), 400, param=param)


def test_a_non_object_is_400_and_the_model_routes_as_in_chat(srv):
    check_error(post(srv, "/detokenize", [1, 2]), 400)
    check_error(
        httpx.post(
            srv.url + "/tokenize", content=b"{", headers={"Content-Type": "application/json"}, timeout=10
        ),
        400,
    )
    # one model served: any name reaches it, as in the chat route (the spec's rule)
    assert post(srv, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 200
