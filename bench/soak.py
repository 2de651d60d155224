"""Soak: minutes of mixed load on a real model, then an audit for leaks, restarts and memory.

    python bench/soak.py                      # 3 minutes on SmolLM2 (the default model)
    python bench/soak.py --minutes 20 --second ''   # the worker's RSS over a long run, no reloads
    python bench/soak.py --minutes 2 --clients 6
    python bench/soak.py --model DIR_OR_GGUF --second qwen3-0.6b

One ``pantheon serve`` subprocess on one CPU die serves the main model; ``--clients`` client
tasks loop over a mix of requests until the time is up (prompts of varied length, so the
steps see many shapes):

* ``stream``: a streamed chat answer of up to 64 tokens, read to the end;
* ``cancel``: a stream the client drops after 0-8 tokens (0: while its prompt is prefilled; its
  slot must come back);
* ``long``: a prompt of ~``--long-tokens`` tokens, streamed, 16 tokens out (the prefill that
  must not stall everyone else's decoding);
* ``plain``: a non-streamed answer;
* ``json``: a JSON Schema answer (``response_format``), one of ``SCHEMAS`` schemas (more than the
  worker's compiled-grammar cache holds), streamed or not;
* ``tools``: a required call of one of ``TOOL_NAMES`` tools, streamed or not;

and one more task loads a second model (``--second``: a preset written once, the tiny one by
default), sends it a request and unloads it again, every ``--reload-every`` seconds.

Printed at the end: requests by kind and outcome (HTTP status / error code), inter-token
latency p50/p99 of the streams, split into gaps that overlapped a long prompt's prefill and
gaps that did not, and the audit once the server is idle again: busy slots, KV blocks held by
requests (not by the prefix cache), queue depth (all must be 0) and worker deaths and restarts
(must be 0: nothing here injects faults).

Memory (``bench/rss.py``): every ``--sample-every`` seconds the router's and each worker's RSS
(and its anonymous part), printed as a table with the growth per 1000 requests after the
warm-up, and once more when the server is idle after the audit. The reload task loads a second
model into the same worker, so pass ``--second ''`` for a worker figure that is the main
model's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import rss  # noqa: E402
from bench.serve import pct  # noqa: E402
from workers.native_memory import TRIM_EVERY_S  # noqa: E402

WORDS = (
    "the lighthouse keeper watched the grey sea roll in under a low sky while gulls "
    "circled the rocks and the lamp turned slowly above the harbour"
).split()
KINDS = (
    ("stream", 0.30),
    ("cancel", 0.15),
    ("long", 0.08),
    ("plain", 0.15),
    ("json", 0.16),
    ("tools", 0.16),
)
SCHEMAS = 96  # distinct JSON schemas (workers/grammar.py keeps 64 compiled)
TOOL_NAMES = 24  # distinct tool names (each tool set is a grammar of its own)


def schema(i: int) -> dict:
    """The ``i``-th JSON schema: same shape, its own property names."""
    return {
        "type": "object",
        "properties": {f"city_{i}": {"type": "string", "maxLength": 12}, f"n_{i}": {"type": "integer"}},
        "required": [f"city_{i}", f"n_{i}"],
        "additionalProperties": False,
    }


def tool(i: int) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"lookup_{i}",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "maxLength": 16}},
                "required": ["word"],
            },
        },
    }


class Soak:
    def __init__(self, args):
        self.args = args
        self.outcomes: collections.Counter = collections.Counter()  # (kind, outcome)
        self.gaps_quiet: list[float] = []  # inter-token gaps with no long prompt in prefill
        self.gaps_prefill: list[float] = []  # ... while one was prefilling
        self.prefilling = 0  # long prompts sent that have not had their first token yet
        self.prefill_spans: list[tuple[float, float]] = []
        self.reloads = 0
        self.finished = 0  # client requests ended, any outcome (the RSS table's x axis)
        self.stop_at = 0.0
        self.sampler: rss.Sampler | None = None

    # ---------------------------------------------------------------- one request

    def body(self, kind: str, rnd: random.Random) -> dict:
        if kind == "long":
            text = " ".join(rnd.choice(WORDS) for _ in range(self.args.long_tokens))
            msgs = [{"role": "user", "content": f"Summarise this in one line: {text}"}]
            return {"model": "main", "messages": msgs, "max_tokens": 16, "stream": True}
        # prompt lengths from a few words to a few hundred, so steps see many shapes
        words = rnd.choice((0, 0, 8, 40, 150, 400))
        extra = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(words // 2, words))) if words else ""
        msgs = [
            {
                "role": "user",
                "content": f"{extra} Tell me about {rnd.choice(WORDS)} number {rnd.randrange(1000)}.",
            }
        ]
        body = {
            "model": "main",
            "messages": msgs,
            "max_tokens": 64,
            "stream": kind not in ("plain", "json", "tools") or rnd.random() < 0.5,
            "temperature": 0.8,
            "seed": rnd.randrange(1 << 30),
        }
        if kind == "json":
            i = rnd.randrange(SCHEMAS)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema(i)},
            }
        elif kind == "tools":
            first = rnd.randrange(TOOL_NAMES)
            body["tools"] = [tool(first), tool((first + 1) % TOOL_NAMES)]
            body["tool_choice"] = "required"
        return body

    async def one(self, client: httpx.AsyncClient, url: str, kind: str, rnd: random.Random) -> str:
        body = self.body(kind, rnd)
        if not body["stream"]:
            r = await client.post(url + "/v1/chat/completions", json=body)
            return str(r.status_code) if r.status_code == 200 else _code(r.status_code, r.text)
        cancel_after = rnd.randint(0, 8) if kind == "cancel" else -1
        stamps: list[float] = []
        sent = time.perf_counter()
        if kind == "long":
            self.prefilling += 1
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return _code(r.status_code, (await r.aread()).decode(errors="replace"))
                if cancel_after == 0:
                    return "cancelled"  # before the first token: while the prompt is prefilled
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        return "stream:" + (ev["error"].get("code") or "?")
                    delta = ev["choices"][0].get("delta", {}) if ev.get("choices") else {}
                    if not (
                        delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                    ):
                        continue  # the role chunk, the finish chunk: no token in them
                    now = time.perf_counter()
                    if kind == "long" and not stamps:
                        self.prefilling -= 1
                        self.prefill_spans.append((sent, now))
                    if stamps:
                        (self.gaps_prefill if self.prefilling else self.gaps_quiet).append(now - stamps[-1])
                    stamps.append(now)
                    if 0 < cancel_after <= len(stamps):
                        return "cancelled"  # leaving the block closes the connection
            return "200"
        finally:
            if kind == "long" and not stamps:
                self.prefilling -= 1

    async def client_loop(self, url: str, seed: int) -> None:
        rnd = random.Random(seed)
        names, weights = zip(*KINDS)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            while time.monotonic() < self.stop_at:
                kind = rnd.choices(names, weights)[0]
                try:
                    out = await self.one(client, url, kind, rnd)
                except httpx.HTTPError as e:
                    out = f"client:{type(e).__name__}"
                self.outcomes[(kind, out)] += 1
                self.finished += 1

    async def reload_loop(self, url: str, second: Path) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() + self.args.reload_every < self.stop_at:
                await asyncio.sleep(self.args.reload_every / 2)
                r = await client.post(
                    url + "/admin/models/load", json={"path": str(second), "name": "second"}
                )
                out = str(r.status_code) if r.status_code == 200 else _code(r.status_code, r.text)
                if r.status_code == 200:
                    q = await client.post(
                        url + "/v1/chat/completions",
                        json={
                            "model": "second",
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 8,
                        },
                    )
                    self.outcomes[("second", str(q.status_code))] += 1
                    await asyncio.sleep(self.args.reload_every / 2)
                    u = await client.post(url + "/admin/models/unload", json={"name": "second"})
                    out = "200" if u.status_code == 200 else _code(u.status_code, u.text)
                    self.reloads += 1
                self.outcomes[("load/unload", out)] += 1

    async def run(self, url: str, second: Path | None, router_pid: int) -> None:
        self.stop_at = time.monotonic() + self.args.minutes * 60
        self.sampler = rss.Sampler(url, router_pid, self.args.sample_every, lambda: self.finished)
        tasks = [self.client_loop(url, i) for i in range(self.args.clients)]
        tasks.append(self.sampler.run(self.stop_at))
        if second is not None:
            tasks.append(self.reload_loop(url, second))
        await asyncio.gather(*tasks)


def _code(status: int, text: str) -> str:
    try:
        return f"{status}:{json.loads(text)['error'].get('code') or ''}"
    except (ValueError, KeyError, TypeError):
        return str(status)


# -------------------------------------------------------------------- the server and the audit


def start_server(model: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "pantheon",
        "serve",
        "--model",
        str(model),
        "--name",
        "main",
        "--cpu-dies",
        "1",
        "--port",
        str(port),
        *args.serve_args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not come up; see {log}")


def audit(url: str) -> dict:
    """Once idle: what requests still hold (must be nothing) and what the workers went through."""
    deadline = time.monotonic() + 30
    while True:
        st = httpx.get(url + "/admin/state", timeout=10).json()
        busy = sum(1 for i in st["instances"] for s in i["slots"] if s["state"] != "idle")
        held = sum(i.get("kv_blocks_held", 0) for i in st["instances"])
        queued = sum(q["depth"] for q in st["queues"])
        if (busy, held, queued) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    dies = httpx.get(url + "/admin/dies", timeout=10).json()["data"]
    return {
        "busy_slots": busy,
        "kv_blocks_held": held,
        "queued": queued,
        "worker_restarts": sum(d.get("restarts", 0) for d in dies),
        "worker_deaths": sum(d.get("deaths", 0) for d in dies),
        "step_budget": [i.get("prefill_budget") for i in st["instances"]],
    }


def second_model(name: str) -> Path:
    from pantheon.serve import cache_dir

    out = cache_dir() / "models" / name
    if not (out / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "pantheon", "make-model", "--preset", name, "--out", str(out)],
            check=True,
            cwd=ROOT,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model folder or GGUF file (default: SmolLM2, else tiny)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=1500, help="words in a long prompt")
    ap.add_argument("--second", default="tiny", help="preset loaded and unloaded ('' for none)")
    ap.add_argument("--reload-every", type=float, default=60.0, help="seconds per load/unload")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument(
        "--warmup", type=float, default=1 / 3, help="share of the run left out of the RSS growth fit"
    )
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("serve_args", nargs="*", help="more `pantheon serve` flags (after --)")
    args = ap.parse_args()

    from pantheon.serve import default_model

    model = Path(args.model) if args.model else default_model()[0]
    second = second_model(args.second) if args.second else None
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-soak-server.log"
    proc, url = start_server(model, args, log)
    soak = Soak(args)
    t0 = time.monotonic()
    try:
        asyncio.run(soak.run(url, second, proc.pid))
        wall = time.monotonic() - t0
        result = audit(url)
        assert soak.sampler is not None
        time.sleep(TRIM_EVERY_S + 1)  # idle: the worker has handed its freed heap back
        idle = asyncio.run(soak.sampler.sample(keep=False))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    served = sum(n for (k, o), n in soak.outcomes.items() if o in ("200", "cancelled"))
    result.update(
        {
            "model": str(model),
            "minutes": round(wall / 60, 2),
            "clients": args.clients,
            "requests": sum(soak.outcomes.values()),
            "served": served,
            "reloads": soak.reloads,
            "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
            "itl_quiet_p50_ms": 1e3 * pct(soak.gaps_quiet, 50),
            "itl_quiet_p99_ms": 1e3 * pct(soak.gaps_quiet, 99),
            "itl_prefill_p50_ms": 1e3 * pct(soak.gaps_prefill, 50),
            "itl_prefill_p99_ms": 1e3 * pct(soak.gaps_prefill, 99),
            "long_ttft_p50_s": pct([b - a for a, b in soak.prefill_spans], 50),
            "gaps": [len(soak.gaps_quiet), len(soak.gaps_prefill)],
        }
    )
    print(f"soak: {result['minutes']} min, {args.clients} clients on {model.name}")
    print(f"  requests {result['requests']}, served {served}, load/unload cycles {soak.reloads}")
    for key, n in result["outcomes"].items():
        print(f"    {key:<28} {n}")
    print(
        f"  inter-token p50/p99: {result['itl_quiet_p50_ms']:.0f} / "
        f"{result['itl_quiet_p99_ms']:.0f} ms without a long prefill, "
        f"{result['itl_prefill_p50_ms']:.0f} / {result['itl_prefill_p99_ms']:.0f} ms during one "
        f"({result['gaps'][0]} / {result['gaps'][1]} gaps)"
    )
    print(
        f"  long prompt TTFT p50: {result['long_ttft_p50_s']:.2f} s; "
        f"step prefill budget now {result['step_budget']}"
    )
    print(
        f"  leaks: busy slots {result['busy_slots']}, KV blocks held {result['kv_blocks_held']}, "
        f"queued {result['queued']} (all must be 0)"
    )
    print(f"  worker deaths {result['worker_deaths']}, restarts {result['worker_restarts']} (must be 0)")
    samples = soak.sampler.samples
    print(
        "  memory, MiB resident (anonymous); 'idle': once the audit found the server idle, "
        f"{idle.t - samples[-1].t:.0f} s after the last sample"
    )
    print("    " + rss.table(samples, args.warmup, idle).replace("\n", "\n    "))
    result["rss"] = [
        {
            "t": round(x.t, 1),
            "requests": x.requests,
            "router": [x.router.rss, x.router.anon] if x.router else None,
            "workers": {d: [m.rss, m.anon] for d, m in x.workers.items()},
        }
        for x in [*samples, idle]
    ]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    bad = (
        result["busy_slots"]
        or result["kv_blocks_held"]
        or result["queued"]
        or result["worker_restarts"]
        or result["worker_deaths"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
