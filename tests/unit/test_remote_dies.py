"""The pieces of remote workers that need no process: die ids with a worker name, the die
manager's remote dies, the CURVE rules and keys (real ``zmq.auth`` certificate files), and the
worker's command-line checks. tests/e2e/test_remote_workers.py runs the whole thing."""

from __future__ import annotations

import os

import pytest

from pantheon.config.values import ConfigError
from pantheon.control.dies import DieManager
from pantheon.core import curve
from pantheon.core import protocol as p
from pantheon.errors import ApiError
from workers import worker as worker_mod

GiB = 1 << 30


def test_die_ids_carry_a_worker_name():
    assert p.parse_die("cuda:1@gpu-box.2") == ("cuda", 1)
    assert p.normalize_die("cpu:01@w_1") == "cpu:1@w_1"
    assert p.die_host("cpu:0@w1") == "w1" and p.die_host("cpu:0") == ""
    assert p.die_kind("cuda:0@x") == "cuda"
    for bad in ("cpu:0@", "cpu:0@a b", "cpu:0@a/b", "gpu:0@w", "cpu:0@" + "x" * 65):
        with pytest.raises(ValueError):
            p.parse_die(bad)


def test_a_remote_die_exists_once_its_worker_joined_and_is_sized_by_it():
    dm = DieManager(cpu_dies=1, cpu_budget=8 * GiB, cuda_count=0, host_available=lambda: 64 * GiB)
    with pytest.raises(ApiError) as e:
        dm.check("cpu:0@w1")
    assert e.value.status == 400 and e.value.code == "no_such_die" and "no worker joined" in e.value.message
    dm.on_worker("cpu:0@w1", total_bytes=2 * GiB, free_bytes=GiB, device_name="CPU (remote)")
    assert dm.check("cpu:00@w1") == "cpu:0@w1"
    d = dm.get("cpu:0@w1")
    assert d is not None and d.remote and d.known
    assert d.total_bytes == 2 * GiB  # its own budget, not the router's 8 GiB
    assert dm.free(d) == GiB  # what it reports free; the router host's RAM does not count
    assert dm.cpu_count == 1  # --cpu-dies counts the local dies only
    assert [x.id for x in dm.dies()] == ["cpu:0", "cpu:0@w1"]
    dm.book("i1", {"cpu:0@w1": (GiB // 2, GiB // 4)})
    assert dm.free(d) == GiB  # min(budget - booked, reported free): never counted twice
    dm.on_worker("cpu:0@w1", total_bytes=2 * GiB, free_bytes=GiB // 4)
    assert dm.free(d) == GiB // 4


def test_check_listen_rules(tmp_path):
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        curve.check_listen("ipc:///x", None)
    with pytest.raises(ConfigError, match="CURVE"):
        curve.check_listen("tcp://0.0.0.0:5999", None)
    with pytest.raises(ConfigError, match="loopback"):
        curve.check_listen("tcp://10.0.0.1:5999", None, insecure=True)
    for ok in ("tcp://127.0.0.1:1", "tcp://localhost:1", "tcp://[::1]:1", "tcp://127.3.2.1:1"):
        curve.check_listen(ok, None, insecure=True)
    with pytest.raises(ConfigError, match="no .*server.key_secret"):
        curve.check_listen("tcp://0.0.0.0:5999", str(tmp_path))
    keys = tmp_path / "k"
    curve.keygen(str(keys))
    curve.check_listen("tcp://0.0.0.0:5999", str(keys))
    with pytest.raises(ConfigError, match="choose one"):
        curve.check_listen("tcp://127.0.0.1:5999", str(keys), insecure=True)


def test_keys_for_more_workers_share_one_router_keypair(tmp_path):
    keys = str(tmp_path / "k")
    curve.keygen(keys, "w1")
    router = curve.load_server_keys(keys)
    curve.keygen(keys, "w2")
    assert curve.load_server_keys(keys) == router  # not overwritten
    pub1, sec1, server = curve.load_worker_keys(keys, "w1")
    pub2, _, _ = curve.load_worker_keys(keys, "w2")
    assert server == router[0] and pub1 != pub2 and len(sec1) == 40
    assert curve.authorized_keys(keys) == {pub1, pub2}
    assert os.stat(os.path.join(keys, "w2.key_secret")).st_mode & 0o077 == 0
    with pytest.raises(ConfigError):
        curve.keygen(keys, "server")
    with pytest.raises(ConfigError, match="readable by others"):
        os.chmod(os.path.join(keys, "w1.key_secret"), 0o644)
        curve.load_worker_keys(keys, "w1")


def test_the_authorizer_reads_authorized_at_each_handshake(tmp_path, caplog):
    keys = str(tmp_path / "k")
    curve.keygen(keys, "w1")
    other = str(tmp_path / "other")
    curve.keygen(other, "w9")
    pub9, _, _ = curve.load_worker_keys(other, "w9")
    pub1, _, _ = curve.load_worker_keys(keys, "w1")
    auth = curve.Authorizer(keys)
    assert auth.callback("*", pub1)
    with caplog.at_level("ERROR", logger="pantheon.core.curve"):
        assert not auth.callback("*", pub9)
    assert pub9.decode() in caplog.text and "authorized" in caplog.text and auth.refused == 1
    # an operator copies w9's public key in: the next handshake lets it in, no restart
    with open(os.path.join(other, "w9.key"), "rb") as src:
        with open(os.path.join(keys, "authorized", "w9.key"), "wb") as dst:
            dst.write(src.read())
    assert auth.callback("*", pub9)


def _worker_args(*argv: str):
    return worker_mod._parser().parse_args(["--die", "cpu:0", *argv])


def test_the_worker_command_line_rules(tmp_path):
    with pytest.raises(SystemExit):  # --endpoint or --router, not both
        _worker_args("--endpoint", "ipc:///x", "--router", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="parent"):
        worker_mod._remote(_worker_args("--router", "tcp://127.0.0.1:1", "--insecure", "--parent-pid", "1"))
    with pytest.raises(ValueError, match="loopback"):
        worker_mod._remote(_worker_args("--router", "tcp://10.1.1.1:1", "--insecure"))
    with pytest.raises(ValueError, match="--router needs CURVE keys"):
        worker_mod._remote(_worker_args("--router", "tcp://10.1.1.1:1"))
    assert worker_mod._remote(_worker_args("--router", "tcp://127.0.0.1:1", "--insecure")).secret is None
    keys = str(tmp_path / "k")
    curve.keygen(keys, "w1")
    r = worker_mod._remote(_worker_args("--router", "tcp://h:1", "--curve-dir", keys, "--key", "w1"))
    assert r.server_public == curve.load_server_keys(keys)[0]
    assert worker_mod.cli(
        ["--die", "cpu:0", "--router", "tcp://h:1", "--curve-dir", keys, "--key", "nope"]
    ) == (p.EXIT_BAD_ARGS)
    assert worker_mod.cli(
        ["--die", "cpu:0", "--router", "tcp://127.0.0.1:1", "--insecure", "--name", "a b"]
    ) == (p.EXIT_BAD_ARGS)
