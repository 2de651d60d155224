"""``GET /metrics``: Prometheus text from a per-app ``CollectorRegistry`` (never the global one, so
several apps in one process do not clash).

The series vLLM exports, with vLLM's names, types and buckets, labelled by ``model_name``, so
dashboards and gateways made for vLLM work unchanged:

- gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0..1, KV blocks in use over the pool, from the workers' Stats), and the info gauge
  ``vllm:cache_config_info`` (``block_size``, ``num_gpu_blocks``);
- counters ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (prompt tokens
  looked up in and found in the prefix cache, from the workers' Stats);
- counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` (tokens the clients
  received), ``vllm:request_success_total`` (with ``finished_reason``);
- histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``.

Plus ``pantheon_*``: per die (memory total, free, booked, and of the booked bytes the weights,
the KV cache and the recurrent state pools apart, pressure level, alive), per instance (in
flight, running, ready, restarts, KV cache and state pool bytes), per queue (depth, wait time), 429 and 503 counts per
model, loads, load failures and unloads per model, worker deaths per die, admin actions per
action and status; and the router's request-body bytes in flight
(``pantheon_body_bytes_in_flight``, bounded by ``--max-body-in-flight``).

Gauges are read from the registry, the pool and the die manager when scraped; counters and
histograms are fed at the end of each request (``observe``), by the admin feed's events (loads,
unloads) and by the supervisor (worker deaths).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pantheon.logs import RequestTrace

if TYPE_CHECKING:
    from pantheon.control.live import Projection
    from pantheon.control.registry import Registry


class LiveState(Protocol):
    """What the gauges read at scrape time (``pantheon.api.state.LiveView``): metrics imports
    neither the state nor the middleware that feed it."""

    @property
    def registry(self) -> Registry: ...
    def project(self) -> Projection: ...


class BodyCount(Protocol):
    """The request-body bytes in flight (``pantheon.api.inflight.BodyBudget``)."""

    @property
    def in_flight(self) -> int: ...


# vLLM's buckets (vllm/v1/metrics/loggers.py), so percentiles line up across servers.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class _ModelSums:
    """One model's figures over its instances, for vLLM's per-model series."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0  # KV blocks
    kv_total: int = 0
    block_size: int = 0
    hit_tokens: int = 0  # prefix cache, since each instance's load
    query_tokens: int = 0


class _Live:
    """The collector of the gauges, read from the app's state at scrape time."""

    def __init__(self, state: LiveState, metrics: Metrics):
        self.state, self.metrics = state, metrics

    def describe(self):
        return []

    def collect(self):
        held = GaugeMetricFamily(
            "pantheon_body_bytes_in_flight",
            "Request-body bytes the router holds (received, not yet parsed).",
            value=self.metrics.bodies.in_flight,
        )
        yield held
        live = self.state.project()
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests running on a slot.", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting for a slot.", labels=["model_name"]
        )
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.", labels=["model_name"]
        )
        # vLLM's info series of its KV cache (what the endpoint picker's --cache-info-metric
        # names) and its prefix-cache counters, in tokens; per model here (vLLM has one model per
        # server). The counters restart when an instance is reloaded, as a counter may.
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration.",
            labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=["model_name"]
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=["model_name"]
        )
        depth = GaugeMetricFamily(
            "pantheon_queue_depth", "Requests waiting in the model's queue.", labels=["model_name"]
        )
        per_model: dict[str, _ModelSums] = {}
        i_flight = GaugeMetricFamily(
            "pantheon_instance_in_flight", "Requests holding the instance.", labels=["model_name", "instance"]
        )
        i_run = GaugeMetricFamily(
            "pantheon_instance_running",
            "Requests on the instance's slots.",
            labels=["model_name", "instance"],
        )
        i_ready = GaugeMetricFamily(
            "pantheon_instance_ready",
            "1 when the instance serves.",
            labels=["model_name", "instance", "state"],
        )
        i_restarts = GaugeMetricFamily(
            "pantheon_instance_restarts",
            "Times the instance was reloaded after its worker died.",
            labels=["model_name", "instance"],
        )
        i_kv = GaugeMetricFamily(
            "pantheon_instance_kv_cache_bytes",
            "The instance's KV cache pool, booked over its dies.",
            labels=["model_name", "instance"],
        )
        i_state = GaugeMetricFamily(
            "pantheon_instance_state_bytes",
            "The instance's recurrent-state pools (hybrid models; 0 for others), booked over its dies.",
            labels=["model_name", "instance"],
        )
        for f in live.instances:
            inst, es = f.inst, f.engine
            info = inst.info()
            run = int(info.get("running", 0))
            acc = per_model.setdefault(inst.name, _ModelSums())
            acc.running += run
            if es is not None and es.kv_blocks_total:
                acc.kv_used += es.kv_blocks_used
                acc.kv_total += es.kv_blocks_total
                acc.block_size = es.block_size
                acc.hit_tokens += es.cache_hit_blocks * es.block_size
                acc.query_tokens += es.cache_query_blocks * es.block_size
            labels = [inst.name, inst.instance_id]
            i_flight.add_metric(labels, info.get("in_flight", 0))
            i_run.add_metric(labels, run)
            state = str(info.get("state", ""))
            i_ready.add_metric(labels + [state], 1.0 if state == "ready" else 0.0)
            i_restarts.add_metric(labels, info.get("restarts", 0) or 0)
            i_kv.add_metric(labels, f.kv_bytes)
            i_state.add_metric(labels, f.state_bytes)
        for name, q in live.queues.items():  # requests wait per model, for any of its replicas
            if name in per_model:
                per_model[name].waiting = len(q)
        for name, m in per_model.items():
            running.add_metric([name], m.running)
            waiting.add_metric([name], m.waiting)
            depth.add_metric([name], m.waiting)
            kv.add_metric([name], m.kv_used / m.kv_total if m.kv_total else 0.0)
            if m.kv_total:  # known once a worker reported the instance
                cache_info.add_metric([name, str(m.block_size), str(m.kv_total), "True"], 1.0)
            queries.add_metric([name], m.query_tokens)
            hits.add_metric([name], m.hit_tokens)
        yield from (running, waiting, kv, cache_info, queries, hits)
        yield from (depth, i_flight, i_run, i_ready, i_restarts, i_kv, i_state)
        yield from self._dies(live)

    def _dies(self, live: Projection):
        total = GaugeMetricFamily("pantheon_die_memory_total_bytes", "Die memory.", labels=["die"])
        free = GaugeMetricFamily(
            "pantheon_die_memory_free_bytes", "Die memory free, as the worker measures it.", labels=["die"]
        )
        booked = GaugeMetricFamily(
            "pantheon_die_memory_booked_bytes",
            "Die memory booked by instances (weights, KV cache and recurrent state).",
            labels=["die"],
        )
        # what the booked bytes are, apart
        b_weights = GaugeMetricFamily(
            "pantheon_die_memory_weights_bytes", "Die memory booked by weights.", labels=["die"]
        )
        b_kv = GaugeMetricFamily(
            "pantheon_die_memory_kv_cache_bytes", "Die memory booked by KV cache pools.", labels=["die"]
        )
        b_state = GaugeMetricFamily(
            "pantheon_die_memory_state_bytes",
            "Die memory booked by recurrent-state pools (hybrid models).",
            labels=["die"],
        )
        pressure = GaugeMetricFamily(
            "pantheon_die_pressure_level", "Memory pressure, 0 normal to 3 critical.", labels=["die"]
        )
        alive = GaugeMetricFamily("pantheon_die_alive", "1 when the die's worker is up.", labels=["die"])
        restarts = GaugeMetricFamily(
            "pantheon_worker_restarts",
            "Times the die's worker was started again after it died.",
            labels=["die"],
        )
        died_at = GaugeMetricFamily(
            "pantheon_worker_last_death_timestamp_seconds",
            "Unix time of the die's latest worker death (the reason is in /admin/dies).",
            labels=["die"],
        )
        turn = GaugeMetricFamily(
            "pantheon_worker_step_running_seconds",
            "How long the worker's current step has run (0 when idle), from its heartbeat.",
            labels=["die"],
        )
        facts = {f.die.id: f for f in live.dies}
        for d in live.workers:
            total.add_metric([d.die], d.total_bytes)
            free.add_metric([d.die], d.free_bytes)
            alive.add_metric([d.die], 1.0 if d.alive else 0.0)
            restarts.add_metric([d.die], getattr(d, "restarts", 0))
            if getattr(d, "last_death_at", None) is not None:
                died_at.add_metric([d.die], d.last_death_at)
            beat = getattr(d, "beat", None)
            turn.add_metric([d.die], beat.turn_s if beat is not None and d.alive else 0.0)
            f = facts.get(d.die)  # a worker's die the die manager does not know: measured only
            booked.add_metric(
                [d.die], f.die.used_bytes if f is not None else max(0, d.total_bytes - d.free_bytes)
            )
            if f is not None:
                pressure.add_metric([d.die], f.pressure)
                b_weights.add_metric([d.die], f.die.weights_bytes)
                b_kv.add_metric([d.die], f.die.kv_bytes)
                b_state.add_metric([d.die], f.die.state_bytes)
        yield from (total, free, booked, b_weights, b_kv, b_state, pressure, alive, restarts, died_at, turn)


class Metrics:
    """The app's metrics: ``render()`` for the route, ``observe()`` per finished request."""

    def __init__(self, state: LiveState, bodies: BodyCount):
        self.state, self.bodies = state, bodies
        r = self.registry = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens sent.", m, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests.", m + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", m, buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, end to end.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time waiting for a slot.", m, buckets=E2E_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "pantheon_queue_wait_seconds", "Time waiting for a slot.", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.rejected = Counter(
            "pantheon_requests_rejected", "Requests refused with 429 or 503.", m + ["status"], registry=r
        )
        self.errors = Counter(
            "pantheon_request_errors", "Requests that ended with an error.", m + ["code"], registry=r
        )
        self.loads = Counter("pantheon_model_loads", "Instances that became ready.", m, registry=r)
        self.load_failures = Counter("pantheon_model_load_failures", "Loads that failed.", m, registry=r)
        self.unloads = Counter("pantheon_model_unloads", "Instances unloaded.", m, registry=r)
        self.worker_deaths = Counter("pantheon_worker_deaths", "Workers that died.", ["die"], registry=r)
        self.admin_actions = Counter(
            "pantheon_admin_actions", "Admin API calls.", ["action", "status"], registry=r
        )
        r.register(_Live(state, self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _known(self, name: str | None) -> str:
        """A label value for ``name``: only served names, so clients cannot mint series."""
        if name and any(i.name == name for i in self.state.registry.instances()):
            return name
        return ""

    def itl_observer(self, model: str):
        return self.itl.labels(model).observe

    def observe(self, trace: RequestTrace, duration_s: float) -> None:
        """Account one finished HTTP request."""
        if trace.path.startswith("/admin/") and trace.method == "POST":
            action = trace.path.removeprefix("/admin/")
            if len(action) > 40 or not re.fullmatch(r"[a-z_]+(/[a-z_]+)*", action):
                action = "other"  # ids and typos do not mint series
            self.admin_actions.labels(action, str(trace.status)).inc()
            return
        if trace.status in (429, 503):
            self.rejected.labels(self._known(trace.model), str(trace.status)).inc()
        if trace.gen is None:
            return
        model = trace.model or ""
        self.prompt_tokens.labels(model).inc(trace.prompt_tokens)
        self.generation_tokens.labels(model).inc(trace.completion_tokens())
        if trace.ttft_s is not None:
            self.ttft.labels(model).observe(trace.ttft_s)
        if trace.queue_wait_s is not None:
            self.queue_wait.labels(model).observe(trace.queue_wait_s)
            self.queue_time.labels(model).observe(trace.queue_wait_s)
        self.e2e.labels(model).observe(duration_s)
        if trace.error is not None or (trace.status or 200) >= 400:
            code = getattr(trace.error, "code", None) or str(trace.status)
            self.errors.labels(model, code).inc()
            self.success.labels(model, "abort").inc()
        else:
            for reason in trace.finish_reasons():
                self.success.labels(model, reason).inc()

    def feed_event(self, kind: str, model: str | None, message: str = "") -> None:
        """From the admin feed: loaded | load_failed | unloaded (others are ignored; worker
        deaths and restarts come from the supervisor)."""
        if kind == "loaded":
            self.loads.labels(model or "").inc()
        elif kind == "load_failed":
            self.load_failures.labels(model or "").inc()
        elif kind == "unloaded":
            self.unloads.labels(model or "").inc()

    def worker_died(self, die: str) -> None:
        self.worker_deaths.labels(die).inc()
