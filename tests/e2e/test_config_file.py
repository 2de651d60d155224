"""Configuration: every variable of the spec's table, PANTHEON_* names with the spec's as aliases,
flag > variable > config file > default, the TOML file (models included) on a real server,
``--help`` documenting it all, and the startup refusals (QWEN35_GPU_FULL_LOGITS, a TCP worker
endpoint without CURVE keys)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from pantheon.config.ops import merge_config_file
from pantheon.config.settings import ConfigError, build_config
from pantheon.serve import build_parser

from helpers.serve import MSG, ROOT, Server, _free_port, check_error

pytestmark = pytest.mark.timeout(120)

SPEC_TABLE = (
    "QWEN35_BATCH_SLOTS",
    "QWEN35_BS_DRIVER_SAMPLE",
    "QWEN35_BS_PREFILL_BATCH",
    "QWEN35_BS_PREFILL_CHUNK",
    "BS_QUEUE_DEPTH",
    "QWEN35_BS_STATS",
    "QWEN35_KV_Q4",
    "QWEN35_GPU_FULL_LOGITS",
    "PN_ASYNC_POLL_US",
    "PANTHEON_REGISTRY_URL",
    "PANTHEON_NODE_ID",
    "PANTHEON_REGISTRY_TRANSPORT",
)


def _cli(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pantheon", "serve", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_spec_table_variables_and_aliases():
    c = build_config({}, {})
    # prefill_chunk: the spec's 128 became a 512 ceiling under the step budget (issue 12)
    assert (c.slots, c.queue_depth, c.prefill_chunk) == (8, 32, 512)
    assert c.ops.driver_sample and c.ops.prefill_batch and not c.ops.kv_q4 and not c.ops.step_stats
    assert c.ops.registry_url is None and c.ops.node_id == "node0"
    assert c.ops.registry_transport == "local" and c.ops.async_poll_us is None
    c = build_config(
        {},
        {
            "QWEN35_BATCH_SLOTS": "0",
            "BS_QUEUE_DEPTH": "5",
            "QWEN35_BS_PREFILL_CHUNK": "64",
            "QWEN35_BS_STATS": "1",
            "QWEN35_BS_DRIVER_SAMPLE": "1",
            "QWEN35_KV_Q4": "0",
            "PN_ASYNC_POLL_US": "2000",
            "PANTHEON_REGISTRY_URL": "http://r:1",
            "PANTHEON_NODE_ID": "n9",
            "PANTHEON_REGISTRY_TRANSPORT": "rdma",
        },
    )
    assert (c.slots, c.queue_depth, c.prefill_chunk) == (1, 5, 64)
    assert c.ops.step_stats and c.ops.driver_sample and not c.ops.kv_q4
    assert c.ops.async_poll_us == 2000 and c.ops.registry_url == "http://r:1"
    assert (c.ops.node_id, c.ops.registry_transport) == ("n9", "rdma")
    assert build_config({}, {"QWEN35_BATCH_SLOTS": "1"}).slots == 8  # 1 turns batching on
    assert build_config({}, {"QWEN35_BS_PREFILL_BATCH": "0"}).prefill_chunk == 1
    assert str(build_config({}, {"QWEN35_KV_Q4": "1"}).kv_types) == "q4_0"  # the Q4 KV cache
    # PANTHEON_* names beat the spec's aliases; flags beat both
    env = {
        "PANTHEON_QUEUE_DEPTH": "7",
        "BS_QUEUE_DEPTH": "5",
        "PANTHEON_STEP_STATS": "0",
        "QWEN35_BS_STATS": "1",
    }
    c = build_config({}, env)
    assert c.queue_depth == 7 and not c.ops.step_stats
    assert build_config({"queue_depth": 3}, env).queue_depth == 3
    # the spec's knobs this server does not build are refused, saying why, not ignored
    for env, why in (
        ({"QWEN35_BS_DRIVER_SAMPLE": "0"}, "owner-side lockstep sampling is not built"),
        ({"PANTHEON_DRIVER_SAMPLE": "0"}, "owner-side lockstep sampling is not built"),
    ):
        with pytest.raises(ConfigError, match=f"{next(iter(env))} .*{why}"):
            build_config({}, env)
    for name in ("QWEN35_GPU_FULL_LOGITS", "PANTHEON_GPU_FULL_LOGITS"):
        with pytest.raises(ConfigError, match=name):
            build_config({}, {name: "1"})
    for bad in (
        {"QWEN35_BS_STATS": "maybe"},
        {"PN_ASYNC_POLL_US": "fast"},
        {"PANTHEON_MAX_N": "999"},
        {"PANTHEON_LOG_FORMAT": "xml"},
        {"PANTHEON_REGISTRY_URL": "ftp://x"},
        {"PANTHEON_DRAIN_TIMEOUT": "-1"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_config({}, bad)


def test_security_settings_from_flags_and_variables(tmp_path):
    c = build_config(
        {},
        {
            "PANTHEON_API_KEY": "a, b,,a",
            "PANTHEON_ADMIN_KEY": "z",
            "PANTHEON_MODELS_DIR": f"{tmp_path}{os.pathsep}{tmp_path}",
        },
    )
    assert c.ops.api_keys == ("a", "b") and c.ops.admin_key == "z"
    assert c.ops.models_dirs == (os.path.realpath(tmp_path),)
    c = build_config({"api_key": ["x,y"]}, {"PANTHEON_API_KEY": "a"})  # a flag is one key
    assert c.ops.api_keys == ("x,y",)
    with pytest.raises(ConfigError, match="not a folder"):
        build_config({"models_dir": [str(tmp_path / "nope")]}, {})


def test_config_file_layer(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(
        'port = 9001\nqueue-depth = 4\nmax_n = 5\napi_key = "one"\n'
        "cpu_dies = 2\nstep_stats = true\n"
        '[[models]]\npath = "/m/a"\nname = "a"\ndies = ["cpu:1"]\n'
        '[[models]]\npath = "/m/b"\n'
    )
    ap = build_parser()

    def cfg(argv, env):
        args = {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}
        return build_config(merge_config_file(args, env, ap), env)

    c = cfg(["--config", str(f)], {})
    assert (c.port, c.queue_depth, c.cpu_dies, c.ops.limits.max_n) == (9001, 4, 2, 5)
    assert c.ops.api_keys == ("one",) and c.ops.step_stats
    assert [(m.path, m.name, m.dies) for m in c.models] == [("/m/a", "a", ("cpu:1",)), ("/m/b", "b", ())]
    # a variable beats the file (its alias too), a flag beats both
    c = cfg(["--config", str(f), "--max-n", "2"], {"BS_QUEUE_DEPTH": "9", "PANTHEON_MAX_N": "3"})
    assert (c.queue_depth, c.ops.limits.max_n) == (9, 2)
    c = cfg(["--config", str(f), "--model", "/m/flag"], {})
    assert [m.path for m in c.models] == ["/m/flag"]  # --model replaces the file's models
    f.write_text(
        "[[models]]\npath = '/m/a'\naliases = ['x', 'y']\npreload = false\nkeep_alive = '10m'\n"
        "pin = true\nparams = { temperature = 0.6, top_k = 20 }\nquantize = true\nslots = 2\n"
        "max_context = 512\n"
    )
    (m,) = cfg(["--config", str(f)], {}).models
    assert (m.aliases, m.preload, m.keep_alive, m.pin, m.params) == (
        ("x", "y"),
        False,
        600.0,
        True,
        {"temperature": 0.6, "top_k": 20},
    )
    assert (m.quantize, m.slots, m.max_context) == (True, 2, 512)
    for text, what in (
        ("nope = 1\n", "unknown key"),
        ("port = [\n", "not valid TOML"),
        ("[[models]]\nname = 'x'\n", "needs a path"),
        ("[[models]]\npath = 'x'\ncolour = 2\n", "unknown keys"),
        ("[[models]]\npath = 'x'\nslots = 0\n", "'slots' must be a positive integer"),
        ("[[models]]\npath = 'x'\nkeep_alive = 'soon'\n", "not a duration"),
        ("[[models]]\npath = 'x'\nparams = { temp = 1 }\n", "unknown key 'temp'"),
        ("[[models]]\npath = 'x'\naliases = [1]\n", "'aliases' must be a list"),
    ):
        f.write_text(text)
        with pytest.raises(ConfigError, match=what):
            cfg(["--config", str(f)], {})
    with pytest.raises(ConfigError, match="--config"):
        cfg(["--config", str(tmp_path / "missing.toml")], {})


def test_help_documents_every_variable():
    r = _cli(["--help"])
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for name in SPEC_TABLE + (
        "PANTHEON_API_KEY",
        "PANTHEON_ADMIN_KEY",
        "PANTHEON_MODELS_DIR",
        "PANTHEON_REGISTRY_HEARTBEAT",
        "PANTHEON_DRAIN_TIMEOUT",
        "PANTHEON_LOG_FORMAT",
        "PANTHEON_BATCH_SLOTS",
        "PANTHEON_QUEUE_DEPTH",
        "PANTHEON_MAX_MODEL_LEN",
        "--config",
        "--api-key",
        "--admin-key",
        "--models-dir",
        "--max-stop-len",
        "--log-format",
        "--drain-timeout",
        "--worker-listen",
    ):
        assert name in text, name


def test_worker_listen_needs_curve_keys(tmp_path):
    r = _cli(["--model", "/nowhere", "--worker-listen", "tcp://127.0.0.1:5999"])
    assert r.returncode == 2 and "CURVE" in r.stderr
    keys = tmp_path / "keys"
    r = _cli(["--curve-keygen", str(keys)])
    assert r.returncode == 0, r.stderr
    assert (keys / "server.key").is_file() and (keys / "server.key_secret").is_file()
    assert (keys / "authorized" / "worker.key").is_file()
    assert (keys / "server.key_secret").stat().st_mode & 0o077 == 0
    from pantheon.core.curve import load_server_keys

    pub, sec = load_server_keys(str(keys))
    assert len(pub) == 40 and len(sec) == 40  # Z85 text of 32-byte keys
    # plain TCP only on loopback, and never beside keys
    r = _cli(["--model", "/nowhere", "--worker-listen", "tcp://0.0.0.0:5999", "--worker-insecure"])
    assert r.returncode == 2 and "loopback" in r.stderr
    r = _cli(["--worker-listen", "tcp://127.0.0.1:5999", "--worker-insecure", "--curve-dir", str(keys)])
    assert r.returncode == 2 and "choose one" in r.stderr
    r = _cli(["--model", "/nowhere", "--worker-listen", "udp://127.0.0.1:5999", "--curve-dir", str(keys)])
    assert r.returncode == 2 and "tcp://HOST:PORT" in r.stderr
    (keys / "server.key_secret").chmod(0o644)
    r = _cli(["--model", "/nowhere", "--worker-listen", "tcp://127.0.0.1:5999", "--curve-dir", str(keys)])
    assert r.returncode == 2 and "readable by others" in r.stderr


def test_served_from_a_config_file(model_factory, tmp_path):
    """The models, keys, limits, log format and engine knobs all from one TOML file."""
    tiny = model_factory("tiny")
    f = tmp_path / "serve.toml"
    f.write_text(
        f'port = {_free_port()}\ncpu_dies = 1\napi_key = ["file-key"]\n'
        'max_n = 5\nlog_format = "json"\nstep_stats = true\n'
        f'[[models]]\npath = "{tiny}"\nname = "from-file"\ndies = "cpu:0"\n'
    )
    s = Server(["--config", str(f)], tmp_path / "file.log", env={"PANTHEON_MAX_N": "2"})
    try:  # Server passes --port, which beats the file's port
        deadline = time.monotonic() + 90
        while True:
            assert s.proc.poll() is None, s.output()
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, s.output()
            time.sleep(0.25)
        auth = {"Authorization": "Bearer file-key"}
        assert httpx.get(s.url + "/v1/models").status_code == 401
        r = httpx.get(s.url + "/v1/models", headers=auth)
        assert [m["id"] for m in r.json()["data"]] == ["from-file"]
        r = httpx.post(
            s.url + "/v1/chat/completions",
            headers=auth,
            timeout=60,
            json={"messages": MSG, "max_tokens": 3, "n": 2},
        )
        assert r.status_code == 200, r.text
        err = check_error(
            httpx.post(s.url + "/v1/chat/completions", headers=auth, json={"messages": MSG, "n": 3}),
            400,
            param="n",
        )
        assert "limit is 2" in err["message"]  # the variable beat the file's 5
    finally:
        assert s.stop() == 0
    out = s.output()
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(r.get("logger") == "pantheon.access" for r in records)
    assert re.search(r"\[worker cpu:0\] step \d+ from-file\S* [\d.]+ ms \d+ tokens", out)


def test_ops_modules_never_import_torch():
    code = (
        "import sys; import pantheon.api.middleware, pantheon.api.auth, pantheon.api.metrics, pantheon.logs, "
        "pantheon.control.registration, pantheon.control.supervisor, pantheon.config.ops, pantheon.core.curve; "
        "bad = [m for m in ('torch', 'textual') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
