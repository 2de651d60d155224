"""Security with real ``pantheon serve`` processes: API keys, the admin key, loopback-only admin,
``--models-dir`` (links included), and every request limit.

Two servers, started together:
- ``keyed``: ``PANTHEON_API_KEY=k-one,k-two`` and ``--admin-key``;
- ``open``: no keys (admin answers on loopback), ``--models-dir ROOT`` and tight limits.
The loopback rule's other side (a client that is not local) is shown on the app itself with a
non-loopback client address in the ASGI scope: the tests never use a non-loopback address.
"""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest

from helpers.openapi import check
from helpers.serve import MSG, Server, check_error

pytestmark = pytest.mark.timeout(180)

ADMIN = "adm-secret-7"
LIMIT_FLAGS = [
    "--max-messages",
    "3",
    "--max-n",
    "2",
    "--max-tokens-limit",
    "8",
    "--max-stop",
    "2",
    "--max-stop-len",
    "5",
    "--max-body",
    "4KiB",
]


def _copy_model(src, dst) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def env(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    base = tmp_path_factory.mktemp("auth")
    root = base / "models"
    outside = base / "outside"
    _copy_model(tiny, root / "inside")
    _copy_model(tiny, outside / "elsewhere")
    (root / "link-out").symlink_to(outside / "elsewhere", target_is_directory=True)
    sneaky = root / "sneaky"  # a real folder inside the root whose weights link out of it
    sneaky.mkdir()
    for f in tiny.iterdir():
        if f.suffix == ".safetensors":
            (sneaky / f.name).symlink_to(outside / "elsewhere" / f.name)
        else:
            shutil.copy(f, sneaky / f.name)
    pickled = root / "pickled"  # weights only as a pickle checkpoint
    pickled.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, pickled / f.name)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    keyed = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1", "--admin-key", ADMIN],
        base / "keyed.log",
        env={"PANTHEON_API_KEY": "k-one, k-two"},
    )
    open_ = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1", "--models-dir", str(root), *LIMIT_FLAGS],
        base / "open.log",
    )
    try:
        keyed.wait_ready(None)  # /v1/models needs a key here
        open_.wait_ready(("tiny",))
        yield {"keyed": keyed, "open": open_, "root": root, "outside": outside}
    finally:
        assert keyed.stop() == 0, keyed.output()
        assert open_.stop() == 0, open_.output()


def _check_401(r: httpx.Response, *secrets: str) -> None:
    err = check_error(r, 401, code="invalid_api_key")
    assert r.headers.get("www-authenticate") == "Bearer"
    text = r.text
    for s in (*secrets, "tiny", "k-one", "k-two", ADMIN, "pantheon"):
        assert s not in text, (s, text)  # nothing about the server leaks
    assert err["type"] == "invalid_request_error"


def test_api_keys(env):
    s = env["keyed"]
    url = s.url + "/v1/chat/completions"
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    _check_401(httpx.get(s.url + "/v1/models"))
    _check_401(httpx.post(url, json=body))
    _check_401(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong-guess"}), "wrong-guess")
    _check_401(httpx.post(url, json=body, headers={"Authorization": "k-one"}))  # no scheme
    _check_401(httpx.post(url, json=body, headers={"Authorization": f"Bearer {ADMIN}"}))
    _check_401(httpx.get(s.url + "/v1/no-such-route"))  # 401 before 404: no route map leaks
    for key in ("k-one", "k-two"):  # both keys of the comma-separated variable
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        check("CreateChatCompletionResponse", r.json())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="k-two", max_retries=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # probes, scrapers and CORS preflights need no key
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/").status_code == 200
    assert httpx.get(s.url + "/metrics").status_code == 200
    r = httpx.options(url, headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200


def test_admin_key(env):
    s = env["keyed"]
    _check_401(httpx.get(s.url + "/admin/models"))  # loopback too needs the key once it is set
    _check_401(httpx.get(s.url + "/admin/models", headers={"Authorization": "Bearer k-one"}))
    r = httpx.get(s.url + "/admin/models", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["data"][0]["name"] == "tiny"
    r = httpx.post(s.url + "/admin/models/unload", json={"name": "tiny"})
    _check_401(r)
    assert httpx.get(s.url + "/health").status_code == 200  # nothing was unloaded


def test_admin_open_on_loopback_only(env, tiny_model):
    s = env["open"]
    assert httpx.get(s.url + "/admin/models").status_code == 200  # we are on loopback

    import asyncio

    from pantheon.api.app import create_app
    from pantheon.config.settings import build_config
    from pantheon.control.registry import Registry

    class _Pool:
        def dies(self):
            return []

    async def probe():
        app = create_app(build_config({}, {}), _Pool(), Registry())
        client = app.test_client()
        out = {}
        for addr in (
            "10.1.2.3",
            "192.168.0.7",
            "::ffff:10.0.0.1",
            "2001:db8::1",
            "127.0.0.1",
            "::1",
            "::ffff:127.0.0.1",
        ):
            r = await client.get(
                "/admin/models", scope_base={"client": (addr, 5000)}, headers={"X-Forwarded-For": "127.0.0.1"}
            )
            out[addr] = (r.status_code, await r.get_json())
        return out

    got = asyncio.run(probe())
    for addr in ("10.1.2.3", "192.168.0.7", "::ffff:10.0.0.1", "2001:db8::1"):
        status, body = got[addr]
        assert status == 403 and body["error"]["code"] == "forbidden", (addr, body)
        check("ErrorResponse", body)
    for addr in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert got[addr][0] == 200, (addr, got[addr])


def _load(s: Server, path, **kw) -> httpx.Response:
    return httpx.post(s.url + "/admin/models/load", json={"path": str(path), **kw}, timeout=120)


def test_models_dir(env):
    s, root, outside = env["open"], env["root"], env["outside"]
    for path in (
        outside / "elsewhere",  # plainly outside
        root / "link-out",  # a link inside the root to a folder outside
        root / "sneaky",  # a folder inside whose weights link outside
        root / ".." / "outside" / "elsewhere",  # dot-dot out of the root
        "/no/such/model",
    ):  # outside and missing: 403, existence not revealed
        r = _load(s, path, name="x")
        err = check_error(r, 403, param="path", code="forbidden")
        assert "--models-dir" in err["message"]
    check_error(_load(s, root / "missing"), 404)  # inside the root: the usual 404
    r = _load(s, root / "pickled", name="pk")  # only safetensors are ever read
    err = check_error(r, 404)
    assert "pickle" in err["message"]
    r = _load(s, root / "inside", name="inside")
    assert r.status_code == 200, r.text
    listed = {m["id"]: m["status"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
    assert [n for n, st in listed.items() if st["value"] == "loaded"] == ["tiny", "inside"]
    # the catalog lists the root's models, and refuses those that link out as the API does
    for name in ("link-out", "sneaky"):
        assert listed[name]["value"] == "failed" and "links outside" in listed[name]["reason"]
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": name, "messages": MSG}, timeout=30)
        check_error(r, 400, param="model", code="model_unavailable")
    assert httpx.post(s.url + "/admin/models/unload", json={"name": "inside"}, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "body,param,flag",
    [
        ({"messages": MSG * 4}, "messages", "--max-messages"),
        ({"n": 3}, "n", "--max-n"),
        ({"max_tokens": 9}, "max_tokens", "--max-tokens-limit"),
        ({"stop": ["a", "b", "c"]}, "stop", "--max-stop"),
        ({"stop": ["abcdef"]}, "stop", "--max-stop-len"),
    ],
)
def test_limits(env, body, param, flag):
    s = env["open"]
    r = httpx.post(
        s.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, **body}, timeout=30
    )
    err = check_error(r, 400, param=param, code="limit_exceeded")
    assert flag in err["message"]


def test_limits_allow_up_to_the_limit_and_body_413(env):
    s = env["open"]
    r = httpx.post(
        s.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSG * 3, "n": 2, "max_tokens": 8, "stop": ["abcde", "x"]},
    )
    assert r.status_code == 200, r.text
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    err = check_error(httpx.post(s.url + "/v1/chat/completions", json=big), 413)
    assert "--max-body" in err["message"] and "4096" in err["message"]


def test_runtime_dir_is_private(env):
    s = env["open"]
    dies = httpx.get(s.url + "/admin/dies").json()["data"]
    pid = dies[0]["pid"]
    cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    endpoint = cmd[cmd.index(b"--endpoint") + 1].decode()
    assert endpoint.startswith("ipc://")
    folder = os.path.dirname(endpoint[len("ipc://") :])
    assert os.stat(folder).st_mode & 0o777 == 0o700
