"""The admin API end to end: a real ``pantheon serve`` with two CPU dies of 48 MiB each, ``tiny``
on cpu:0 and ``llama`` on cpu:1, and real worker processes.

Every load error code (404, 409, 400, 507, 500) with the registry and the die bookings unchanged
after each; loads and unloads while other models stream; 16 instances at once; replicas share
the load and sessions stick; the prefix cache reset and ``cache_salt``; unload drains within its
deadline; context capping and denial on a model with a small context.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time

import httpx
import pytest

from pantheon.snapshot import decode_snapshot

from helpers.serve import MSG, Server, check_error, model_args, until

pytestmark = pytest.mark.timeout(180)
DIE_BUDGET = 48 << 20


@pytest.fixture(scope="module")
def adm(model_factory, tmp_path_factory):
    tiny, llama = model_factory("tiny"), model_factory("tiny-llama")
    s = Server(
        model_args(
            {"tiny": (tiny, "cpu:0"), "llama": (llama, "cpu:1")}, 2, "--cpu-die-budget", str(DIE_BUDGET)
        ),
        tmp_path_factory.mktemp("admin-logs") / "admin.log",
    )
    try:
        s.wait_ready(("tiny", "llama"))
        yield s
    finally:
        s.stop()


def load(s: Server, **body) -> httpx.Response:
    return httpx.post(s.url + "/admin/models/load", json=body, timeout=120)


def unload(s: Server, **body) -> httpx.Response:
    return httpx.post(s.url + "/admin/models/unload", json=body, timeout=120)


def chat(s: Server, **body) -> httpx.Response:
    body.setdefault("messages", MSG)
    return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)


def tables(s: Server) -> tuple:
    """What a failed load must leave unchanged: the instance table, every die's bookings, the
    served names."""
    rows = httpx.get(s.url + "/admin/models", timeout=10).json()["data"]
    insts = sorted(
        (r["instance"], r["name"], r["state"], tuple(r["dies"]))
        for r in rows
        if r["state"] != "failed" or "failed_at" not in r
    )
    dies = {d["die"]: d["bookings"] for d in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]}
    names = [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=10).json()["data"]]
    return insts, dies, names


def _copy(src, dst, **config):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_every_load_error_leaves_nothing_behind(adm, model_factory, tmp_path):
    tiny = model_factory("tiny")
    before = tables(adm)
    assert [n for n in before[2]] == ["tiny", "llama"]
    gpt2 = _copy(tiny, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    rope = _copy(tiny, tmp_path / "rope", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    broken = _copy(tiny, tmp_path / "broken")
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").mkdir()  # the worker cannot read it: an internal error
    big = model_factory("tiny", vocab_size=262144)  # ~64 MiB with the prepacked head
    cases = [
        (400, None, {"path": 5}),
        (400, None, {"path": str(tiny), "dies": ["gpu7"]}),
        (400, "no_such_die", {"path": str(tiny), "dies": ["cpu:5"]}),
        (400, None, {"path": str(tiny), "slots": 0}),
        (400, None, {"path": str(tiny), "name": "a#b"}),
        (400, "unsupported", {"path": str(gpt2)}),  # the router reads config.json
        (400, "unsupported", {"path": str(rope), "name": "rope"}),  # the worker refuses it
        (404, "not_found", {"path": str(tmp_path / "nothing")}),
        (409, "duplicate", {"path": str(tiny), "name": "tiny", "dies": ["cpu:0"]}),
        (507, "insufficient_memory", {"path": str(big)}),
        (507, "insufficient_memory", {"path": str(big), "dies": ["cpu:1"]}),
        (500, None, {"path": str(broken)}),
    ]
    for status, code, body in cases:
        r = load(adm, **body)
        err = check_error(r, status, **({} if code is None else {"code": code}))
        if status == 507 and "dies" in body:
            assert "cpu:1 lacks" in err["message"], err
        elif status == 507:
            assert "cpu:0 lacks" in err["message"] and "cpu:1 lacks" in err["message"], err
        assert tables(adm) == before, (status, body)
    # 409 while a load of the same name is in progress; wait: false answers 202 at once.
    # The workers are stopped meanwhile: a tiny load can finish before the second request
    # arrives, and then it rightly loads a replica instead (CI saw that race).
    pids = [d["pid"] for d in httpx.get(adm.url + "/admin/dies").json()["data"]]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        r = load(adm, path=str(tiny), name="q2", wait=False)
        assert r.status_code == 202 and r.json()["state"] == "loading", r.text
        check_error(load(adm, path=str(tiny), name="q2"), 409, code="conflict")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    until(lambda: "q2" in tables(adm)[2], what="q2 to load")
    assert unload(adm, name="q2").status_code == 200
    assert tables(adm) == before
    # a wait: false load that fails shows in GET /admin/models as failed, with its reason
    r = load(adm, path=str(broken), name="bg", wait=False)
    assert r.status_code == 202
    row = until(
        lambda: next(
            (
                m
                for m in httpx.get(adm.url + "/admin/models").json()["data"]
                if m["name"] == "bg" and m["state"] == "failed"
            ),
            None,
        ),
        what="the failure to show",
    )
    assert row["status"] == 500 and row["error"]
    assert tables(adm) == before


def _streamer(s: Server, model: str, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        body = {"model": model, "messages": MSG, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        out.append((r.status_code, lines))


def test_loads_and_unloads_while_other_models_stream(adm, model_factory):
    qwen2 = model_factory("tiny-qwen2")
    stop, out = threading.Event(), []
    threads = [threading.Thread(target=_streamer, args=(adm, m, stop, out)) for m in ("tiny", "llama")]
    for t in threads:
        t.start()
    try:
        for dies in ([], ["cpu:1"], ["cpu:0"]):
            r = load(adm, path=str(qwen2), name="q2", dies=dies)
            assert r.status_code == 200, r.text
            assert chat(adm, model="q2", max_tokens=2).status_code == 200
            assert unload(adm, name="q2").status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(out) >= 4
    for status, lines in out:
        assert status == 200 and lines[-1] == "[DONE]"
        # an error event is an object with an "error" key (a random model may write the word)
        errors = [line for line in lines[:-1] if "error" in json.loads(line)]
        assert not errors, errors[:2]  # the error events themselves, to read what went wrong
        assert sum('"content"' in line for line in lines) >= 2


async def test_16_instances_at_once(adm, model_factory):
    tiny = str(model_factory("tiny"))
    loaded = []
    for i in range(14):  # with tiny and llama: 16
        name = "many" if i % 2 else f"u{i}"
        r = await asyncio.to_thread(load, adm, path=tiny, name=name)
        assert r.status_code == 200, r.text
        loaded.append(r.json()["instance"])
    try:
        check_error(load(adm, path=tiny, name="seventeen"), 507, code="table_full")
        snap = decode_snapshot(httpx.get(adm.url + "/admin/state").content)  # noqa: ASYNC210
        assert len(snap.instances) == 16 and all(i.state == "ready" for i in snap.instances)
        per_die = {d.id: len(d.instances) for d in snap.dies}
        assert sum(per_die.values()) == 16 and min(per_die.values()) >= 6  # spread by free memory
        for d in snap.dies:
            assert d.weights_bytes + d.kv_bytes + d.free_bytes == d.budget_bytes == DIE_BUDGET
        names = sorted({i.name for i in snap.instances})
        async with httpx.AsyncClient(base_url=adm.url, timeout=60) as client:
            rs = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json={"model": n, "messages": MSG, "max_tokens": 3})
                    for n in names + ["many"] * 6
                )
            )
        assert [r.status_code for r in rs] == [200] * len(rs)
        assert len({r.headers["x-pantheon-instance"] for r in rs}) >= len(names) + 4
    finally:
        for target in sorted({x.split("#")[0] for x in loaded}):
            assert unload(adm, name=target).status_code == 200
    assert tables(adm)[2] == ["tiny", "llama"]


def test_replicas_share_the_load_sessions_stick_and_cache_reset(adm, model_factory):
    r = load(adm, path=str(model_factory("tiny")), name="tiny", dies=["cpu:1"])
    assert r.status_code == 200, r.text
    replica = r.json()["instance"]
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=adm.url, timeout=60) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            "/v1/chat/completions",
                            json={"model": "tiny", "messages": MSG, "max_tokens": 24, "ignore_eos": True},
                        )
                        for _ in range(8)
                    )
                )

        rs = asyncio.run(burst())
        by = [r.headers["x-pantheon-instance"] for r in rs]
        assert set(by) == {"tiny#1", replica} and min(by.count(x) for x in set(by)) >= 3, by
        seq = [chat(adm, model="tiny", max_tokens=1).headers["x-pantheon-instance"] for _ in range(4)]
        assert sorted(seq) == sorted(["tiny#1", replica] * 2), seq  # idle: they alternate
        # sessions: every turn of a session on the replica that holds its cache
        homes = {}
        for turn in range(3):
            for sid in ("s1", "s2", "s3"):
                msgs = [{"role": "user", "content": f"session {sid} says hello there"}]
                for k in range(turn):
                    msgs += [
                        {"role": "assistant", "content": f"reply {k}"},
                        {"role": "user", "content": f"and then {k} more"},
                    ]
                r = chat(adm, model="tiny", messages=msgs, max_tokens=2, session_id=sid)
                assert r.status_code == 200
                homes.setdefault(sid, set()).add(r.headers["x-pantheon-instance"])
                if turn:
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert all(len(h) == 1 for h in homes.values()), homes
        assert len(set().union(*homes.values())) == 2  # the sessions spread over both
        # the cache and its hit rate show in /admin/models; a reset empties it
        rows = until(
            lambda: [
                m
                for m in httpx.get(adm.url + "/admin/models").json()["data"]
                if m["name"] == "tiny" and (m.get("cache") or {}).get("hit_rate")
            ],
            what="cache statistics",
        )
        assert rows[0]["cache"]["blocks"] > 0 and rows[0]["cache"]["bytes"] > 0
        long_enough = "reset me now, a prompt of a few blocks of tokens " * 4
        again = {
            "model": "tiny",
            "messages": [{"role": "user", "content": long_enough}],
            "max_tokens": 1,
            "session_id": "s9",
        }
        chat(adm, **again)
        assert chat(adm, **again).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        r = httpx.post(adm.url + "/admin/cache/reset", json={"name": "tiny"}, timeout=10)
        assert r.status_code == 200 and sorted(r.json()["instances"]) == sorted(["tiny#1", replica])
        assert chat(adm, **again).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        check_error(httpx.post(adm.url + "/admin/cache/reset", json={"name": "nope"}), 404)
        assert httpx.post(adm.url + "/admin/cache/reset", json={}).status_code == 200  # all
    finally:
        r = unload(adm, instance=replica)
    assert r.status_code == 200 and r.json()["instances"] == [replica]


def test_cache_salt_separates_prefixes(adm):
    prompt = [
        {
            "role": "user",
            "content": "a salted prompt that is long enough to fill a block or two of the cache " * 2,
        }
    ]

    def cached(salt):
        r = chat(adm, model="llama", messages=prompt, max_tokens=1, cache_salt=salt)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0  # a different salt never shares
    check_error(chat(adm, model="llama", cache_salt=5), 400, param="cache_salt")


def test_unload_drains_within_its_deadline(adm, model_factory):
    tiny = str(model_factory("tiny"))
    assert load(adm, path=tiny, name="dr", dies=["cpu:1"]).status_code == 200
    events = []

    def long_stream():
        body = {"model": "dr", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", adm.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    th = threading.Thread(target=long_stream)
    th.start()
    until(lambda: len(events) > 3, what="the stream to start")
    t0 = time.monotonic()
    r = unload(adm, name="dr", drain_timeout=1.0)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert 0.9 < took < 4.0, took
    assert r.json()["results"][0]["drained"] is False and r.json()["results"][0]["ended"] == 1
    th.join(30)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "model_unloaded"
    check_error(chat(adm, model="dr"), 404)
    # a request that ends before the deadline is waited for, and ends normally
    assert load(adm, path=tiny, name="dr", dies=["cpu:1"]).status_code == 200
    res = {}
    th = threading.Thread(target=lambda: res.update(r=chat(adm, model="dr", max_tokens=150, ignore_eos=True)))
    th.start()
    until(
        lambda: any(
            i["in_flight"] for i in httpx.get(adm.url + "/admin/models").json()["data"] if i["name"] == "dr"
        ),
        what="the request to run",
    )
    r = unload(adm, name="dr", drain_timeout=20)
    th.join(30)
    assert r.json()["results"][0]["drained"] is True
    assert res["r"].status_code == 200 and res["r"].json()["usage"]["completion_tokens"] == 150


def test_context_capping_and_denial(adm, model_factory):
    assert load(adm, path=str(model_factory("tiny")), name="short", max_context=64).status_code == 200
    try:
        msgs = [{"role": "system", "content": "Be brief."}]
        for i in range(8):
            msgs += [
                {"role": "user", "content": f"question {i} about the weather in town"},
                {"role": "assistant", "content": f"answer {i}: sunny and warm today"},
            ]
        msgs.append({"role": "user", "content": "and tomorrow?"})
        for _ in range(2):
            r = chat(adm, model="short", messages=msgs, max_tokens=8)
            body = r.json()
            assert r.status_code == 200 and body["context_capped"] is True, r.text
            assert r.headers["x-context-capped"] == "true"
            u = body["usage"]
            assert u["prompt_tokens"] + 8 <= 64
            assert u["prompt_tokens_details"]["cached_tokens"] == 0  # a capped turn skips it
        with httpx.stream(
            "POST",
            adm.url + "/v1/chat/completions",
            timeout=60,
            json={"model": "short", "messages": msgs, "max_tokens": 4, "stream": True},
        ) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert chunks and all(c["context_capped"] is True for c in chunks)
        ok = chat(adm, model="short", max_tokens=8).json()
        assert "context_capped" not in ok  # a conversation that fits passes untouched
        err = check_error(
            chat(
                adm,
                model="short",
                max_tokens=8,
                messages=[{"role": "system", "content": "word " * 80}, {"role": "user", "content": "hi"}],
            ),
            400,
            code="context_length_exceeded",
        )
        assert "64" in err["message"]
        check_error(chat(adm, model="short", max_tokens=64), 400, code="context_length_exceeded")
    finally:
        assert unload(adm, name="short").status_code == 200


def test_quantized_load_books_less_weight_memory(adm, model_factory):
    tiny = str(model_factory("tiny"))
    r = load(adm, path=tiny, name="q8", quantize=True, dies=["cpu:1"])
    assert r.status_code == 200, r.text
    try:
        q8 = r.json()
        plain = next(
            m for m in httpx.get(adm.url + "/admin/models").json()["data"] if m["instance"] == "tiny#1"
        )
        assert q8["quantize"] is True
        assert q8["weights_bytes"] < plain["weights_bytes"], (q8, plain)  # the rows, should it fail
        # the int8 linears take half their bf16 bytes (plus a scale per row)
        assert chat(adm, model="q8", max_tokens=2).status_code == 200
    finally:
        assert unload(adm, name="q8").status_code == 200


def test_a_replica_split_over_two_dies_books_on_each(adm, model_factory):
    r = load(adm, path=str(model_factory("tiny")), name="split", dies=["cpu:0", "cpu:1"])
    assert r.status_code == 200, r.text
    iid = r.json()["instance"]
    try:
        dies = {d["die"]: d for d in httpx.get(adm.url + "/admin/dies").json()["data"]}
        on0, on1 = dies["cpu:0"]["bookings"][iid], dies["cpu:1"]["bookings"][iid]
        # the embeddings and the head live on the first die, one layer and its KV on each
        assert on0["weights_bytes"] > on1["weights_bytes"] > 0
        assert on0["kv_bytes"] == on1["kv_bytes"] > 0
        assert on0["weights_bytes"] + on1["weights_bytes"] == r.json()["weights_bytes"]
        assert chat(adm, model="split", max_tokens=3).status_code == 200
    finally:
        assert unload(adm, name="split").status_code == 200
    dies = {d["die"]: d for d in httpx.get(adm.url + "/admin/dies").json()["data"]}
    assert all(iid not in d["bookings"] for d in dies.values())


def test_dies_show_the_isa_the_working_cpu_paths_and_each_choice(adm):
    from pantheon.core.sizing import CPU_PATHS

    dies = {d["die"]: d for d in httpx.get(adm.url + "/admin/dies").json()["data"]}
    d = dies["cpu:0"]
    assert d["isa"] and d["cpu_paths"]["fp32"] == "ok" and set(d["cpu_paths"]) == set(CPU_PATHS)
    # this host has a C compiler (the CI's does): the paged decode kernel is built or cached
    assert d["attention"].startswith(("kernel: built ", "kernel: cached ")), d["attention"]
    assert d["linear"].startswith("kernel ") and d["linear"].split(": ")[1].startswith(("built ", "cached "))
    assert d["instances"] and all(i["cpu_path"] in CPU_PATHS for i in d["instances"])
    assert set(d["cpu_path"].split(",")) == {i["cpu_path"] for i in d["instances"]}
    snap = httpx.get(adm.url + "/admin/state").json()
    die = next(x for x in snap["dies"] if x["id"] == "cpu:0")
    assert die["isa"] == d["isa"] and die["cpu_path"] == d["cpu_path"]
