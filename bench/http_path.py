"""Where one stream's token time goes between the worker's step and the client's socket (issue 28 §3).

    python bench/http_path.py                       # SmolLM2-135M Q4_1 GGUF, 128 tokens, 2 threads
    python bench/http_path.py --tokens 64 --rounds 2 --worker-threads 1
    python bench/http_path.py --serve-arg=--worker-nice=5   # any extra `pantheon serve` flag

One stream, greedy, ``ignore_eos``, ``--tokens`` tokens, eager (``PANTHEON_COMPILE=0``), the same
CPU path on both sides. ``--rounds`` turns, each (a) then (b), so that both see the same host load:

(a) our engine in-process at batch 1 (in this process): decode tok/s of the best round, and the
    median step over every round;
(b) ``pantheon serve`` on the same file and a raw streaming client (httpx, one kept-alive
    connection, SSE parsed by hand): the best round's decode tok/s (first to last content chunk,
    so the prefill and TTFT are out, like (a)) and its gaps p50 / p99, the median inter-token gap
    over every round, and the CPU ms per token of the router, the worker and this client process
    (``/proc/<pid>/stat`` utime + stime around the round);
(c) the same against a second server with ``PANTHEON_DEBUG_TOKEN_TIMES`` set
    (``pantheon/workerlink/token_times.py``): per token of its best round, the worker's step, its
    loop to the next step, step end -> the router's receive of the ``StepOutput`` (send, ZeroMQ,
    the router's wake-up), receive -> the SSE chunk handed to hypercorn, chunk -> this client's
    read; CLOCK_MONOTONIC is one clock for every process on Linux. Medians (p90), and the worker's
    step under HTTP over the in-process step (the steal).

HTTP / in-process is printed two ways: best round over best round, and median step over median
gap (what a host stall moves least). The host's load average is printed beside every figure: on
a shared 2-core host trust ratios within one run.

OpenMP: both sides inherit this environment, so ``OMP_WAIT_POLICY=PASSIVE python
bench/http_path.py`` measures passive waits on both (on a quiet 2-core Xeon: 45 against 86 tok/s
in-process with libgomp's default spin, so the worker keeps the default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import bench_engine, chat_body, default_gguf  # noqa: E402
from bench.pantheon_server import free_port, host_line  # noqa: E402
from pantheon.core.token_times import ENV as TIMES_ENV  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


# ------------------------------------------------------------------ (a) in-process


def engine(model: Path, threads: int):
    """Our engine on ``model`` in this process, eager, with ``threads`` torch threads."""
    import torch

    from workers.engine import Engine

    torch.set_num_threads(threads)
    eng = Engine(str(model), devices=["cpu"], num_slots=8, kv_budget_bytes=256 << 20, compile_decode=False)
    bench_engine(eng, 1, 8, "cpu")  # warm up
    return eng


# ------------------------------------------------------------------ (b) the server and the client


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    worker_pid: int


@contextlib.contextmanager
def server(model: Path, threads: int, extra: list[str], env: dict[str, str], log: Path) -> Iterator[Server]:
    """``pantheon serve --model MODEL`` on loopback, one CPU die; yields it once /health is 200."""
    from bench.peer import stop

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pantheon", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", str(model), "--name", "bench", "--cpu-dies", "1", "--dies", "cpu:0"]
    cmd += ["--slots", "8", "--kv-budget", str(256 << 20), "--worker-threads", str(threads), *extra]
    full_env = {**os.environ, "PANTHEON_COMPILE": "0", "PYTHONPATH": str(ROOT), **env}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=full_env)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"pantheon serve exited {proc.returncode}; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pantheon serve not ready in 300 s; see {log}")
                time.sleep(0.25)
            workers = [
                c.pid
                for c in psutil.Process(proc.pid).children(recursive=True)
                if "workers.worker" in " ".join(c.cmdline())
            ]
            if len(workers) != 1:
                raise RuntimeError(f"expected one worker process under the router, found {workers}")
            yield Server(url, proc, workers[0])
        finally:
            stop(proc, 30)


@dataclass
class Round:
    tokens: int
    events: list[tuple[float, bool]]  # (monotonic read time, has content) per SSE event, [DONE] too
    cpu: dict[str, float]  # seconds during the round: router, worker, client
    began: float
    ended: float

    @property
    def content(self) -> list[float]:
        return [t for t, c in self.events if c]

    @property
    def decode_tok_s(self) -> float:
        c = self.content
        return (len(c) - 1) / (c[-1] - c[0]) if len(c) > 1 and c[-1] > c[0] else float("nan")

    @property
    def gaps_ms(self) -> list[float]:
        c = self.content
        return [1e3 * (b - a) for a, b in zip(c, c[1:])]


def stream_once(client: httpx.Client, srv: Server, tokens: int) -> Round:
    """One streaming chat completion; every SSE event's read time, and the three processes' CPU."""
    body = chat_body("bench", tokens)
    pids = {"router": srv.proc.pid, "worker": srv.worker_pid, "client": os.getpid()}
    before = {k: cpu_s(p) for k, p in pids.items()}
    events: list[tuple[float, bool]] = []
    usage = None
    buf = b""
    began = time.monotonic()
    with client.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for data in r.iter_raw():
            now = time.monotonic()
            buf += data
            *evs, buf = buf.split(b"\n\n")
            for ev in evs:
                payload = ev.strip().removeprefix(b"data:").strip()
                if payload == b"[DONE]":
                    events.append((now, False))
                    continue
                obj = json.loads(payload)
                if obj.get("usage"):
                    usage = obj["usage"]
                delta = (obj.get("choices") or [{}])[0].get("delta") or {}
                events.append((now, bool(delta.get("content") or delta.get("reasoning_content"))))
    ended = time.monotonic()
    cpu = {k: cpu_s(p) - before[k] for k, p in pids.items()}
    n = usage["completion_tokens"] if usage else sum(c for _, c in events)
    return Round(n, events, cpu, began, ended)


def engine_steps(eng, tokens: int) -> list[float]:
    """One batch-1 sequence of ``tokens`` decode steps in-process: each step's seconds (prefill out)."""
    from pantheon.core.protocol import SamplingParams

    eng.submit(
        "r0",
        [(31 * i) % 1000 + 10 for i in range(16)],
        SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True),
    )
    while any(s.num_output == 0 for s in eng.scheduler.running()) or eng.scheduler.waiting:
        eng.step()  # the prefill
    out = []
    while eng.has_work():
        t = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t)
    return out


@dataclass
class Compared:
    inproc_best: float  # tok/s of the fastest in-process round
    inproc_p50_ms: float  # the median in-process step over every round
    http: Round  # the fastest HTTP round
    http_p50_ms: float  # the median inter-token gap over every HTTP round

    def ratios(self) -> str:
        best = self.http.decode_tok_s / self.inproc_best
        return (
            f"{best:.3f}x best round / best round, {self.inproc_p50_ms / self.http_p50_ms:.3f}x by p50 step"
        )


def compare(eng, srv: Server, tokens: int, rounds: int) -> Compared:
    """``rounds`` turns of (in-process batch 1, one HTTP stream), alternating so that both see the
    same host load: the best round of each (noise on a shared host only slows a run down) and the
    medians of every step / gap (a stall of the host moves them least)."""
    inproc: list[list[float]] = []
    runs: list[Round] = []
    with httpx.Client(timeout=600) as client:  # one kept-alive connection, as a chat client holds
        stream_once(client, srv, 8)  # warm up
        for _ in range(rounds):
            inproc.append(engine_steps(eng, tokens))
            runs.append(stream_once(client, srv, tokens))
    for r in runs:
        if r.tokens != tokens:
            print(f"  warning: a round streamed {r.tokens} tokens, not {tokens}")
    return Compared(
        inproc_best=max(len(s) / sum(s) for s in inproc),
        inproc_p50_ms=1e3 * statistics.median(x for s in inproc for x in s),
        http=max(runs, key=lambda r: r.decode_tok_s),
        http_p50_ms=statistics.median(g for r in runs for g in r.gaps_ms),
    )


# ------------------------------------------------------------------ (c) where the gap goes


def read_stamps(folder: Path, role: str) -> list[list[float]]:
    rows: list[list[float]] = []
    for f in folder.glob(f"{role}-*.txt"):
        for line in f.read_text().splitlines():
            kind, *vals = line.split()
            rows.append([{"s": 0.0, "r": 1.0, "w": 2.0}[kind], *map(float, vals)])
    return sorted(rows, key=lambda r: r[1])


def breakdown(folder: Path, rnd: Round) -> dict[str, list[float]]:
    """Per token (ms): the segments from the worker's step to the client's read, matched by order
    (one stream: one StepOutput per step, one client event per chunk the router handed over)."""
    inside = lambda t: rnd.began <= t <= rnd.ended  # noqa: E731
    # stamp (before its send), start, end, n; a step is in the round by its start (its stamp may land after the client's last read)
    steps = [r[1:] for r in read_stamps(folder, "worker") if r[0] == 0 and inside(r[2])]
    rows = [r for r in read_stamps(folder, "router") if inside(r[1])]
    recvs = [r[1] for r in rows if r[0] == 1]
    writes = [r[1] for r in rows if r[0] == 2]
    out: dict[str, list[float]] = {k: [] for k in SEGMENTS}
    if len(steps) != len(recvs) or len(writes) != len(rnd.events):
        print(
            f"  warning: {len(steps)} steps / {len(recvs)} receives, {len(writes)} chunks written / "
            f"{len(rnd.events)} read: the breakdown is unmatched"
        )
        return out
    client_at = dict(zip(writes, (t for t, _ in rnd.events)))
    for k, ((_stamp, start, end, _n), recv) in enumerate(zip(steps, recvs)):
        if k == 0:
            continue  # the prefill step
        out["worker step"].append(1e3 * (end - start))
        if k + 1 < len(steps):
            out["worker loop (step end -> next step)"].append(1e3 * (steps[k + 1][1] - end))
        out["send + zmq hop + router wake (step end -> recv)"].append(1e3 * (recv - end))
        nxt = recvs[k + 1] if k + 1 < len(recvs) else float("inf")
        w = next((w for w in writes if recv <= w < nxt), None)
        if w is None:
            continue  # a token with no text yet (the detokenizer holds it back)
        out["router (recv -> chunk to hypercorn)"].append(1e3 * (w - recv))
        out["hypercorn + socket + client (chunk -> read)"].append(1e3 * (client_at[w] - w))
        out["step end -> client read"].append(1e3 * (client_at[w] - end))
    return out


SEGMENTS = (
    "worker step",
    "worker loop (step end -> next step)",
    "send + zmq hop + router wake (step end -> recv)",
    "router (recv -> chunk to hypercorn)",
    "hypercorn + socket + client (chunk -> read)",
    "step end -> client read",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file or model folder (default: SmolLM2-135M Q4_1 GGUF)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in-process (default 2)")
    ap.add_argument("--worker-threads", type=int, default=None, help="the server's (default: --threads)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `pantheon serve` argument")
    ap.add_argument("--cpu-path", help="PANTHEON_CPU_PATH for both sides (default: the load's choice)")
    ap.add_argument("--no-trace", action="store_true", help="skip (c)")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_gguf()
    wthreads = args.worker_threads or args.threads
    print(f"host: {host_line()}; model {model.name}; {args.tokens} tokens, greedy, eager", flush=True)

    if args.cpu_path:
        os.environ["PANTHEON_CPU_PATH"] = args.cpu_path
    eng = engine(model, args.threads)
    # the server runs the CPU path the load chose here (on a busy host two loads' timings can differ)
    chosen: str | None = getattr(eng, "cpu_path", None)
    if chosen:
        os.environ["PANTHEON_CPU_PATH"] = chosen
    omp = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    print(f"CPU path {os.environ.get('PANTHEON_CPU_PATH', '-')}; OpenMP {omp or 'default'}", flush=True)
    log = Path(tempfile.gettempdir()) / "bench-http-path.log"
    with server(model, wthreads, args.serve_arg, {}, log) as srv:
        c = compare(eng, srv, args.tokens, args.rounds)
    r = c.http
    print(
        f"(a) in-process, batch 1, {args.threads} threads: {c.inproc_best:.1f} tok/s best round, "
        f"step p50 {c.inproc_p50_ms:.2f} ms  [load {load()}]"
    )
    gaps = r.gaps_ms
    per_tok = {k: 1e3 * v / r.tokens for k, v in r.cpu.items()}
    print(
        f"(b) HTTP, 1 stream, worker threads {wthreads} {' '.join(args.serve_arg)}: {r.decode_tok_s:.1f} tok/s "
        f"best round (first to last chunk; its gaps p50 {pct(gaps, 50):.2f} ms, p99 {pct(gaps, 99):.2f} ms), "
        f"gap p50 of all rounds {c.http_p50_ms:.2f} ms; CPU ms/token: router {per_tok['router']:.2f}, "
        f"worker {per_tok['worker']:.2f}, client {per_tok['client']:.2f}  [load {load()}]"
    )
    print(f"    HTTP / in-process: {c.ratios()}", flush=True)

    if not args.no_trace:
        with tempfile.TemporaryDirectory() as d:
            with server(model, wthreads, args.serve_arg, {TIMES_ENV: d}, log) as srv:
                c2 = compare(eng, srv, args.tokens, args.rounds)
            segs = breakdown(Path(d), c2.http)
        print(f"(c) traced run: {c2.ratios()}; its best HTTP round per token, ms p50 (p90)  [load {load()}]")
        for k in SEGMENTS:
            xs = segs[k]
            if xs:
                print(f"    {k:<48} {statistics.median(xs):7.3f} ({pct(xs, 90):7.3f})  n={len(xs)}")
        if segs["worker step"]:
            steal = statistics.median(segs["worker step"]) / c2.inproc_p50_ms
            print(f"    worker step p50 under HTTP / in-process step p50: {steal:.3f}x")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
