"""``pantheon.errors``: every OpenAI-format error the server returns, defined once.

- every factory gives the OpenAI error object ``{"error": {"message", "type", "param", "code"}}``
  with the status, ``type``, ``param`` and ``code`` its table row says;
- every 503 and 429 carries ``Retry-After`` (integer seconds);
- no module outside ``pantheon/errors.py`` constructs ``ApiError(...)`` itself (checked on the
  syntax tree: calls, not mentions in docstrings);
- the module stays light: importing it loads no quart, torch or msgspec.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from pantheon import errors
from pantheon.errors import ApiError

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT

INVALID, SERVER, RATE, PERM = (
    "invalid_request_error",
    "server_error",
    "rate_limit_error",
    "permission_error",
)

# factory -> (args, status, type, param, code)
CASES = {
    "unauthorized": ((True,), 401, INVALID, None, "invalid_api_key"),
    "admin_loopback_only": ((), 403, PERM, None, "forbidden"),
    "path_not_allowed": (("/x",), 403, PERM, "path", "forbidden"),
    "origin_not_allowed": (("not from here",), 403, PERM, None, "origin_not_allowed"),
    "unsupported_media_type": (("Content-Type 'text/plain'",), 415, INVALID, None, "unsupported_media_type"),
    "renamed": ((errors.path_not_allowed("/x"), "worker_path"), 403, PERM, "worker_path", "forbidden"),
    "route_not_found": (("GET", "/nope"), 404, INVALID, None, "not_found"),
    "body_too_large": ((1024,), 413, INVALID, None, "request_too_large"),
    "http_error": ((405, "Method Not Allowed"), 405, INVALID, None, "method_not_allowed"),
    "internal_error": ((ValueError("x"),), 500, SERVER, None, "internal_error"),
    "invalid_param": (("stop", "bad"), 400, INVALID, "stop", None),
    "invalid_json": (("Expecting value",), 400, INVALID, None, None),
    "not_an_object": ((), 400, INVALID, None, None),
    "limit_exceeded": (("n", "'n' is too large", 9, 8, "--max-n"), 400, INVALID, "n", "limit_exceeded"),
    "chat_template_refused": (("no",), 400, INVALID, "messages", None),
    "max_tokens_too_large": ((64, 64), 400, INVALID, "max_tokens", "context_length_exceeded"),
    "context_length_exceeded": (("too long",), 400, INVALID, "messages", "context_length_exceeded"),
    "prompt_too_long": ((4096, 4000, 100), 400, INVALID, "prompt", "context_length_exceeded"),
    "request_rejected": (("bad", "duplicate"), 400, INVALID, None, "duplicate"),
    "context_too_long": ((64, 80, 16, 60, "messages"), 400, INVALID, "messages", "context_length_exceeded"),
    "model_not_found": (("x",), 404, INVALID, "model", "model_not_found"),
    "model_cannot_embed": (("x",), 400, INVALID, "model", "model_not_embedding"),
    "model_cannot_generate": (("x",), 400, INVALID, "model", "model_not_generative"),
    "input_too_long": ((512, 600, 1), 400, INVALID, "input", "context_length_exceeded"),
    "no_model_loaded": ((), 503, SERVER, None, "model_not_ready"),
    "model_loading": (("x",), 503, SERVER, None, "model_not_ready"),
    "model_gone": (("x",), 503, SERVER, None, "model_not_ready"),
    "no_instance": (("no such instance",), 503, SERVER, None, "model_not_ready"),
    "model_recovering": (("x", 30.0), 503, SERVER, None, "model_not_ready"),
    "model_failed": (("x", "its worker died"), 503, SERVER, None, "model_failed"),
    "server_busy": ((), 429, RATE, None, "server_busy"),
    "queue_full": ((), 429, RATE, None, "queue_full"),
    "queue_timeout": ((30.0,), 429, RATE, None, "queue_timeout"),
    "memory_pressure": ((), 503, SERVER, None, "memory_pressure"),
    "bodies_in_flight": ((1 << 20,), 503, SERVER, None, "bodies_in_flight"),
    "shutting_down": ((), 503, SERVER, None, "shutting_down"),
    "worker_died": (("chatcmpl-1",), 503, SERVER, None, "worker_died"),
    "model_unloaded": (("x",), 503, SERVER, None, "model_unloaded"),
    "worker_no_finish": ((), 500, SERVER, None, "internal_error"),
    "worker_aborted": ((), 500, SERVER, None, "aborted"),
    "generation_failed": (("chatcmpl-1",), 500, SERVER, None, "internal_error"),
    "not_a_die": (("gpu7",), 400, INVALID, "dies", None),
    "no_such_die": (("cuda:9", "cuda", 1), 400, INVALID, "dies", "no_such_die"),
    "remote_die_not_joined": (("cpu:0@w1",), 400, INVALID, "dies", "no_such_die"),
    "unreadable_model": (("not_found", "no config"), 404, INVALID, "path", "not_found"),
    "no_model_folder": (("/x", "nothing there"), 404, INVALID, "path", "not_found"),
    "unreadable_assets": ((OSError("x"),), 400, INVALID, "path", "invalid"),
    "load_in_progress": (("m", "m#1"), 409, INVALID, "name", "conflict"),
    "kv_cache_dtype_refused": (("q8_0", "a head of 16 values"), 400, INVALID, "kv_cache_dtype", "invalid"),
    "unload_in_progress": (("m", "m#1"), 409, INVALID, "name", "conflict"),
    "duplicate_replica": (("m#1", "m", ("cpu:0",)), 409, INVALID, "dies", "duplicate"),
    "table_full": ((16,), 507, SERVER, None, "table_full"),
    "insufficient_memory": (("no room",), 507, SERVER, None, "insufficient_memory"),
    "models_max_reached": ((1, "a#1 (busy)"), 507, SERVER, None, "models_max"),
    "load_queue_full": (("m", 33, 32), 429, RATE, None, "queue_full"),
    "load_queue_timeout": (("m", 30.0, "a#1 (busy)"), 429, RATE, None, "queue_timeout"),
    "load_timeout": (("m", 300.0), 503, SERVER, None, "model_not_ready"),
    "model_unavailable": (("m", "/x.gguf: truncated"), 400, INVALID, "model", "model_unavailable"),
    "no_die_available": ((), 507, SERVER, None, "no_die"),
    "worker_start_failed": (("no",), 500, SERVER, None, "worker_start"),
    "load_failed": (("out_of_memory", "OOM"), 507, SERVER, None, "out_of_memory"),
    "load_worker_died": (("gone",), 500, SERVER, None, "worker_died"),
    "load_cancelled": ((), 500, SERVER, None, "cancelled"),
    "load_internal_error": ((RuntimeError("x"),), 500, SERVER, None, "internal_error"),
    "no_such_instance": (("m",), 404, INVALID, "name", "model_not_found"),
    "unload_conflict": (("m",), 409, INVALID, "name", "conflict"),
    "no_ready_instance": (("m",), 404, INVALID, "name", "model_not_found"),
    "ollama_model_not_found": (("x",), 404, INVALID, "model", "model_not_found"),
    "ollama_manage_unsupported": (("/api/pull",), 501, INVALID, None, "not_supported"),
}


def factories() -> dict:
    """The module's public functions that return an ``ApiError``."""
    return {
        name: f
        for name, f in vars(errors).items()
        if inspect.isfunction(f)
        and not name.startswith("_")
        and f.__module__ == errors.__name__
        and name != "error_body"
    }


def test_every_factory_is_covered():
    assert set(factories()) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_factory_shape(name):
    args, status, type_, param, code = CASES[name]
    e = factories()[name](*args)
    assert isinstance(e, ApiError) and isinstance(e, Exception)
    assert (e.status, e.type, e.param, e.code) == (status, type_, param, code)
    body = e.body()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"] == {"message": e.message, "type": type_, "param": param, "code": code}
    assert isinstance(e.message, str) and e.message
    assert str(e) == e.message


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[1] in (429, 503)))
def test_429_and_503_carry_retry_after(name):
    """Every 429 and 503 says when to retry, but ``model_failed``: nothing brings that model
    back by itself, so a Retry-After would promise what the server cannot keep."""
    args = CASES[name][0]
    e = factories()[name](*args)
    if name == "model_failed":
        assert "Retry-After" not in e.headers and "will not come back" in e.message
    else:
        assert int(e.headers["Retry-After"]) > 0


def test_retry_after_values():
    assert errors.queue_full().headers == {"Retry-After": "5"}
    assert errors.queue_timeout(30).headers == {"Retry-After": "2"}
    assert errors.worker_died("chatcmpl-x").headers == {"Retry-After": "2"}
    assert errors.model_recovering("m", 30).headers == {"Retry-After": "2"}
    for e in (errors.no_model_loaded(), errors.model_loading("m"), errors.model_gone("m")):
        assert e.headers == {"Retry-After": "1"}
    assert errors.server_busy().headers == {"Retry-After": "1"}
    assert errors.memory_pressure().headers == {"Retry-After": "1"}
    assert errors.no_instance("x").headers == {"Retry-After": "2"}
    assert errors.model_unloaded("m").headers == {"Retry-After": "2"}
    assert errors.shutting_down().headers == {"Retry-After": "5"}
    assert errors.unauthorized(False).headers == {"WWW-Authenticate": "Bearer"}


def test_messages_the_clients_see():
    assert errors.shutting_down().message == "the server is shutting down"
    assert errors.unauthorized(True).message.startswith("You didn't provide an API key.")
    assert errors.unauthorized(False).message == "Incorrect API key provided."
    assert errors.invalid_json().message == "the request body is not valid JSON"
    assert errors.invalid_json("bad").message == "the request body is not valid JSON: bad"
    assert errors.route_not_found("GET", "/x").message == "no route GET /x"
    assert errors.http_error(400, "Bad Request").code == "http_error"
    assert (
        errors.no_such_die("cpu:3", "cpu", 2).message
        == "die cpu:3 does not exist (the server has 2 CPU dies: --cpu-dies)"
    )
    assert (
        errors.no_such_die("cuda:3", "cuda", 1).message
        == "die cuda:3 does not exist (this machine has 1 CUDA devices)"
    )
    assert errors.context_too_long(64, 30, 60, 20, "max_tokens").message == (
        "This model's maximum context length is 64 tokens. However, you requested 90 tokens "
        "(30 in the messages, 60 in the completion). Even with every older turn and message "
        "text dropped the prompt takes 20 tokens. Please reduce the length of the messages or "
        "completion."
    )
    assert errors.max_tokens_too_large(64, 64).message == (
        "This model's maximum context length is 64 tokens. However, you requested at least 65 "
        "tokens (64 in the completion)."
    )
    assert errors.max_tokens_too_large(64, 64, "max_completion_tokens").param == "max_completion_tokens"


def test_load_failed_status_follows_the_kind():
    for kind, status in errors.LOAD_STATUS.items():
        e = errors.load_failed(kind, "why")
        assert (e.status, e.code, e.message) == (status, kind, "load failed: why")
        assert e.type == ("server_error" if status >= 500 else "invalid_request_error")
    assert errors.load_failed("weird", "x").status == 500
    assert errors.unreadable_model("unsupported", "x").status == 400
    assert errors.unreadable_model("other", "x").status == 400


def _constructions(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "ApiError":
                lines.append(node.lineno)
    return lines


def test_only_pantheon_errors_constructs_api_errors():
    found = []
    for package in ("pantheon", "workers", "tui", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "pantheon/errors.py":
                continue
            found += [f"{rel}:{n}" for n in _constructions(path)]
    assert not found, "construct these through a pantheon.errors factory:\n" + "\n".join(found)
    assert _constructions(ROOT / "pantheon" / "errors.py")  # the checker does see them


def test_the_module_is_light():
    code = (
        "import sys; import pantheon.errors; "
        "bad = [m for m in ('quart', 'werkzeug', 'torch', 'msgspec') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_clients_get_a_request_id_not_the_workers_internals():
    from pantheon.api.generation import _pool_error
    from pantheon.workerlink.errors import WorkerDied

    died = WorkerDied(
        "cpu:0",
        "the worker process (pid 4242) killed by signal SIGKILL; last "
        "output: loading /srv/models/secret from /srv/models/secret",
    )
    for e, status in ((died, 503), (RuntimeError("/srv/models/secret: bad tensor"), 500)):
        err = _pool_error(e, "chatcmpl-abc")
        msg = err.body()["error"]["message"]
        assert err.status == status and "chatcmpl-abc" in msg
        assert "4242" not in msg and "/srv" not in msg and "SIGKILL" not in msg, msg
