"""Issue 40 §6's smaller edges through a real server (one, shared by the module): a ``tiny``
model ``short`` with a 64-token context, and a ``--models-dir`` holding another (``other``, not
loaded), so the catalog holds two models.

- a model name with a control character is a 400 at admin load (given, or the folder name it
  defaults to), a request naming one is a 404, and neither forges a line in the text log;
- an unknown name is a 404, not ``short``'s answer: the single-model shortcut is for one model;
- Ollama's ``num_ctx`` past its range is a 400 naming it; ``show`` lists ``tools`` as the
  template renders them;
- ``/detokenize`` and a completion prompt take the same token ids (the model's embedding rows);
- a single message longer than the context is capped (200, ``context_capped``); a system prompt
  longer than it is the 400 (the spec's cap-or-deny, ``pantheon/control/context.py``)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from pantheon.chat.template import ChatTemplate
from pantheon.models.assets import ModelAssets

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(180)
CONTEXT = 64


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("edges")
    tiny = model_factory("tiny")
    root = base / "models"
    root.mkdir()
    shutil.copytree(tiny, root / "other")
    cfg = base / "pantheon.toml"
    cfg.write_text(
        f'models_dir = ["{root}"]\n[[models]]\npath = "{tiny}"\nname = "short"\nmax_context = {CONTEXT}\n'
    )
    s = Server(["--config", str(cfg), "--cpu-dies", "1"], base / "serve.log")
    try:
        s.wait_ready(("short",))
        s.tiny = tiny  # type: ignore[attr-defined]
        s.root = root  # type: ignore[attr-defined]
        yield s
    finally:
        s.stop()


def _post(s: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=60)


def _log_lines(s: Server) -> list[str]:
    return s.log.read_bytes().decode(errors="replace").split("\n")


def test_names_with_control_characters_are_refused_and_forge_no_log_line(srv):
    before = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
    for name in ("x\npantheon: INFO forged: line", "x\x00y", "x\u2028y"):
        r = _post(srv, "/admin/models/load", {"path": str(srv.root / "other"), "name": name})
        check_error(r, 400, param="name")
    folder = srv.root / "evil\npantheon: INFO forged: folder"  # the catalog leaves it out
    shutil.copytree(srv.tiny, folder)
    check_error(_post(srv, "/admin/models/load", {"path": str(folder)}), 400, param="path")
    assert httpx.get(srv.url + "/v1/models", timeout=10).json()["data"] == before  # nothing changed
    # a request naming one: no model has it (never the shortcut), and its log line stays one line
    r = _post(
        srv, "/v1/chat/completions", {"model": "short\npantheon: INFO forged: request", "messages": MSG}
    )
    check_error(r, 404, code="model_not_found")
    r = _post(srv, "/v1/chat/completions", {"model": "short\x00", "messages": MSG})
    check_error(r, 404, code="model_not_found")
    lines = _log_lines(srv)
    assert not any(line.startswith("pantheon: INFO forged") for line in lines)
    assert not any("\x00" in line for line in lines)


def test_an_unknown_name_is_a_404_with_two_models_in_the_catalog(srv):
    check_error(
        _post(srv, "/v1/chat/completions", {"model": "gpt-4o", "messages": MSG}), 404, code="model_not_found"
    )
    r = _post(srv, "/v1/chat/completions", {"model": "short", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_ollama_num_ctx_out_of_range_is_a_400_naming_it(srv):
    for bad in (-1, 2**70):
        body = {
            "model": "short",
            "messages": MSG,
            "stream": False,
            "options": {"num_ctx": bad, "num_predict": 2},
        }
        r = _post(srv, "/api/chat", body)
        assert r.status_code == 400 and "options.num_ctx" in r.json()["error"], r.text
    body = {"model": "short", "messages": MSG, "stream": False, "options": {"num_ctx": 48, "num_predict": 2}}
    assert _post(srv, "/api/chat", body).status_code == 200


def test_ollama_show_lists_tools_as_the_template_renders_them(srv):
    caps = _post(srv, "/api/show", {"model": "short"}).json()["capabilities"]
    takes = ChatTemplate.from_model_dir(srv.tiny).takes_tools
    assert caps[0] == "completion" and ("tools" in caps) is takes, caps


def test_detokenize_and_prompts_take_the_same_ids(srv):
    tokenizer_size = ModelAssets(srv.tiny).tokenizer.get_vocab_size(with_added_tokens=True)
    rows = next(m for m in httpx.get(srv.url + "/admin/models").json()["data"] if m["name"] == "short")
    del rows  # (the admin view does not show the vocabulary: the 400's message says the bound)
    r = _post(srv, "/detokenize", {"model": "short", "tokens": [10**6]})
    bound = int(check_error(r, 400, param="tokens")["message"].rsplit("..", 1)[1].rstrip(")"))
    r = _post(srv, "/v1/completions", {"model": "short", "prompt": [10**6], "max_tokens": 1})
    assert check_error(r, 400, param="prompt")["message"].endswith(f"(0..{bound})")
    assert bound + 1 > tokenizer_size  # the embedding's rows: the tokenizer's size padded
    last = [tokenizer_size, bound]  # ids past the tokenizer's tokens the model still has
    assert _post(srv, "/detokenize", {"model": "short", "tokens": last}).status_code == 200
    r = _post(srv, "/v1/completions", {"model": "short", "prompt": last, "max_tokens": 1})
    assert r.status_code == 200, r.text
    for path, key in (("/detokenize", "tokens"), ("/v1/completions", "prompt")):
        r = _post(srv, path, {"model": "short", key: [bound + 1], "max_tokens": 1})
        check_error(r, 400, param=key)


def test_a_single_message_past_the_context_is_capped_a_system_prompt_past_it_denied(srv):
    long = " ".join(f"word{i}" for i in range(200))  # far more than 64 tokens
    r = _post(
        srv,
        "/v1/chat/completions",
        {"model": "short", "messages": [{"role": "user", "content": long}], "max_tokens": 4},
    )
    body = r.json()
    assert r.status_code == 200 and body["context_capped"] is True, r.text
    assert body["usage"]["prompt_tokens"] + 4 <= CONTEXT
    msgs = [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]
    r = _post(srv, "/v1/chat/completions", {"model": "short", "messages": msgs, "max_tokens": 4})
    check_error(r, 400, code="context_length_exceeded")
