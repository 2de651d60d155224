"""bench/rss.py's arithmetic: the growth per 1000 requests and the table the soak prints."""

from __future__ import annotations

import os

from bench import rss

MIB = rss.MIB


def _samples(per_request: int, warm: int) -> list[rss.Sample]:
    """Ten samples, 10 s and 20 requests apart; the first ``warm`` bytes arrive at the start."""
    out = []
    for i in range(10):
        worker = 500 * MIB + (warm if i else 0) + per_request * 20 * i
        out.append(
            rss.Sample(10.0 * i, 20 * i, rss.Mem(100 * MIB, 80 * MIB), {"cpu:0": rss.Mem(worker, worker)})
        )
    return out


def test_growth_per_1000_requests_leaves_the_warm_up_out():
    samples = _samples(per_request=MIB // 4, warm=300 * MIB)
    g = rss.growth_per_1000(samples, lambda s: s.workers["cpu:0"].rss)
    assert g == 250 * MIB  # 0.25 MiB a request; the 300 MiB of warm-up are not in the slope
    assert rss.growth_per_1000(samples, lambda s: s.router.rss if s.router else None) == 0
    assert rss.growth_per_1000(samples[:1], lambda s: s.workers["cpu:0"].rss) is None


def test_the_table_has_a_row_per_sample_the_idle_row_and_the_growth():
    samples = _samples(per_request=MIB, warm=0)
    idle = rss.Sample(100.0, 180, rss.Mem(100 * MIB, 80 * MIB), {"cpu:0": rss.Mem(400 * MIB, 300 * MIB)})
    lines = rss.table(samples, idle=idle).splitlines()
    assert "cpu:0 MiB" in lines[0] and len(lines) == 1 + 10 + 1 + 2
    assert lines[11].split()[:2] == ["idle", "180"] and "400 (   300)" in lines[11]
    assert lines[12].split()[-1] == "+1000.0"  # MiB per 1000 requests


def test_read_mem_of_this_process():
    m = rss.read_mem(os.getpid())
    assert m is not None and 0 < m.anon <= m.rss
    assert rss.read_mem(2**22 + 12345) is None  # no such pid
