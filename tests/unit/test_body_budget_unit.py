"""``BodyBudget`` (``pantheon/api/inflight.py``): the router-wide bound on request-body bytes in
flight: declared lengths are reserved up front, chunked bodies count as they arrive, one body
alone always passes, a release gives its bytes back once, and a body over ``--max-body`` holds
nothing (the app drops it)."""

from __future__ import annotations

from pantheon.api.inflight import BodyBudget

MB = 1 << 20


def test_declared_lengths_are_reserved_and_refused_past_the_bound():
    b = BodyBudget(limit=10 * MB, max_body=8 * MB)
    t1 = b.ticket(6 * MB)
    assert t1 is not None and b.in_flight == 6 * MB
    assert b.ticket(5 * MB) is None and b.in_flight == 6 * MB  # 11 MB > 10 MB: refused, nothing held
    t2 = b.ticket(4 * MB)
    assert t2 is not None and b.in_flight == 10 * MB  # exactly at the bound: admitted
    t1.release()
    t1.release()  # once only
    assert b.in_flight == 4 * MB
    t2.release()
    assert b.in_flight == 0


def test_one_body_alone_always_passes():
    b = BodyBudget(limit=1 * MB, max_body=8 * MB)
    t = b.ticket(8 * MB)
    assert t is not None and b.in_flight == 8 * MB
    assert b.ticket(1) is None


def test_chunked_bodies_count_as_they_arrive():
    b = BodyBudget(limit=4 * MB, max_body=8 * MB)
    held = b.ticket(3 * MB)
    chunked = b.ticket(None)
    assert held is not None and chunked is not None and b.in_flight == 3 * MB
    assert chunked.arrived(MB)  # 4 MB: at the bound
    assert b.in_flight == 4 * MB
    assert not chunked.arrived(1)  # past it
    chunked.release()
    assert b.in_flight == 3 * MB
    assert held.arrived(3 * MB) and b.in_flight == 3 * MB  # within its reservation: no growth


def test_a_body_over_max_body_holds_nothing():
    b = BodyBudget(limit=4 * MB, max_body=2 * MB)
    t = b.ticket(3 * MB)  # the app answers 413 and keeps none of it
    assert t is not None and b.in_flight == 0
    c = b.ticket(None)
    assert c is not None and c.arrived(2 * MB) and b.in_flight == 2 * MB
    assert c.arrived(MB) and b.in_flight == 3 * MB  # the piece that crosses --max-body
    assert c.arrived(MB) and b.in_flight == 3 * MB  # after it: dropped by the app, not counted
    c.release()
    assert b.in_flight == 0
