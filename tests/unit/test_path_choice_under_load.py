"""A load's CPU-path choice while other work holds the cores (workers/cpu_paths.py::choose).

The timings are simulated: the benches and the reference op are replaced by fakes whose seconds
come from a table of per-path costs, plus one second in the rounds a simulated peer disturbs (as
on a busy 2-core host, where five of six paths read ~1005 ms per step and fp32 was chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest

from pantheon.core.description import ModelDescription
from workers import cpu_paths

NAMES = ["bf16-packed", "bf16", "fp32-packed", "fp32"]
# seconds per step at (1 row, 8 rows): bf16-packed is fastest at both, fp32 is the slowest
COST = {
    "bf16-packed": (0.0020, 0.0022),
    "bf16": (0.0021, 0.0200),
    "fp32-packed": (0.0040, 0.0042),
    "fp32": (0.0041, 0.0045),
}
REF = 0.001  # the reference op's undisturbed seconds
STALL = 1.0  # what a disturbance adds


class World:
    """The fake host: which round is being timed, and whether the peer disturbs it."""

    def __init__(self, disturbed: Callable[[int, str], bool], n: int):
        self.disturbed = disturbed  # (round, path or "ref") -> stalled?
        self.n = n  # candidates
        self.ref_calls = 0  # one to warm up, then per round one before the first candidate and one after each
        self.rounds_seen = 0

    @property
    def round(self) -> int:
        return (self.ref_calls - 2) // (self.n + 1)  # -1 while warming up

    def seconds(self, what: str, base: float) -> float:
        r = self.round
        return base + (STALL if r >= 0 and self.disturbed(r, what) else 0.0)


@pytest.fixture
def world(monkeypatch):
    holder: dict[str, World] = {}

    class FakeBench:
        def __init__(self, name: str, shapes, experts=(), mxfp4: bool = False):
            self.name = name

        def once(self, rows: int) -> float:
            w = holder["w"]
            w.rounds_seen = max(w.rounds_seen, w.round + 1)
            return w.seconds(self.name, COST[self.name][0 if rows == 1 else 1])

    class FakeReference:
        def once(self) -> float:
            w = holder["w"]
            w.ref_calls += 1
            return w.seconds("ref", REF)

    monkeypatch.setattr(cpu_paths, "_Bench", FakeBench)
    monkeypatch.setattr(cpu_paths, "_Reference", FakeReference)
    monkeypatch.setattr(cpu_paths, "linear_shapes", lambda cfg: [])
    monkeypatch.setattr(cpu_paths, "expert_shapes", lambda cfg: [])
    monkeypatch.setattr(cpu_paths, "mxfp4_experts", lambda cfg: False)

    def make(disturbed: Callable[[int, str], bool], n: int = len(NAMES)) -> World:
        holder["w"] = World(disturbed, n)
        return holder["w"]

    return make


CFG = cast(ModelDescription, None)  # unused: the functions that read it are faked


def test_undisturbed_choice_is_the_fastest_path(world):
    w = world(lambda r, what: False)
    choice = cpu_paths.choose(CFG, NAMES)
    assert choice.name == "bf16-packed"
    assert choice.note == ""
    assert w.rounds_seen == 5  # nothing discarded: no extra rounds
    assert choice.timings["fp32"] == pytest.approx(COST["fp32"])


def test_a_peer_busy_through_the_first_rounds_does_not_decide_the_choice(world):
    # The peer serves during the first five rounds and stalls every path but fp32 (and the
    # reference timed between them); the old chooser, keeping each path's best of five, took fp32.
    w = world(lambda r, what: r < 5 and what != "fp32")
    choice = cpu_paths.choose(CFG, NAMES)
    assert choice.name == "bf16-packed"
    assert choice.name != "fp32"
    assert w.rounds_seen > 5  # retimed after the disturbed rounds
    assert "discarded as disturbed" in choice.note
    for n in NAMES:  # the timings kept are the clean ones
        assert choice.timings[n] == pytest.approx(COST[n])


def test_every_other_round_disturbed_for_most_paths(world):
    w = world(lambda r, what: r % 2 == 0 and what != "fp32")
    choice = cpu_paths.choose(CFG, NAMES)
    assert choice.name == "bf16-packed"
    assert choice.timings["bf16"] == pytest.approx(COST["bf16"])
    assert "discarded as disturbed" in choice.note
    assert w.rounds_seen == 5  # two clean rounds of five were enough


def test_disturbance_the_reference_misses_is_outlasted_by_the_best_of_rounds(world):
    world(lambda r, what: r % 2 == 1 and what not in ("fp32", "ref"))
    choice = cpu_paths.choose(CFG, NAMES)
    assert choice.name == "bf16-packed"
    assert choice.note == ""


def test_a_host_disturbed_throughout_keeps_the_static_order(world):
    # Every round stalls every path but fp32, the reference too: its best is itself disturbed
    # (slower than any CPU runs it), so no timing is clean.
    w = world(lambda r, what: what != "fp32")
    choice = cpu_paths.choose(CFG, NAMES)
    assert choice.name == NAMES[0] == "bf16-packed"
    assert choice.name != "fp32"
    assert "static order" in choice.note and "disturbed" in choice.note
    assert w.rounds_seen == 5 * (1 + cpu_paths._MORE_ROUNDS)  # retimed as far as allowed
    assert set(choice.timings) == set(NAMES)


def test_static_order_fallback_follows_the_candidates_order(world):
    names = ["fp32-packed", "fp32"]
    world(lambda r, what: what != "fp32", len(names))
    choice = cpu_paths.choose(CFG, names)
    assert choice.name == "fp32-packed"
    assert "static order" in choice.note


def test_a_later_path_still_wins_when_the_timings_are_clean(world):
    # bf16 is fastest at 1 row but 10x slower at 8; with the fp32-packed path first among the
    # candidates and clean timings, bf16-packed beats it by far more than the margin.
    world(lambda r, what: r in (0, 2) and what != "fp32")
    choice = cpu_paths.choose(CFG, ["fp32-packed", "bf16", "bf16-packed", "fp32"])
    assert choice.name == "bf16-packed"
