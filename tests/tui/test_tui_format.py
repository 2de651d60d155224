"""The dashboard's pure rules: sizes, bars, slot texts, form validation, sorting, history."""

from __future__ import annotations

import datetime

import pytest
from test_tui_app import fixture

from pantheon.snapshot import InstanceState, QueueState, SlotState, Snapshot, Throughput
from tui.format import (
    busy_slots,
    clock_time,
    human_age,
    human_bytes,
    human_count,
    instance_state,
    pressure_name,
    slot_detail,
    slot_kind,
    speculation,
    split_bar,
)
from tui.forms import parse_dies, validate_load
from tui.history import History
from tui.widgets.instances import visible
from tui.widgets.slots import CELL, slot_cell


def test_sizes_counts_ages_and_times():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 << 20, 137 << 30, 3 << 40)] == [
        "0B",
        "1023B",
        "1.5K",
        "5.0M",
        "137G",
        "3.0T",
    ]
    assert [human_count(n) for n in (7, 1287, 40123554)] == ["7", "1.3k", "40.1M"]
    assert [human_age(s) for s in (None, 0.4, 42, 185, 7800)] == ["-", "0s", "42s", "3m05s", "2h10m"]
    assert clock_time(1767225600.0 + 3723, datetime.UTC) == "01:02:03"
    assert pressure_name(0) == "normal" and pressure_name(3) == "critical"
    assert pressure_name(9) == "critical"


@pytest.mark.parametrize(
    "w, k, f, width, want",
    [
        (1, 1, 2, 8, (2, 2, 4)),
        (0, 0, 0, 10, (0, 0, 10)),
        (1000, 1, 0, 10, (9, 1, 0)),  # a small KV cache stays visible
        (5, 5, 0, 9, (5, 4, 0)),  # nothing free: no free cell
        (3, 0, 1, 0, (0, 0, 0)),
    ],
)
def test_split_bar(w, k, f, width, want):
    got = split_bar(w, k, f, width)
    assert got == want and sum(got) == width


def test_slot_kinds_and_cells():
    idle, warm = SlotState(state="idle"), SlotState(state="idle", session_id="s1")
    pre = SlotState(state="prefill", prompt_tokens=200, prefilled=50)
    dec = SlotState(state="decode", generated=37)
    assert [slot_kind(s) for s in (idle, warm, pre, dec)] == ["idle", "warm", "prefill", "decode"]
    assert slot_detail(pre) == "25% of 200" and slot_detail(dec) == "37 tok"
    assert slot_detail(warm) == "s1" and slot_detail(idle) == ""
    for n, s in enumerate((idle, warm, pre, dec)):
        assert slot_cell(n, s).cell_len == CELL - 1
    assert "25%" in slot_cell(2, pre).plain and "decode 37 tok" in slot_cell(3, dec).plain
    inst = InstanceState(
        id="a#1", name="a", path="/a", dies=["cpu:0"], state="ready", slots=[idle, warm, pre, dec]
    )
    assert busy_slots(inst) == 2
    assert instance_state(inst) == "ready" and instance_state(inst, draining=True) == "draining"
    loading = InstanceState(id="b#2", name="b", path="/b", dies=[], state="loading", load_progress=0.42)
    assert instance_state(loading) == "loading 42%"


def _spec(draft: str = "", steps: int = 0, drafted: int = 0, accepted: int = 0, emitted: int = 0):
    return InstanceState(
        id="a#1",
        name="a",
        path="/a",
        dies=["cpu:0"],
        state="ready",
        draft=draft,
        spec_verify_steps=steps,
        spec_drafted=drafted,
        spec_accepted=accepted,
        spec_emitted=emitted,
    )


@pytest.mark.parametrize(
    "inst, want",
    [
        (_spec(), ""),  # never drafted (speculation off, or no request asked for it)
        (_spec("/models/draft-68m", steps=5), ""),  # nothing drafted yet: nothing to say
        (_spec(steps=100, drafted=200, accepted=142, emitted=242), "spec: lookup 71% accepted, 2.4 tok/step"),
        (
            _spec("/models/SmolLM2-135M/", steps=10, drafted=40, accepted=40, emitted=50),
            "spec: SmolLM2-135M 100% accepted, 5.0 tok/step",
        ),
        (
            _spec("/models/draft.q8_0.gguf", steps=3, drafted=12, accepted=0, emitted=3),
            "spec: draft.q8_0.gguf 0% accepted, 1.0 tok/step",
        ),
        (_spec("mtp", steps=8, drafted=8, accepted=6, emitted=14), "spec: mtp 75% accepted, 1.8 tok/step"),
        (_spec(drafted=3, accepted=1), "spec: lookup 33% accepted"),  # no steps counted: no rate
    ],
)
def test_speculation_line(inst, want):
    assert speculation(inst) == want


def test_parse_dies():
    assert parse_dies("") == [] and parse_dies(" cpu:0, 1 ,cuda:2") == ["cpu:0", "1", "cuda:2"]
    for bad, msg in (
        ("gpu:0", "bad die 'gpu:0'"),
        ("cpu:0,", "stray comma"),
        ("cpu:a", "bad die"),
        ("0,0", "twice"),
        ("cuda", "bad die"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_dies(bad)


def test_validate_load():
    req, errors = validate_load(" /models/x ", " x2 ", "cpu:0", True)
    assert errors == {} and (req.path, req.name, req.dies, req.quantize) == (
        "/models/x",
        "x2",
        ["cpu:0"],
        True,
    )
    req, errors = validate_load("/m", "", "", False)
    assert req.name is None and req.dies == []
    req, errors = validate_load("  ", "a b", "cpu:0;1", False)
    assert req is None and set(errors) == {"path", "name", "dies"}


def test_visible_filters_and_sorts_stably():
    insts = fixture("normal").instances
    assert [i.id for i in visible(insts, "", "name", False)] == ["llama#2", "qwen3#3", "tiny#1"]
    assert [i.id for i in visible(insts, "LLA", "name", False)] == ["llama#2"]
    assert [i.id for i in visible(insts, "#3", "name", False)] == ["qwen3#3"]  # ids match too
    assert [i.id for i in visible(insts, "", "slots", True)][0] == "tiny#1"
    assert [i.id for i in visible(insts, "", "kv", False)] == ["llama#2", "tiny#1", "qwen3#3"]


def test_history_samples_on_its_own_timebase():
    h = History(size=3)
    snap = Snapshot(
        ts=1.0,
        started_at=0.0,
        throughput=Throughput(tokens_per_s=5.0),
        queues=[QueueState(model="a", depth=2, max_depth=8), QueueState(model="b", depth=3, max_depth=8)],
    )
    for _ in range(4):
        h.sample(snap)
    h.sample(None)  # nothing yet: no sample
    assert list(h.tokens) == [5.0, 5.0, 5.0] and list(h.queue) == [5.0, 5.0, 5.0]


def _die(**kw):
    """A live 8 GiB die with 1 GiB of weights, as the router's snapshot has one."""
    from pantheon.snapshot import DieState

    base = dict(
        id="cpu:0",
        device_name="cpu",
        total_bytes=8 << 30,
        budget_bytes=8 << 30,
        weights_bytes=1 << 30,
        free_bytes=7 << 30,
    )
    return DieState(**(base | kw))


def test_die_line_shows_the_cpu_path_and_isa_when_wide():
    from tui.widgets.dies import die_line

    die = _die(isa="avx2", cpu_path="fp32-packed")
    assert "fp32-packed (avx2)" in die_line(die, 160).plain
    assert "avx2" not in die_line(die, 40).plain  # narrow: the bar and numbers only


def test_die_line_names_a_remote_dies_machine():
    from tui.widgets.dies import die_line

    assert "on gpu-host-2" in die_line(_die(id="cuda:0@gpu2", host="gpu-host-2"), 160).plain
    assert " on " not in die_line(_die(id="cuda:0"), 160).plain
