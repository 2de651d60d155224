"""What router and worker agree on outside the messages themselves (pantheon.core.protocol): the die-id
parser, the worker exit codes and their meanings, and the code fields checked on decode.
Pure functions: no process, no socket."""

from __future__ import annotations

import typing

import msgspec
import pytest

from pantheon.core import protocol as p
from pantheon.workerlink.link import verdict
from pantheon.workerlink.process import describe_exit

# ---------------------------------------------------------------------- die ids


@pytest.mark.parametrize(
    "raw, parsed",
    [
        ("cpu:0", ("cpu", 0)),
        ("cuda:3", ("cuda", 3)),
        ("cpu:12", ("cpu", 12)),
        ("2", ("cuda", 2)),  # a bare integer is a CUDA die
        ("cuda:01", ("cuda", 1)),
    ],
)
def test_parse_die(raw, parsed):
    assert p.parse_die(raw) == parsed
    assert p.die_kind(raw) == parsed[0]
    assert p.normalize_die(raw) == f"{parsed[0]}:{parsed[1]}"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "cpu",
        "cuda",
        "gpu:0",
        "cpu:",
        "cuda:-1",
        "cuda:1.5",
        "cpu:0:1",
        "CPU:0",
        " cpu:0",
        "cpu:0\n",
        "cuda: 1",
        "-1",
        ":0",
    ],
)
def test_parse_die_refuses(bad):
    with pytest.raises(ValueError, match="expected cpu:N or cuda:N"):
        p.parse_die(bad)
    with pytest.raises(ValueError):
        p.normalize_die(bad)


def test_the_worker_and_the_router_share_the_parser():
    from pantheon.control.dies import DieManager
    from workers import devices

    assert devices.parse_die is p.parse_die and devices.normalize_die is p.normalize_die
    dm = DieManager(cpu_dies=2, cpu_budget=1 << 30, cuda_count=2)
    assert dm.check("1") == "cuda:1" and dm.check("cpu:01") == "cpu:1"
    assert [d.id for d in dm.dies()] == ["cpu:0", "cpu:1", "cuda:1"]


# ---------------------------------------------------------------------- exit codes


def test_exit_codes_are_distinct_and_described():
    codes = [p.EXIT_OK, p.EXIT_BAD_ARGS, p.EXIT_ROUTER_SILENT, p.EXIT_PARENT_GONE, p.EXIT_REFUSED]
    assert codes == [0, 2, 3, 4, 5]  # the worker's tests (test_worker, test_remote_workers) expect these
    assert set(p.EXIT_MEANINGS) == {p.EXIT_BAD_ARGS, p.EXIT_ROUTER_SILENT, p.EXIT_PARENT_GONE, p.EXIT_REFUSED}
    assert all(p.EXIT_MEANINGS.values())


def test_describe_exit():
    assert describe_exit(4) == "exited with code 4 (its parent process went away)"
    assert describe_exit(p.EXIT_BAD_ARGS).endswith(f"({p.EXIT_MEANINGS[p.EXIT_BAD_ARGS]})")
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-9) == "killed by signal SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def test_the_worker_uses_the_protocol_exit_codes():
    import workers.worker as worker

    src = open(worker.__file__).read()
    assert "EXIT_OK = " not in src and "p.EXIT_PARENT_GONE" in src


# ---------------------------------------------------------------------- code fields


@pytest.mark.parametrize(
    "make, alias",
    [
        (lambda k: p.LoadFailed(instance="m", kind=k, reason="r"), p.LoadFailKind),
        (lambda k: p.Rejected(request_id="r", kind=k, reason="r"), p.RejectKind),
        (lambda k: p.StepOutput(instance="m", tokens=[p.TokenOut("r", 1, finish=k)]), p.FinishReason),
    ],
)
def test_code_fields_are_checked_on_decode(make, alias):
    for kind in typing.get_args(alias):
        msg = make(kind)
        assert p.decode_worker_msg(p.encode(msg)) == msg
    with pytest.raises(msgspec.ValidationError):
        p.decode_worker_msg(p.encode(make("bogus")))


def test_codes_stay_strings_on_the_wire():
    raw = msgspec.msgpack.decode(p.encode(p.LoadFailed(instance="m", kind="out_of_memory", reason="r")))
    assert raw["kind"] == "out_of_memory"
    stats = p.Stats(
        free_bytes=1,
        total_bytes=2,
        instances=[
            p.InstanceStats(
                instance="m",
                slots=[p.SlotInfo("decode")],
                waiting=0,
                kv_blocks_total=1,
                kv_blocks_used=0,
                weight_bytes=0,
                kv_bytes=0,
            )
        ],
    )
    assert p.decode_worker_msg(p.encode(stats)) == stats
    bad = msgspec.msgpack.encode(
        {
            **msgspec.to_builtins(stats),
            "instances": [{**msgspec.to_builtins(stats.instances[0]), "slots": [["sleeping"]]}],
        }
    )
    with pytest.raises(msgspec.ValidationError):
        p.decode_worker_msg(bad)


# ---------------------------------------------------------------------- liveness


def test_verdict():
    kw = dict(pid=42, dead_after=30.0, step_timeout=300.0)
    assert verdict(silent_s=1.0, beat=None, **kw) is None
    assert verdict(silent_s=1.0, beat=p.Beat(turns=1, turn_s=299.0, steps=3), **kw) is None
    assert "sent nothing" in verdict(silent_s=31.0, beat=None, **kw)
    hung = verdict(silent_s=0.5, beat=p.Beat(turns=1, turn_s=301.0, steps=3), **kw)
    assert "step has run 301 s" in hung and "after 3 steps" in hung
