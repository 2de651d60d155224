"""``GET /metrics`` and the request log, on a real ``pantheon serve`` (``--slots 1``, JSON logs).

Known traffic goes in, then the Prometheus text is parsed with prometheus-client's own parser and
the values are checked: token counters against the responses' usage, histogram counts against the
number of requests and tokens, gauges during and after a stream, 429s, loads and unloads. The same
requests are found in the JSON log, one line each.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.serve import MSG, Server, check_error, until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    logs = tmp_path_factory.mktemp("metrics")
    s = Server(
        ["--model", str(tiny), "--name", "tiny", "--cpu-dies", "1", "--slots", "1", "--log-format", "json"],
        logs / "metrics.log",
    )
    try:
        s.wait_ready(("tiny",))
        yield s
    finally:
        assert s.stop() == 0, s.output()


def scrape(s: Server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics, parsed by prometheus-client."""
    r = httpx.get(s.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(s: Server, **kw) -> dict:
    r = httpx.post(
        s.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": MSG, "max_tokens": 4, "ignore_eos": True, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_series_after_known_traffic(srv):
    before = scrape(srv)
    outs = [chat(srv, seed=i) for i in range(3)]
    # and one streamed request, with usage
    with httpx.stream(
        "POST",
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "messages": MSG,
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        events = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    usages = [o["usage"] for o in outs] + [events[-1]["usage"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    gen = sum(u["completion_tokens"] for u in usages)
    assert gen == 3 * 4 + 5
    m = scrape(srv)

    def delta(name, **labels):
        return val(m, name, **labels) - val(before, name, **labels)

    tiny = {"model_name": "tiny"}
    assert delta("vllm:prompt_tokens_total", **tiny) == prompt
    assert delta("vllm:generation_tokens_total", **tiny) == gen
    assert delta("vllm:e2e_request_latency_seconds_count", **tiny) == 4
    assert delta("vllm:time_to_first_token_seconds_count", **tiny) == 4
    assert delta("vllm:inter_token_latency_seconds_count", **tiny) == gen - 4
    assert delta("vllm:request_queue_time_seconds_count", **tiny) == 4
    assert delta("vllm:request_success_total", finished_reason="length", **tiny) == 4
    e2e = delta("vllm:e2e_request_latency_seconds_sum", **tiny)
    ttft = delta("vllm:time_to_first_token_seconds_sum", **tiny)
    assert 0 < ttft < e2e < 60
    # a histogram's +Inf bucket holds every observation
    assert delta("vllm:e2e_request_latency_seconds_bucket", le="+Inf", **tiny) == 4
    # idle now: nothing running or waiting; the die is reported
    assert val(m, "vllm:num_requests_running", **tiny) == 0
    assert val(m, "vllm:num_requests_waiting", **tiny) == 0
    assert ("vllm:kv_cache_usage_perc", (("model_name", "tiny"),)) in m
    assert val(m, "pantheon_die_alive", die="cpu:0") == 1
    assert val(m, "pantheon_die_memory_total_bytes", die="cpu:0") > 0
    assert ("pantheon_die_memory_booked_bytes", (("die", "cpu:0"),)) in m
    iid = [k for k in m if k[0] == "pantheon_instance_ready"][0]
    assert dict(iid[1])["state"] == "ready" and m[iid] == 1


def test_prefix_cache_counters_and_cache_info(srv):
    """vLLM's prefix-cache counters count prompt tokens in whole KV blocks: the second of two
    identical long prompts finds the first one's full blocks; the info series names the block
    size and the pool's blocks."""
    # known once the worker's Stats have reported the instance (a few times a second)
    info = until(lambda: [k for k in scrape(srv) if k[0] == "vllm:cache_config_info"], 10, "the info series")
    assert len(info) == 1, info
    labels = dict(info[0][1])
    block, blocks = int(labels["block_size"]), int(labels["num_gpu_blocks"])
    assert labels["model_name"] == "tiny" and block > 0 and blocks > 0
    assert labels["enable_prefix_caching"] == "True"
    tiny = {"model_name": "tiny"}
    before = scrape(srv)
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 12}]
    for _ in range(2):
        chat(srv, messages=long, max_tokens=1)

    def grew():  # the worker's Stats come a few times a second
        m = scrape(srv)
        q = val(m, "vllm:prefix_cache_queries_total", **tiny) - val(
            before, "vllm:prefix_cache_queries_total", **tiny
        )
        h = val(m, "vllm:prefix_cache_hits_total", **tiny) - val(
            before, "vllm:prefix_cache_hits_total", **tiny
        )
        return (q, h) if h > 0 else None

    queries, hits = until(grew, timeout=10, what="the prefix cache counters")
    assert queries % block == 0 and hits % block == 0  # whole blocks, counted in tokens
    assert hits >= 2 * block and queries >= 2 * hits  # both prompts looked up; the second hit


def test_gauges_during_a_stream_and_429(srv):
    before = scrape(srv)
    started, leave = threading.Event(), threading.Event()

    def long_stream():  # runs until the test is done with it, then the client goes away
        with httpx.stream(
            "POST",
            srv.url + "/v1/chat/completions",
            timeout=60,
            json={"model": "tiny", "messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True},
        ) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n == 3:
                        started.set()
                    if leave.is_set():
                        break

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(30)
        m = scrape(srv)
        assert val(m, "vllm:num_requests_running", model_name="tiny") == 1
        deadline = time.monotonic() + 5  # KV usage comes with the worker's Stats (4 a second)
        while val(m, "vllm:kv_cache_usage_perc", model_name="tiny") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            m = scrape(srv)
        assert 0 < val(m, "vllm:kv_cache_usage_perc", model_name="tiny") <= 1
        busy = httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": MSG, "max_tokens": 2},
        )
        check_error(busy, 429, code="server_busy")  # single-user mode: busy at once
        assert busy.headers["retry-after"] == "1"
    finally:
        leave.set()
        t.join(60)
    m = scrape(srv)
    assert (
        val(m, "pantheon_requests_rejected_total", model_name="tiny", status="429")
        - val(before, "pantheon_requests_rejected_total", model_name="tiny", status="429")
        == 1
    )
    deadline = time.monotonic() + 5  # the client left: the request ends, its slot comes back
    while val(m, "vllm:num_requests_running", model_name="tiny") and time.monotonic() < deadline:
        time.sleep(0.1)
        m = scrape(srv)
    assert val(m, "vllm:num_requests_running", model_name="tiny") == 0
    assert (
        val(m, "vllm:generation_tokens_total", model_name="tiny")
        - val(before, "vllm:generation_tokens_total", model_name="tiny")
        >= 3
    )


def test_loads_unloads_and_admin_actions(srv, model_factory):
    q = model_factory("tiny-qwen2")
    r = httpx.post(srv.url + "/admin/models/load", json={"path": str(q), "name": "q2"}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/admin/models/unload", json={"name": "q2"}, timeout=60)
    assert r.status_code == 200, r.text
    check_error(httpx.post(srv.url + "/admin/models/load", json={"path": "/no/such"}), 404)
    time.sleep(0.6)  # the instance watcher polls every 0.25 s
    m = scrape(srv)
    assert val(m, "pantheon_model_loads_total", model_name="q2") == 1
    assert val(m, "pantheon_model_unloads_total", model_name="q2") == 1
    assert val(m, "pantheon_model_loads_total", model_name="tiny") == 1
    assert val(m, "pantheon_admin_actions_total", action="models/load", status="200") == 1
    assert val(m, "pantheon_admin_actions_total", action="models/load", status="404") == 1
    assert val(m, "pantheon_admin_actions_total", action="models/unload", status="200") == 1


def test_json_request_log(srv):
    out = chat(srv, seed=42)
    check_error(httpx.post(srv.url + "/v1/chat/completions", json={"messages": "x"}), 400)
    check_error(httpx.post(srv.url + "/admin/models/load", json={"path": "/no/such/x", "name": "x"}), 404)
    time.sleep(0.3)
    records = [json.loads(line) for line in srv.output().splitlines() if line.startswith("{")]
    reqs = [r for r in records if r.get("logger") == "pantheon.access"]
    mine = [r for r in reqs if r.get("id") == out["id"]]
    assert len(mine) == 1, reqs[-5:]
    rec = mine[0]
    assert rec["message"] == "request" and rec["level"] == "info"
    assert rec["model"] == "tiny" and rec["instance"].startswith("tiny")
    assert rec["status"] == 200 and rec["finish"] == "length"
    assert rec["prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert rec["completion_tokens"] == out["usage"]["completion_tokens"] == 4
    assert 0 < rec["ttft_ms"] <= rec["duration_ms"]
    assert any(r["status"] == 400 and r["path"] == "/v1/chat/completions" for r in reqs)
    audit = [r for r in records if r.get("logger") == "pantheon.audit"]
    assert any(
        r["action"] == "models/load"
        and r.get("path") == "/no/such/x"
        and r.get("name") == "x"
        and r["status"] == 404
        for r in audit
    ), audit
