"""Die pressure counts what can still grow, not the pools booked at load (issue 16)."""

import pytest

from pantheon.control.pressure import (
    CRITICAL,
    DEFAULT_THRESHOLDS,
    HIGH,
    NORMAL,
    PressureSource,
    headroom_used,
    level_for,
)

GB, GiB = 10**9, 1 << 30
H200 = 141 * GB


def test_a_well_packed_h200_is_normal():
    # weights and KV pools booked to the brim, 4 GiB left free: the old rule (1 - free/total)
    # read 97% used (HIGH; a little less free and CRITICAL, which holds every request in the
    # queue), though nothing that can grow is short
    booked = 136 * GB
    assert level_for(1 - 4 * GiB / H200, DEFAULT_THRESHOLDS) == HIGH
    assert level_for(1 - 3 * GiB / H200, DEFAULT_THRESHOLDS) == CRITICAL
    assert headroom_used(H200, 4 * GiB, booked) < 0.2
    src = PressureSource(
        die_probe=lambda d: (H200, 4 * GiB), booked_probe=lambda d: booked, host_probe=lambda: (100, 100)
    )
    assert src.die_level("cuda:0") == NORMAL
    assert src.level(["cuda:0"]) == NORMAL


def test_headroom_eaten_by_activations_is_critical():
    booked = 120 * GB  # 21 GB unbooked, of which 20.5 GB is in use beyond the pools
    free = int(0.5 * GB)
    src = PressureSource(
        die_probe=lambda d: (H200, free), booked_probe=lambda d: booked, host_probe=lambda: (100, 100)
    )
    assert src.die_level("cuda:0") == CRITICAL


def test_nothing_booked_is_the_plain_used_fraction():
    for free in (50 * GB, 15 * GB, 8 * GB, 2 * GB):
        assert headroom_used(H200, free, 0) == pytest.approx(1 - free / H200)
    src = PressureSource(die_probe=lambda d: (H200, 2 * GB), host_probe=lambda: (100, 100))
    assert src.die_level("cuda:0") == CRITICAL  # no booked probe: nothing booked


def test_edges_stay_in_range():
    assert headroom_used(H200, 0, H200) == 1.0  # all booked, nothing free: no room at all
    assert headroom_used(H200, GB, H200 + GB) == 0.0  # bookings over-estimate: clamp
    assert headroom_used(H200, H200, 10 * GB) == 0.0  # more free than unbooked: nothing beyond
    assert 0.0 <= headroom_used(H200, 3 * GB, 100 * GB) <= 1.0


def test_the_kv_pool_is_the_full_context_unless_memory_says_less():
    from pantheon.core.sizing import BLOCK_TOKENS, Estimate

    est = Estimate(
        base=0, layer_bytes=(0,), kv_layer_bytes=(1000,), state_layer_bytes=(0,), context_limit=40960
    )
    tok = lambda b: b // est.kv_per_token  # noqa: E731
    # room for everything: one full context (not the 8192 floor, which used to cap it)
    assert tok(est.kv_for(context=40960, floor=8192, room_tokens=10**9)) == 40960
    # room for 20000 tokens: that, in whole blocks
    got = tok(est.kv_for(context=40960, floor=8192, room_tokens=20000))
    assert got == 20000 // BLOCK_TOKENS * BLOCK_TOKENS + (BLOCK_TOKENS if 20000 % BLOCK_TOKENS else 0)
    # less room than the floor: the floor (the die then refuses the load: 507)
    assert tok(est.kv_for(context=40960, floor=8192, room_tokens=100)) == 8192
    # a model shorter than the floor: its context
    assert tok(est.kv_for(context=2048, floor=8192, room_tokens=10**9)) == 2048
