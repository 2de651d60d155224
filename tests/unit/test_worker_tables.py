"""Nothing a request leaves behind in the worker: once every request has ended, however it
ended, every per-request table of the worker and its engine is empty (issue 23 §7, the worker's
RSS over a soak: what grows per request must be let go when the request ends).

A real ``Worker`` on a real ``Engine`` (the tiny model), talking over a real ZeroMQ socket to a
ROUTER socket that plays the router's part: requests that finish, carry a grammar, fail their
grammar (after waiting for a slot: it found that such a failure was lost, see
``Grammars.take_failures``), are rejected at submit, are aborted while queued and while
decoding, share a small pool, and one is cut at the pool's size.
"""

from __future__ import annotations

import llguidance as llg
import pytest
import torch
import zmq

from pantheon.api import structured
from pantheon.core import protocol as p
from workers.cache import kv_block_bytes
from workers.devices import open_die
from workers.engine import Engine
from workers.model_config import load_config
from workers.worker import Worker

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def path(model_factory) -> str:
    return str(model_factory("tiny", dtype="float32"))


@pytest.fixture
def wired(path, tmp_path):
    """(worker with the tiny model registered as "tiny", the router's socket)."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/router.sock"
    router.bind(endpoint)
    w = Worker(open_die("cpu:0"), endpoint)
    w.link.connect()
    block = kv_block_bytes(load_config(path), 4, torch.float32)
    # 40 blocks of 4 tokens: two 60-token prompts that grow run it dry (preemption), and one
    # prompt of 150 tokens that asks for 100 more is cut at its size
    engine = Engine(
        path, dtype="float32", cpu_path="fp32", num_slots=2, block_size=4, kv_budget_bytes=block * 40
    )
    w.instances.register("tiny", engine)
    yield w, router
    w.instances.close_engine(engine)
    w.link.close()
    router.close(0)


def _submit(w: Worker, rid: str, prompt: list[int], **params) -> None:
    w.handle(p.Submit(request_id=rid, instance="tiny", prompt=prompt, params=p.SamplingParams(**params)))


def _received(router: zmq.Socket, wait_ms: int = 0) -> list[p.WorkerMsg]:
    """What the worker sent so far; with ``wait_ms``, until nothing more came for that long."""
    out = []
    while router.poll(wait_ms):
        _identity, data = router.recv_multipart()
        out.append(p.decode_worker_msg(data))
    return out


def test_every_per_request_table_is_empty_once_requests_end(wired):
    w, router = wired
    greedy = {"temperature": 0.0, "ignore_eos": True}
    _submit(w, "done", list(range(3, 23)), max_tokens=6, **greedy)
    _submit(w, "json", [5, 6, 7], max_tokens=40, grammar=structured.json_schema_grammar(SCHEMA, "schema"))
    _submit(w, "fails", [5, 6, 7], max_tokens=40, grammar=llg.LLMatcher.grammar_from_regex("a{1000000}"))
    _submit(w, "bad", [10**6], max_tokens=4)  # out of the vocabulary: rejected at submit
    _submit(w, "queued", [9, 9, 9], max_tokens=4)  # behind the others: aborted before it runs
    _submit(w, "decoding", list(range(40, 50)), max_tokens=30, temperature=0.9, seed=1)
    for i in range(4):  # two at a time fill the pool as they grow
        _submit(w, f"grow{i}", list(range(100 + i, 160 + i)), max_tokens=20, **greedy)
    _submit(w, "cut", list(range(200, 350)), max_tokens=100, **greedy)
    w.handle(p.Abort(request_ids=["queued"]))

    msgs: list[p.WorkerMsg] = []
    tokens: dict[str, list[p.TokenOut]] = {}
    turns = 0

    def take(wait_ms: int = 0) -> None:
        for m in _received(router, wait_ms):
            msgs.append(m)
            for t in m.tokens if isinstance(m, p.StepOutput) else []:
                tokens.setdefault(t.request_id, []).append(t)

    while w.stepper.step_all():
        turns += 1
        assert turns < 2000
        take()
        if len(tokens.get("decoding", [])) >= 2 and "decoding" in w.instances.owner:
            w.handle(p.Abort(request_ids=["decoding"]))
    take(wait_ms=200)  # the last steps' messages may still be on their way

    tables = w.request_tables()
    assert tables and all(n == 0 for n in tables.values()), tables
    engine = w.instances.loaded["tiny"].engine
    assert all(s is None for s in engine.scheduler.slots)
    # and each request did end the way it was meant to
    rejected = {m.request_id: m.kind for m in msgs if isinstance(m, p.Rejected)}
    assert rejected == {"bad": "invalid", "fails": "invalid"}
    assert tokens["done"][-1].finish == "length" and len(tokens["done"]) == 6
    assert tokens["json"][-1].finish is not None
    assert tokens["cut"][-1].finish == "length" and len(tokens["cut"]) < 100  # the pool's size
    assert "queued" not in tokens
    assert 2 <= len(tokens["decoding"]) < 30 and all(t.finish is None for t in tokens["decoding"])  # aborted
    assert all(tokens[f"grow{i}"][-1].finish == "length" for i in range(4))
