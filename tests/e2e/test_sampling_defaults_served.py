"""A model's ``generation_config.json`` on a real server: the sampling fields a request leaves out
come from it, on the chat, completion and responses routes; a field the client gives wins, even
at OpenAI's value; ``/v1/models`` shows the defaults in force.

The model is the tiny preset with ``top_k: 1`` in its ``generation_config.json``: a request that
leaves ``top_k`` out then samples only the most likely token, so its output is exactly the greedy
output (``temperature: 0``) whatever its seed, which a sampled request never is by chance.
``max_new_tokens: 5`` is its default ``max_tokens``: a ceiling on a completion that gives none.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from helpers.serve import Server

pytestmark = pytest.mark.timeout(120)

DEFAULTS = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 5}
SHOWN = {"top_k": 1, "temperature": 0.7, "max_tokens": 5}
MSG = [{"role": "user", "content": "Tell me a story."}]
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defaults")
    folder = tmp / "tiny-top1"
    shutil.copytree(model_factory("tiny"), folder)
    gc = json.loads((folder / "generation_config.json").read_text())
    for key in ("do_sample", "temperature", "top_k", "top_p"):
        gc.pop(key, None)
    (folder / "generation_config.json").write_text(json.dumps({**gc, **DEFAULTS}))
    s = Server(["--model", str(folder), "--name", "tiny", "--cpu-dies", "1"], tmp / "serve.log")
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        s.stop()


def post(s: Server, route: str, body: dict) -> dict:
    r = httpx.post(s.url + route, json={"model": "tiny", "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(s: Server, **body) -> tuple[str, int]:
    out = post(s, "/v1/chat/completions", {"messages": MSG, **body})
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def test_models_show_the_defaults_in_force(srv):
    one = httpx.get(srv.url + "/v1/models/tiny", timeout=10).json()
    assert one["defaults"] == SHOWN
    listed = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    assert [m["defaults"] for m in listed] == [SHOWN]


def test_the_model_defaults_fill_what_a_chat_request_leaves_out(srv):
    greedy, n = chat(srv, temperature=0, max_tokens=8)
    assert n == 8
    for seed in SEEDS:  # top_k 1 from the file: the greedy answer, whatever the seed
        assert chat(srv, seed=seed, max_tokens=8) == (greedy, 8)
    # no max_tokens: the file's max_new_tokens (5) ends it; the client's own 8 wins over it
    assert chat(srv, temperature=0)[1] == 5


def test_a_field_the_client_gives_wins_even_at_openais_value(srv):
    greedy, _ = chat(srv, temperature=0, max_tokens=8)
    # top_k 0 (off) is OpenAI's own value, and still the client's: sampled, not greedy
    sampled = [chat(srv, seed=seed, max_tokens=8, top_k=0)[0] for seed in SEEDS]
    assert any(t != greedy for t in sampled), sampled


def test_completions_and_responses_take_the_defaults_too(srv):
    greedy = post(srv, "/v1/completions", {"prompt": "Once upon", "temperature": 0, "max_tokens": 5})
    got = post(srv, "/v1/completions", {"prompt": "Once upon", "seed": 9})  # top_k 1, max_tokens 5
    assert got["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 5  # the model's default, not OpenAI's 16
    r = post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 3})
    assert r["temperature"] == 0.7 and r["top_p"] == 1.0  # what it ran with
    r = post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "temperature": 0.3})
    assert r["temperature"] == 0.3
