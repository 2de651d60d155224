"""Browsers and the admin API, end to end: a real ``pantheon serve`` on loopback, requests shaped
like a browser's (``Origin``, ``Content-Type: text/plain`` "simple" POSTs, ``Sec-Fetch-Site``,
preflights with ``Access-Control-Request-Method``, a DNS-rebound ``Host``).

- The admin API sends no CORS headers, refuses preflights and every request of another origin
  (403 ``origin_not_allowed``, before any work: nothing loads or unloads), with the default
  ``--cors-origins *`` too; a page of the server's own origin and a non-browser client work.
- JSON routes refuse a non-JSON ``Content-Type`` (415); ``application/json; charset=...`` and the
  official ``openai`` client work.
- The OpenAI routes answer ``Access-Control-Allow-Origin: *`` by default; with an explicit
  ``--cors-origins`` list, the listed origin echoed with ``Vary: Origin`` and nothing for others.
- An admin load ``path`` with a NUL byte or of 5,000 characters is a 400 naming ``path``.
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from pantheon.snapshot import SNAPSHOT_VERSION, decode_snapshot

from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(180)
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def site(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    copy = tmp_path_factory.mktemp("cors-models") / "x"
    shutil.copytree(tiny, copy)
    s = Server(
        ["--model", str(tiny), "--name", "tiny", "--dies", "cpu:0", "--cpu-dies", "1"],
        tmp_path_factory.mktemp("cors-logs") / "serve.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield {"s": s, "copy": copy}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    """A server without models whose --cors-origins names one origin."""
    s = Server(
        ["--cors-origins", "https://app.example,http://dash.example:9000"],
        tmp_path_factory.mktemp("cors-listed") / "serve.log",
    )
    try:
        _wait_up(s)
        yield s
    finally:
        s.stop()


def _wait_up(s: Server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(s.output())
        try:
            if httpx.get(s.url + "/", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(s.output())


def _names(s: Server) -> list[str]:
    return sorted(m["name"] for m in httpx.get(s.url + "/admin/models", timeout=10).json()["data"])


def _no_cors(r: httpx.Response) -> None:
    leaked = [k for k in r.headers if k.lower().startswith("access-control-")]
    assert not leaked, (leaked, r.headers)


def _origin_refused(r: httpx.Response) -> None:
    check_error(r, 403, code="origin_not_allowed")
    _no_cors(r)


# ---------------------------------------------------------------- the admin API


def test_the_reported_simple_post_loads_nothing(site):
    s, body = site["s"], {"path": str(site["copy"]), "name": "x"}
    raw = json.dumps(body)
    url = s.url + "/admin/models/load"
    # the red team's request: a cross-origin "simple" POST (no preflight in a browser)
    r = httpx.post(url, content=raw, headers={"Origin": EVIL, "Content-Type": "text/plain"}, timeout=60)
    _origin_refused(r)
    assert "x" not in _names(s)
    # same-origin (or no Origin) but text/plain, form-encoded or no type: 415, nothing loaded
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=z", None):
        headers = {"Origin": s.url} if ct is None else {"Origin": s.url, "Content-Type": ct}
        r = httpx.post(url, content=raw, headers=headers, timeout=60)
        check_error(r, 415, code="unsupported_media_type")
        _no_cors(r)
    assert "x" not in _names(s)
    # JSON from the server's own page loads it (so the refusals above were the checks', not the load's)
    r = httpx.post(
        url,
        content=raw,
        headers={
            "Origin": s.url,
            "Content-Type": "application/json; charset=utf-8",
            "Sec-Fetch-Site": "same-origin",
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    _no_cors(r)
    assert "x" in _names(s)
    # a cross-origin unload (even one a browser would have preflighted) is refused: x stays
    r = httpx.post(s.url + "/admin/models/unload", json={"name": "x"}, headers={"Origin": EVIL}, timeout=60)
    _origin_refused(r)
    assert "x" in _names(s)
    # "*" in --cors-origins (the default) does not open the admin API to a null origin either
    r = httpx.post(s.url + "/admin/models/unload", json={"name": "x"}, headers={"Origin": "null"}, timeout=60)
    _origin_refused(r)
    r = httpx.post(s.url + "/admin/models/unload", json={"name": "x"}, timeout=60)  # curl: no Origin
    assert r.status_code == 200, r.text
    assert "x" not in _names(s)


def test_admin_reads_refuse_other_origins(site):
    s = site["s"]
    url = s.url + "/admin/state"
    _origin_refused(httpx.get(url, headers={"Origin": EVIL}))
    _origin_refused(httpx.get(url, headers={"Origin": f"http://localhost:{s.port + 1}"}))  # another port
    _origin_refused(httpx.get(url, headers={"Sec-Fetch-Site": "cross-site"}))
    _origin_refused(httpx.get(url, headers={"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"}))
    _origin_refused(httpx.get(s.url + "/admin/events", headers={"Origin": EVIL}))
    _origin_refused(httpx.get(s.url + "/admin/nope", headers={"Origin": EVIL}))
    # DNS rebinding: the page's origin is "its own" by the Host header, but names no local host
    _origin_refused(
        httpx.get(
            url,
            headers={
                "Host": f"evil.example:{s.port}",
                "Origin": f"http://evil.example:{s.port}",
                "Sec-Fetch-Site": "same-origin",
            },
        )
    )
    for headers in (
        {},
        {"Origin": s.url, "Sec-Fetch-Site": "same-origin"},
        {"Origin": f"http://localhost:{s.port}", "Host": f"localhost:{s.port}"},
        {"Sec-Fetch-Site": "none"},  # typed in the address bar
    ):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 200, (headers, r.text)
        assert decode_snapshot(r.content).version == SNAPSHOT_VERSION  # the state itself
        _no_cors(r)


def test_admin_preflight_is_refused(site):
    s = site["s"]
    for path in ("/admin/models/load", "/admin/state", "/admin/models/unload"):
        r = httpx.options(
            s.url + path,
            headers={
                "Origin": EVIL,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        _origin_refused(r)


def test_load_path_nul_and_overlong_are_400(site):
    s = site["s"]
    for bad in ("/tmp/a\x00b", "a" * 5000, "/tmp/" + "b" * 300):
        r = httpx.post(s.url + "/admin/models/load", json={"path": bad, "name": "bad"}, timeout=30)
        check_error(r, 400, param="path")
    assert "bad" not in _names(s)


# ---------------------------------------------------------------- the OpenAI routes


def test_openai_routes_default_any_origin(site):
    s = site["s"]
    r = httpx.get(s.url + "/v1/models", headers={"Origin": EVIL})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.options(
        s.url + "/v1/chat/completions",
        headers={
            "Origin": EVIL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-stainless-os" in r.headers["access-control-allow-headers"].lower()
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    url = s.url + "/v1/chat/completions"
    r = httpx.post(
        url, content=json.dumps(body), headers={"Origin": EVIL, "Content-Type": "text/plain"}, timeout=60
    )
    check_error(r, 415, code="unsupported_media_type")
    assert r.headers["access-control-allow-origin"] == "*"  # a page may read why
    for path in ("/tokenize", "/v1/completions"):
        r = httpx.post(s.url + path, content=b"{}", headers={"Content-Type": "text/plain"}, timeout=60)
        check_error(r, 415)
    r = httpx.post(
        url, content=json.dumps(body), headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60
    )
    assert r.status_code == 200, r.text
    # the official client, plain and streaming
    c = s.client()
    out = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_listed_origins(listed):
    s = listed
    app = "https://app.example"
    r = httpx.get(s.url + "/v1/models", headers={"Origin": app})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == app
    assert "origin" in r.headers["vary"].lower()
    r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://dash.example:9000"})
    assert r.headers["access-control-allow-origin"] == "http://dash.example:9000"
    r = httpx.get(s.url + "/v1/models", headers={"Origin": EVIL})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert "origin" in r.headers["vary"].lower()
    pre = {"Access-Control-Request-Method": "POST"}
    r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": app, **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
    r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": EVIL, **pre})
    check_error(r, 403, code="origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    # the admin API: a listed origin may call it (an operator's choice), still without CORS headers
    r = httpx.get(s.url + "/admin/models", headers={"Origin": app, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 200, r.text
    _no_cors(r)
    _origin_refused(httpx.get(s.url + "/admin/models", headers={"Origin": EVIL}))
    _origin_refused(httpx.options(s.url + "/admin/models", headers={"Origin": app, **pre}))
