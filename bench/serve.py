"""Serving overhead: streaming through ``pantheon serve`` over HTTP against the engine alone.

    python bench/serve.py                                  # tiny preset, CPU die
    python bench/serve.py --preset qwen3-0.6b --device cuda:0 --tokens 128
    python bench/serve.py --model DIR --clients 8 --streams 64 --json out.json

1. engine: ``workers.engine.Engine`` in this process, ``--clients`` requests submitted at once,
   stepped until done (no HTTP, no zmq, no detokenizing);
2. http: a real ``pantheon serve`` subprocess on the same model and device, ``--clients``
   concurrent streaming clients (raw SSE over httpx), same prompt, seeded sampling at
   temperature 1 (client i: seed i, both ways), ``ignore_eos``;
   aggregate tokens/s both ways and their ratio (target >= 0.9), TTFT and inter-token latency
   p50/p99 (inter-token: gaps between content chunks divided by the tokens each carried);
3. router CPU: the tiny model at ``--streams`` concurrent streams; the router process's own CPU
   time (psutil, user + system, children excluded) per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    sets = list(getattr(args, "set", None) or [])
    name = args.preset + "".join("-" + x.replace("=", "") for x in sets)
    out = Path(os.environ.get("PANTHEON_CACHE_DIR", Path.home() / ".cache" / "pantheon")) / "models" / name
    if not (out / "config.json").exists():
        print(f"writing the {args.preset} preset to {out} ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pantheon",
                "make-model",
                "--preset",
                args.preset,
                "--out",
                str(out),
                *[a for x in sets for a in ("--set", x)],
            ],
            check=True,
            cwd=ROOT,
        )
    return out


def prompt_ids(path: Path) -> list[int]:
    """The ids the router sends for MESSAGES: the same prompt both ways."""
    from pantheon.control.registry import ModelAssets

    a = ModelAssets(path)
    return a.encode(a.template.render(MESSAGES, add_generation_prompt=True))


def summary(name: str, tokens: int, wall: float, ttft: list[float], itl: list[float]) -> dict:
    return {
        "name": name,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
    }


# ---------------------------------------------------------------- 1. the engine alone


def bench_engine(path: Path, args) -> dict:
    import torch

    from pantheon.core.protocol import SamplingParams
    from workers.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)

    eng = Engine(
        str(path),
        devices=[args.device],
        num_slots=max(args.clients, 8),
        kv_budget_bytes=args.kv_budget,
        compile_decode=False,
    )
    ids = prompt_ids(path)
    best = None
    for rnd in range(args.rounds + 1):  # round 0 warms up every batch shape
        n_tok = 8 if rnd == 0 else args.tokens
        t0 = time.perf_counter()
        for i in range(args.clients):
            eng.submit(
                f"r{rnd}-{i}", ids, SamplingParams(temperature=1.0, seed=i, max_tokens=n_tok, ignore_eos=True)
            )
        times: dict[str, list[float]] = {f"r{rnd}-{i}": [] for i in range(args.clients)}
        while eng.has_work():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                times[o.request_id].append(now)
        wall = time.perf_counter() - t0
        if rnd and (best is None or wall < best[0]):
            best = (wall, t0, times)
    wall, t0, times = best
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in times.values())
    ttft = [v[0] - t0 for v in times.values()]
    itl = [b - a for v in times.values() for a, b in zip(v, v[1:])]
    eng.close()
    del eng
    gc.collect()
    return summary("engine", tokens, wall, ttft, itl)


# ---------------------------------------------------------------- 2. through HTTP


class Server:
    def __init__(self, path: Path, args, slots: int, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        die = ["--cpu-dies", "1", "--dies", "cpu:0"] if args.device == "cpu" else ["--dies", args.device]
        cmd = [
            sys.executable,
            "-m",
            "pantheon",
            "serve",
            "--model",
            str(path),
            "--name",
            "bench",
            *die,
            "--port",
            str(self.port),
            "--slots",
            str(slots),
            "--queue-depth",
            str(slots),
            "--kv-budget",
            str(args.kv_budget),
        ]
        if args.threads:
            cmd += ["--worker-threads", str(args.threads)]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise SystemExit(f"server not ready; see {log}")
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int, t0: float, seed: int = 0) -> dict:
    body = {
        "model": "bench",
        "messages": MESSAGES,
        "max_tokens": tokens,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps: list[float] = []
    usage = None
    buf = b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for data in r.aiter_raw():  # a light reader: the client shares the CPU too
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if b'"error"' in ev[:16]:
                    raise RuntimeError(ev.decode())
                if b'"choices":[]' in ev:
                    usage = json.loads(ev[6:])["usage"]
                elif (
                    (b'"delta":{"content":"' in ev and b'"content":""' not in ev)
                    or b'"reasoning_content"' in ev
                    or b'"tool_calls"' in ev
                ):
                    stamps.append(now)
    return {"stamps": stamps, "tokens": usage["completion_tokens"] if usage else len(stamps), "start": t0}


async def run_clients(
    url: str, n: int, tokens: int, rounds: int = 1, warm: bool = True
) -> tuple[list[dict], float]:
    """``rounds`` measured rounds of ``n`` concurrent streams (after a short warm-up round
    unless ``warm`` is False); returns the fastest round."""
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    best = None
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for rnd in range(0 if warm else 1, rounds + 1):
            n_tok = 8 if rnd == 0 else tokens
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one_stream(client, url, n_tok, t0, i) for i in range(n)))
            wall = time.perf_counter() - t0
            if rnd and (best is None or wall < best[1]):
                best = (res, wall)
    return best


def http_summary(res: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in res)
    ttft = [r["stamps"][0] - r["start"] for r in res if r["stamps"]]
    per_chunk = []
    for r in res:
        s = r["stamps"]
        if len(s) > 1:  # spread each gap over the tokens the chunks carried
            k = max(1.0, (r["tokens"] - 1) / (len(s) - 1))
            per_chunk += [(b - a) / k for a, b in zip(s, s[1:])]
    return summary("http", tokens, wall, ttft, per_chunk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the --preset, written once)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="make-model override for the preset, e.g. vocab_size=4032 so that a "
        "big preset's random tokens all decode to text (repeatable)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--streams", type=int, default=64, help="streams for the router CPU figure")
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, for the in-process engine and the worker alike",
    )
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (best one kept)")
    ap.add_argument("--kv-budget", type=int, default=256 << 20)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    path = model_dir(args)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    out: dict = {"model": str(path), "device": args.device, "clients": args.clients, "tokens": args.tokens}

    if not args.skip_engine:
        out["engine"] = bench_engine(path, args)
        print_row(out["engine"])
    slots = max(args.clients, 8)
    srv = Server(path, args, slots, logs / "bench-serve-http.log")
    try:
        res, wall = asyncio.run(run_clients(srv.url, args.clients, args.tokens, args.rounds))
        out["http"] = http_summary(res, wall)
        print_row(out["http"])
    finally:
        srv.stop()
    if "engine" in out:
        out["ratio"] = out["http"]["tok_s"] / out["engine"]["tok_s"]
        print(f"http / engine tokens/s: {out['ratio']:.3f} (target >= 0.9)")

    if not args.skip_cpu:
        tiny_args = argparse.Namespace(
            **{**vars(args), "model": None, "preset": "tiny", "device": "cpu", "set": None}
        )
        tiny = model_dir(tiny_args)
        srv = Server(tiny, tiny_args, args.streams, logs / "bench-serve-cpu.log")
        try:
            asyncio.run(run_clients(srv.url, args.streams, 4))
            c0 = srv.cpu()
            res, wall = asyncio.run(run_clients(srv.url, args.streams, args.stream_tokens, warm=False))
            c1 = srv.cpu()
        finally:
            srv.stop()
        tokens = sum(r["tokens"] for r in res)
        chunks = sum(len(r["stamps"]) for r in res)
        out["router_cpu"] = {
            "streams": args.streams,
            "tokens": tokens,
            "chunks": chunks,
            "cpu_s": c1 - c0,
            "wall_s": wall,
            "us_per_token": 1e6 * (c1 - c0) / max(tokens, 1),
            "tok_s": tokens / wall,
        }
        rc = out["router_cpu"]
        print(
            f"router CPU at {rc['streams']} streams (tiny, cpu): {rc['us_per_token']:.0f} us "
            f"per streamed token ({rc['cpu_s']:.2f} s CPU for {tokens} tokens in {chunks} "
            f"chunks, {rc['tok_s']:.0f} tok/s)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def print_row(s: dict) -> None:
    print(
        f"{s['name']:>6}: {s['tok_s']:8.1f} tok/s ({s['tokens']} tokens in {s['wall_s']:.2f} s)"
        f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms p99 {s['ttft_p99_ms']:.1f} ms"
        f"  ITL p50 {s['itl_p50_ms']:.2f} ms p99 {s['itl_p99_ms']:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
