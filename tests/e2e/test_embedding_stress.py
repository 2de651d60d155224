"""No request takes a die down: embedding batches around every prefill-chunk, slot and context
limit, beside chat streams on the same model and on another model of the same die, on a real
``pantheon serve`` whose worker must never exit (its pid stays, no death is counted); and a
step that raises inside the engine (the worker's ``raise`` test hook) fails its own request
with a 500 while the worker goes on serving.

One server, one CPU die, ``--slots 3 --prefill-chunk 16 --max-model-len 256`` and a KV pool of
about 512 tokens: an input's last chunk ends at every offset of a 16-token chunk (a chunk that
left an embedding one token short of its prompt sent it to the sampler, and the worker died on
the ``KeyError``), more inputs than slots wait their turn, two inputs at the context's length
fill the pool.
"""

from __future__ import annotations

import re
import threading

import httpx
import numpy as np
import pytest

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(240)

CHUNK, SLOTS, CONTEXT = 16, 3, 256
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-stress")
    hook = tmp / "step.hook"
    config = tmp / "serve.toml"
    config.write_text(
        "".join(
            f'[[models]]\nname = "{name}"\npath = "{path}"\ndies = ["cpu:0"]\n\n'
            for name, path in (
                ("q3emb", model_factory("tiny-qwen3-embedding", dtype="float32")),
                ("chat", model_factory("tiny")),
            )
        )
    )
    server = Server(
        [
            *("--config", str(config), "--cpu-dies", "1", "--dtype", "float32", "--cpu-path", "fp32"),
            *("--slots", str(SLOTS), "--prefill-chunk", str(CHUNK), "--max-model-len", str(CONTEXT)),
            *("--kv-budget", "256KiB", "--admit-ctx", str(CONTEXT), "--queue-timeout", "120"),
        ],
        tmp / "serve.log",
        env={"PANTHEON_TEST_STEP_HOOK": str(hook)},
    )
    server.hook = hook  # type: ignore[attr-defined]
    try:
        server.wait_ready(("q3emb", "chat"), timeout=180)
        yield server
    finally:
        server.stop()


def _die(s: Server) -> dict:
    return next(d for d in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"] if d["die"] == "cpu:0")


def _embed(s: Server, inputs: list) -> list[np.ndarray]:
    r = httpx.post(s.url + "/v1/embeddings", json={"model": "q3emb", "input": inputs}, timeout=180)
    assert r.status_code == 200, r.text
    return [np.asarray(d["embedding"]) for d in r.json()["data"]]


def _chat(s: Server, model: str, out: list, max_tokens: int = 24) -> None:
    body = {"model": model, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True}
    out.append(httpx.post(s.url + "/v1/chat/completions", json=body, timeout=180))


def test_embedding_batches_around_every_limit_beside_chat(srv):
    pid = _die(srv)["pid"]
    ids = [100 + (7 * i) % 1500 for i in range(CONTEXT)]
    # around the chunk (its multiples, one short, one past), the context and its pool share
    lengths = [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK + 1, 3 * CHUNK - 2]
    lengths += [CONTEXT - 1, CONTEXT, CONTEXT]  # two at the context: the pool holds just two
    by_ids = [ids[:n] for n in lengths]
    # the report's shape, scaled down: many inputs of 25 words (their tokens end chunks anywhere)
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(25 - i % 9)) for i in range(120)]
    results: dict[str, list[np.ndarray]] = {}
    chats: list[httpx.Response] = []

    def embed(key: str, inputs: list) -> None:
        results[key] = _embed(srv, inputs)

    threads = [
        threading.Thread(target=embed, args=("ids", by_ids)),
        threading.Thread(target=embed, args=("texts", texts)),
        threading.Thread(target=_chat, args=(srv, "q3emb", chats)),
        threading.Thread(target=_chat, args=(srv, "chat", chats)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert set(results) == {"ids", "texts"} and len(results["texts"]) == len(texts)
    assert [r.status_code for r in chats] == [200, 200], [r.text for r in chats]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in chats)
    # each vector is what its input gets alone (no chunk, neighbour or slot changed it)
    for n, got in zip(lengths, results["ids"]):
        if n in (CHUNK - 1, CHUNK + 1, CONTEXT):
            assert np.allclose(_embed(srv, [ids[:n]])[0], got, atol=1e-5), n
    check_error(
        httpx.post(srv.url + "/v1/embeddings", json={"model": "q3emb", "input": [ids * 2]}, timeout=30),
        400,
        param="input",
        code="context_length_exceeded",
    )
    d = _die(srv)
    assert d["alive"] and d["pid"] == pid and d["deaths"] == 0 and d["restarts"] == 0, d


def test_a_step_that_raises_fails_its_request_not_the_worker(srv):
    pid = _die(srv)["pid"]
    srv.hook.write_text("raise")  # type: ignore[attr-defined]
    out: list[httpx.Response] = []
    _chat(srv, "chat", out, max_tokens=8)
    err = check_error(out[0], 500, code="internal_error")
    assert "request id" in err["message"]
    assert not srv.hook.exists()  # type: ignore[attr-defined]
    _chat(srv, "chat", out, max_tokens=8)
    assert out[1].status_code == 200, out[1].text
    d = _die(srv)
    assert d["alive"] and d["pid"] == pid and d["deaths"] == 0, d
    assert re.search(r"a step of chat#\d+ raised; its 1 request\(s\) fail", srv.output())
