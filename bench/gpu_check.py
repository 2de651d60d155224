"""Issue 30 §1 in one run on a lent GPU machine: is Pantheon correct on ``cuda:0``, and how fast?

On the device (the command that the device tool runs, `carry: [".whl"]`; the wheels come from
``bash bench/gpu_wheels.sh`` here):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; python3 bench/gpu_check.py --out $OUT --site /tmp/site

Here, to check the script itself (no CUDA: the ceilings and the -m gpu tests skip; the reference
tests run on the CPU on two presets, the serve checks on a CPU die, a short decode bench):

    python3 bench/gpu_check.py --die cpu:0 --out /tmp/gc

Parts, each on its own (a part that fails or raises is recorded as FAIL and the next one runs),
inside ``--budget-s`` (default 480 s) in all:

1. environment: torch / CUDA / Triton / transformers versions, the device's name, SMs and memory;
   the carried wheels' requirements against what is installed (``bench/gpu_wheels_check.py``);
   the two ceilings: a device-to-device copy (GB/s counting bytes read and written) and a bf16
   8192^3 matrix product (TFLOP/s), each the median of 10 after warm-ups, on random data;
2. ``pytest -m gpu`` on the files that hold gpu tests, and the device reference tests
   (``tests/unit/test_gpu_reference.py``: our logits against transformers' on the same device, fp32
   with TF32 off and bf16, every architecture served), ``PANTHEON_REF_DEVICE`` = the die;
3. a real ``pantheon serve`` on the die, through the official ``openai`` client: greedy
   (ignore_eos) twice equal; seeded sampling twice equal (logprobs); streamed equal to the
   collected greedy text; structured output (json_schema) parsed and valid; 8 concurrent requests
   each answered, the greedy one equal to alone; the die's memory figures (``/admin/dies``) against
   ``torch.cuda.mem_get_info``; a second model loaded, asked and unloaded while a stream runs, the
   stream finishing whole and the registry as before;
4. kernels: one layer's attention (``bench/attention_cuda.py --quick``: the Triton paged kernels
   against the torch gather they replace) and Gated DeltaNet (``bench/gdn_cuda.py --quick``:
   flash-linear-attention against our torch functions), the speedups in the table;
5. ``bench/decode.py --no-hf`` on random bf16 models shaped like SmolLM2-135M, Qwen3-0.6B and
   Llama-3.1-8B (``make-model --fast-random``): ms/token at batch 1 against the bandwidth floor
   (weight bytes over part 1's copy bandwidth), tok/s at batch 8, 32 and 64 (CUDA graphs, as
   served), and SmolLM2's steps without graphs (``--no-graphs``) beside them; each model only
   while the budget lasts.

The PASS/FAIL table is printed last; ``--out`` gets ``gpu_check.log`` (everything printed, the
subprocesses' output included), ``gpu_check.json`` (the figures) and the server's log. The exit
status is the number of failed checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
T0 = time.monotonic()
RESULTS: list[dict] = []  # {part, name, ok (True / False / None = skipped), detail}
FIGURES: dict = {}
LOG = None  # the log file in --out


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def check(part: str, name: str, ok: bool | None, detail: str) -> bool:
    RESULTS.append(dict(part=part, name=name, ok=ok, detail=detail))
    say(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  [{part}] {name}: {detail}")
    return bool(ok)


def elapsed() -> float:
    return time.monotonic() - T0


CURRENT = ["start"]  # the part running now, for the watchdog
CHILDREN: list[subprocess.Popen] = []  # what the watchdog stops before it exits


def watchdog(args) -> None:
    """At ``--budget-s`` + 60 s: the part running is a FAIL, the table and figures are written and
    the process exits, so that a hang cannot eat the device call's limit with no table printed."""

    def fire() -> None:
        check(
            CURRENT[0],
            "watchdog",
            False,
            f"still running at {elapsed():.0f} s (budget {args.budget_s:.0f} s)",
        )
        finish(args)
        for p in CHILDREN:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)  # a server drains and stops its workers
        time.sleep(3)
        os._exit(1 + sum(1 for r in RESULTS if r["ok"] is False))

    t = threading.Timer(args.budget_s + 60, fire)
    t.daemon = True
    t.start()


def finish(args) -> None:
    if args.out:
        (args.out / "gpu_check.json").write_text(
            json.dumps(dict(results=RESULTS, figures=FIGURES), indent=1, default=str)
        )
    say(table())
    if LOG is not None:
        LOG.flush()


def run_part(part: str, fn, *args) -> None:
    """Run one part; an exception is one FAIL line (with the traceback in the log)."""
    CURRENT[0] = part
    say(f"\n==== {part} ({elapsed():.0f} s in)")
    t = time.monotonic()
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - every part is independent
        say(traceback.format_exc())
        check(part, "part raised", False, f"{type(e).__name__}: {str(e)[:200]}")
    FIGURES.setdefault("part_seconds", {})[part] = round(time.monotonic() - t, 1)


def run_logged(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd``, its output line by line into the log; killed (its process group) at ``timeout``.
    Returns (exit status or -9 on timeout, the output)."""
    say("$ " + " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    CHILDREN.append(proc)
    out: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            say("  | " + line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = -9
        say(f"  (killed after {timeout:.0f} s)")
    reader.join(10)
    return rc, "".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(preset: str, out: Path, *extra: str) -> float:
    """Write a preset folder (once); seconds it took."""
    if (out / "config.json").exists():
        return 0.0
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pantheon", "make-model", "--preset", preset, "--out", str(out), *extra],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - t


# ---------------------------------------------------------------- 1. environment and ceilings


def part_env(args) -> None:
    import torch

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        host=platform.node(),
        cpus=os.cpu_count(),
    )
    for mod in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "openai", "pydantic", "zmq"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"missing ({type(e).__name__})"
    if args.cuda:
        if not torch.cuda.is_available():
            check("env", "CUDA device", False, "torch.cuda.is_available() is False")
            args.cuda = False
        else:
            i = torch.device(args.die).index or 0
            p = torch.cuda.get_device_properties(i)
            env.update(
                device=p.name,
                capability=f"{p.major}.{p.minor}",
                sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1),
                l2_mb=round(getattr(p, "L2_cache_size", 0) / 1e6, 1),
                devices=torch.cuda.device_count(),
            )
            check(
                "env",
                "CUDA device",
                True,
                f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB",
            )
    for k, v in env.items():
        say(f"  {k}: {v}")
    FIGURES["env"] = env
    if args.site:
        rc, out = run_logged(
            [sys.executable, str(ROOT / "bench/gpu_wheels_check.py"), "--installed", args.site], 60
        )
        check(
            "env",
            "carried wheels' requirements",
            rc == 0,
            out.strip().splitlines()[-1] if out.strip() else f"rc {rc}",
        )
    if not args.cuda:
        check("env", "ceilings", None, "no CUDA device")
        return
    dev = torch.device(args.die)
    # copy: 4 GiB read + 4 GiB written a time (KINDS.md saw ~4.3 TB/s on an H200, ~3.0 on an H100)
    n = 2 << 30  # bf16 elements
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    ok_copy = torch.equal(dst[: 1 << 20], src[: 1 << 20])
    del src, dst
    t_copy = sorted(times)[len(times) // 2]
    bw = 2 * n * 2 / t_copy
    FIGURES["copy_bandwidth_bytes_per_s"] = bw
    check(
        "env", "copy bandwidth", ok_copy, f"{bw / 1e12:.2f} TB/s (read + write, median of 10, 8.6 GB a copy)"
    )
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    w = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y = x @ w
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    t_mm = sorted(times)[len(times) // 2]
    ok_mm = bool(torch.isfinite(y[:64, :64].float()).all())
    del x, w, y
    torch.cuda.empty_cache()
    FIGURES["bf16_matmul_flops"] = 2 * m**3 / t_mm
    check(
        "env",
        "bf16 matmul 8192^3",
        ok_mm,
        f"{2 * m**3 / t_mm / 1e12:.0f} TFLOP/s (median of 10, random data)",
    )


# ---------------------------------------------------------------- 2. the gpu and reference tests


def junit_results(path: Path) -> list[tuple[str, str, str]]:
    """(test id, outcome: passed / failed / skipped, message) from pytest's junit XML."""
    out = []
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, msg = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")[:200]
        out.append((tid, outcome, msg))
    return out


def summarize(part: str, name: str, rows: list[tuple[str, str, str]], want: bool = True) -> None:
    if not rows:
        check(part, name, False if want else None, "no tests ran")
        return
    n = {k: sum(1 for r in rows if r[1] == k) for k in ("passed", "failed", "skipped")}
    failed = [r for r in rows if r[1] == "failed"]
    for tid, _, msg in failed:
        say(f"  FAILED {tid}: {msg}")
    for tid, _, msg in rows:
        if _ == "skipped":
            say(f"  skipped {tid}: {msg}")
    detail = f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
    if failed:
        detail += " (" + ", ".join(t.split("::")[-1] for t, _, _ in failed[:6]) + ")"
    ok = None if n["passed"] == 0 and not failed else not failed
    check(part, name, ok, detail)


def part_tests(args) -> None:
    gpu_files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace") and p.name != "test_gpu_reference.py"
    )
    ref = "tests/unit/test_gpu_reference.py"
    xml = args.tmp / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}"]
    cmd += ["-o", "timeout=240", "-m", "gpu", *gpu_files, ref]
    if not args.cuda:  # the script's own check: two presets on the CPU
        cmd += ["-k", "tiny-llama or tiny-gemma3 or not reference"]
    env = dict(os.environ, PANTHEON_REF_DEVICE=args.die if args.cuda else "cpu")
    env.setdefault("PANTHEON_COMPILE", "0")
    t = time.monotonic()
    rc, out = run_logged(cmd, min(args.tests_timeout, remaining(args) - 150), env)
    FIGURES["tests_seconds"] = round(time.monotonic() - t, 1)
    rows = junit_results(xml)
    FIGURES["tests"] = [dict(id=i, outcome=o, message=m) for i, o, m in rows]
    if rc == -9:
        check("tests", "pytest finished", False, f"killed at the time limit; {len(rows)} results")
    elif rc not in (0, 1, 5):
        check("tests", "pytest finished", False, f"exit status {rc} (collection or usage error)")
    summarize(
        "tests",
        "-m gpu tests",
        [r for r in rows if not r[0].startswith("test_gpu_reference::")],
        want=args.cuda,
    )
    summarize(
        "tests",
        f"reference fp32 on {env['PANTHEON_REF_DEVICE']}",
        [r for r in rows if r[0].startswith("test_gpu_reference::test_fp32_")],
    )
    summarize(
        "tests",
        f"reference bf16 on {env['PANTHEON_REF_DEVICE']}",
        [r for r in rows if r[0].startswith("test_gpu_reference::test_bf16_")],
    )


# ---------------------------------------------------------------- 3. a real server on the die


class Server:
    """``pantheon serve`` on one model and die, its log in ``log``."""

    def __init__(self, model: Path, die: str, log: Path, timeout: float = 150):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = ["--cpu-dies", "2"] if die.startswith("cpu") else []
        cmd = [sys.executable, "-m", "pantheon", "serve", "--model", str(model), "--name", "m"]
        cmd += ["--dies", die, "--port", str(self.port), *extra]
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
        env = dict(os.environ, PYTHONPATH=path)
        env.setdefault("PANTHEON_COMPILE", "0")
        self.log_path = log
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        CHILDREN.append(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                listed = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
                if any(m["id"] == "m" and m.get("status", {}).get("value") == "loaded" for m in listed):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-1500:]

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def aclient(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def get(self, path: str):
        r = httpx.get(self.url + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "unit"],
    "additionalProperties": False,
}


def valid(v, schema: dict) -> bool:
    """Enough of JSON Schema for SCHEMA (jsonschema is not on the device)."""
    if "enum" in schema:
        return v in schema["enum"]
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        return (
            isinstance(v, dict)
            and all(k in v for k in schema.get("required", []))
            and (schema.get("additionalProperties", True) or set(v) <= set(props))
            and all(valid(v[k], props[k]) for k in v if k in props)
        )
    if t == "array":
        return (
            isinstance(v, list)
            and len(v) <= schema.get("maxItems", 1 << 30)
            and all(valid(x, schema["items"]) for x in v)
        )
    if t == "string":
        return isinstance(v, str) and schema.get("minLength", 0) <= len(v) <= schema.get("maxLength", 1 << 30)
    if t == "integer":
        return (
            isinstance(v, int)
            and not isinstance(v, bool)
            and schema.get("minimum", -(1 << 62)) <= v <= schema.get("maximum", 1 << 62)
        )
    return True


MSG = [{"role": "user", "content": "Count to five."}]
LONG = 3000  # the stream that runs while a model is loaded and unloaded (tiny-llama: 4096 positions)


def part_serve(args) -> None:
    model = args.tmp / "serve-tiny-llama"
    make_model("tiny-llama", model)  # bf16, as a real checkpoint
    second = args.tmp / "serve-tiny-qwen3"
    make_model("tiny", second)
    t = time.monotonic()
    srv = Server(model, args.die, args.tmp / "serve.log")
    FIGURES["serve_ready_s"] = round(time.monotonic() - t, 1)
    say(f"  server ready in {FIGURES['serve_ready_s']} s at {srv.url}")
    try:
        serve_checks(srv, args)
    finally:
        srv.close()
        if args.out:
            shutil.copy(srv.log_path, args.out / "serve.log")


def serve_checks(srv: Server, args) -> None:
    c = srv.client()
    P = "serve"
    greedy = dict(model="m", messages=MSG, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    t = time.monotonic()
    a = c.chat.completions.create(**greedy)
    ms = (time.monotonic() - t) * 1000
    b = c.chat.completions.create(**greedy)
    text = a.choices[0].message.content or ""
    check(
        P,
        "greedy (ignore_eos) twice",
        a.usage is not None and a.usage.completion_tokens == 16 and text == b.choices[0].message.content,
        f"{a.usage.completion_tokens if a.usage else '?'} tokens in {ms:.0f} ms, equal twice: "
        f"{text == b.choices[0].message.content}",
    )
    FIGURES["serve_greedy_ms"] = round(ms, 1)

    sampled = dict(model="m", messages=MSG, max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    s1 = c.chat.completions.create(**sampled, logprobs=True, top_logprobs=3)
    s2 = c.chat.completions.create(**sampled, logprobs=True, top_logprobs=3)
    s3 = c.chat.completions.create(**{**sampled, "seed": 8})
    lp = (s1.choices[0].logprobs.content if s1.choices[0].logprobs else None) or []
    same = s1.choices[0].message.content == s2.choices[0].message.content
    check(
        P,
        "seeded sampling twice equal",
        same and bool(lp) and len(lp[0].top_logprobs) == 3,
        f"equal: {same}, {len(lp)} logprobs with top-3; seed 8 differs: "
        f"{s3.choices[0].message.content != s1.choices[0].message.content}",
    )

    parts, finish, usage = [], None, None
    for ch in c.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    streamed = "".join(parts)
    check(
        P,
        "streamed = collected greedy",
        streamed == text and finish == "length" and usage is not None and usage.completion_tokens == 16,
        f"{len(parts)} chunks, finish {finish}, equal: {streamed == text}",
    )

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    oks, seen = 0, []
    for seed in range(3):
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Write a person as JSON."}],
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=120,
            temperature=0.8,
            seed=seed,
            # the template's empty think block: a random model's reasoning would take the tokens
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        body = r.choices[0].message.content or ""
        try:
            ok = valid(json.loads(body), SCHEMA) and r.choices[0].finish_reason == "stop"
        except ValueError:
            ok = False
        oks += ok
        seen.append(body[:80])
    say("  structured: " + " | ".join(seen))
    check(P, "structured output (json_schema)", oks == 3, f"{oks}/3 parsed, valid and stopped")

    async def eight():
        ac = srv.aclient()
        prompts = [MSG] + [
            [{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(1, 8)
        ]
        t = time.monotonic()
        rs = await asyncio.gather(
            *(
                ac.chat.completions.create(
                    model="m", messages=m, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
                )
                for m in prompts
            )
        )
        await ac.close()
        return rs, time.monotonic() - t

    rs, wall = asyncio.run(eight())
    toks = [r.usage.completion_tokens if r.usage else 0 for r in rs]
    check(
        P,
        "8 concurrent requests",
        toks == [16] * 8 and rs[0].choices[0].message.content == text,
        f"{sum(toks)} tokens in {wall * 1000:.0f} ms, each 16: {toks == [16] * 8}, "
        f"the greedy one equal to alone: {rs[0].choices[0].message.content == text}",
    )

    dies = srv.get("/admin/dies")["data"]
    d = next(x for x in dies if x["die"] == args.die)
    FIGURES["die"] = d
    check(
        P,
        "die memory booked",
        d["weights_bytes"] > 0 and d["kv_bytes"] > 0 and d["pressure"] == 0,
        f"weights {d['weights_bytes'] >> 20} MiB, kv {d['kv_bytes'] >> 20} MiB, budget "
        f"{d['budget_bytes'] >> 20} MiB, pressure {d['pressure_name']}",
    )
    if args.cuda:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(args.die).index or 0)
        measured = d.get("measured_free_bytes")
        check(
            P,
            "memory figures = torch.cuda.mem_get_info",
            d["total_bytes"] == total
            and measured is not None
            and abs(measured - free) < max(2 << 30, total // 20),
            f"total {d['total_bytes'] >> 20} MiB (here {total >> 20}), worker's free "
            f"{(measured or 0) >> 20} MiB (here {free >> 20})",
        )

    # a second model loaded, asked and unloaded while a stream runs
    def registry():
        rows = srv.get("/admin/models")["data"]
        return sorted((r["name"], r["state"], tuple(r["dies"])) for r in rows), sorted(
            m["id"] for m in srv.get("/v1/models")["data"]
        )

    before = registry()
    got: dict = {}

    def stream_long():
        n, fin = 0, None
        try:
            for ch in c.chat.completions.create(
                model="m",
                messages=MSG,
                max_tokens=LONG,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if ch.choices and ch.choices[0].delta.content is not None:
                    n += 1
                if ch.choices:
                    fin = ch.choices[0].finish_reason or fin
        except Exception as e:  # noqa: BLE001
            got["error"] = repr(e)
        got.update(chunks=n, finish=fin, done_at=time.monotonic())

    th = threading.Thread(target=stream_long)
    th.start()
    time.sleep(0.2)
    t = time.monotonic()
    body = {"path": str(args.tmp / "serve-tiny-qwen3"), "name": "second", "dies": [args.die]}
    r = httpx.post(srv.url + "/admin/models/load", json=body, timeout=240)
    loaded = r.status_code == 200
    asked = loaded and c.chat.completions.create(model="second", messages=MSG, max_tokens=4).usage is not None
    r2 = httpx.post(srv.url + "/admin/models/unload", json={"name": "second"}, timeout=120)
    t_cycle = time.monotonic() - t
    still_streaming = th.is_alive()
    th.join(120)
    after = registry()
    check(
        P,
        "load + unload under a stream",
        loaded
        and asked
        and r2.status_code == 200
        and still_streaming
        and "error" not in got
        and got.get("finish") == "length"
        and after == before,
        f"load {r.status_code}, asked {asked}, unload {r2.status_code} in {t_cycle:.1f} s "
        f"(stream still running then: {still_streaming}); stream {got.get('chunks')} chunks, finish "
        f"{got.get('finish')}{', ' + got['error'] if 'error' in got else ''}; registry as before: {after == before}",
    )
    if not loaded:
        say(f"  load answered: {r.text[:400]}")


# ---------------------------------------------------------------- 4. the decode benchmark


BENCH_MODELS = [  # preset, batches, decode tokens, a rough cap on its seconds (load included)
    ("smollm2-135m", "1,8,32,64", 64, 60),
    ("qwen3-0.6b", "1,8,32,64", 64, 75),
    ("llama-3.1-8b", "1,8,32,64", 32, 150),
]
# The same steps without CUDA graphs (eager: a launch per kernel), on the smallest model, whose
# step is launch-bound: what the graphs buy
NO_GRAPHS = ("smollm2-135m", "1,8", 64, 40)


def part_kernels(args) -> None:
    """One layer's attention and Gated DeltaNet: our kernels against the torch paths they
    replace (bench/attention_cuda.py, bench/gdn_cuda.py), quick shapes."""
    if not args.cuda:
        check("kernels", "attention / GDN kernels", None, "skipped: no CUDA device")
        return
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    )
    for script in ("attention_cuda.py", "gdn_cuda.py"):
        rc, out = run_logged([sys.executable, str(ROOT / "bench" / script), "--quick"], 120, env)
        last = [line for line in out.splitlines() if line.startswith("SUMMARY")]
        check("kernels", script, rc == 0, last[-1][8:] if last else f"exit {rc}")


def remaining(args) -> float:
    return args.budget_s - elapsed()


def part_bench(args) -> None:
    models = BENCH_MODELS if args.cuda else [("smollm2-135m", "1,8", 8, 120)]
    bw = FIGURES.get("copy_bandwidth_bytes_per_s")
    FIGURES["bench"] = {}
    for preset, batches, tokens, cap in models:
        left = remaining(args) - 20
        if left < cap * 0.6:
            check("bench", preset, None, f"skipped: {left:.0f} s of the budget left, it needs ~{cap}")
            continue
        folder = args.models / preset
        t_make = make_model(preset, folder, "--fast-random")
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        say(
            f"  {preset}: {size / 1e9:.2f} GB written in {t_make:.1f} s ({size / 1e9 / max(t_make, 1e-3):.2f} GB/s)"
        )
        out = args.tmp / f"bench-{preset}.json"
        cmd = [sys.executable, str(ROOT / "bench/decode.py"), "--model", str(folder), "--device", args.die]
        cmd += ["--no-hf", "--batches", batches, "--tokens", str(tokens), "--json", str(out)]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
        )
        rc, _ = run_logged(cmd, min(left, cap * 2), env)
        if rc != 0 or not out.exists():
            check("bench", preset, False, f"decode.py exit {rc}")
            continue
        fig = json.loads(out.read_text())
        fig["make_model_s"] = round(t_make, 1)
        FIGURES["bench"][preset] = fig
        wb = fig["weight_bytes"]["bf16"]
        use_bw = bw or fig["bandwidth_bytes_per_s"]
        rows = {r["batch"]: r for r in fig["rows"]}
        one = rows.get(1)
        parts = []
        if one:
            floor_ms = wb / use_bw * 1000
            parts.append(
                f"b1 {one['ms_per_step']:.2f} ms/tok (floor {floor_ms:.2f}, {floor_ms / one['ms_per_step']:.0%})"
            )
        parts += [f"b{b} {r['tok_s']:.0f} tok/s" for b, r in rows.items() if b != 1]
        state = next(iter(fig.get("step_state", {}).values()), "?")
        check("bench", preset, True, f"{wb / 1e9:.2f} GB; " + "; ".join(parts) + f"; steps: {state}")
        if args.cuda and preset == NO_GRAPHS[0] and remaining(args) > NO_GRAPHS[3] + 20:
            plain = args.tmp / f"bench-{preset}-eager.json"
            cmd2 = [*cmd[: cmd.index("--batches")], "--batches", NO_GRAPHS[1], "--tokens", str(NO_GRAPHS[2])]
            rc, _ = run_logged([*cmd2, "--no-graphs", "--json", str(plain)], NO_GRAPHS[3] * 2, env)
            if rc == 0 and plain.exists():
                eager = {r["batch"]: r for r in json.loads(plain.read_text())["rows"]}
                FIGURES["bench"][preset + " (no graphs)"] = eager
                gain = [
                    f"b{b} {eager[b]['ms_per_step']:.2f} -> {rows[b]['ms_per_step']:.2f} ms/step"
                    for b in eager
                    if b in rows
                ]
                check("bench", f"{preset}: eager -> graphs", True, "; ".join(gain))
            else:
                check("bench", f"{preset}: eager -> graphs", False, f"decode.py --no-graphs exit {rc}")
        if preset != models[0][0] and not args.keep_models:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- main


def table() -> str:
    lines = ["", "==== gpu_check: PASS/FAIL", f"{'':4}  {'part':<6} {'check':<40} figures"]
    for r in RESULTS:
        mark = "SKIP" if r["ok"] is None else "PASS" if r["ok"] else "FAIL"
        detail = " ".join(r["detail"].split())[:240]  # one line each
        lines.append(f"{mark:<4}  {r['part']:<6} {r['name'][:40]:<40} {detail}")
    fails = [r for r in RESULTS if r["ok"] is False]
    lines.append(
        f"{len(fails)} failed, {sum(1 for r in RESULTS if r['ok'])} passed, "
        f"{sum(1 for r in RESULTS if r['ok'] is None)} skipped, in {elapsed():.0f} s"
    )
    return "\n".join(lines)


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--die", default="cuda:0")
    ap.add_argument("--out", type=Path, help="the log, the figures (JSON) and the server's log go here")
    ap.add_argument("--site", help="the --target folder of the carried wheels: check their requirements")
    ap.add_argument("--budget-s", type=float, default=480, help="the whole run's time budget (480 s)")
    ap.add_argument("--tests-timeout", type=float, default=270, help="pytest's limit (270 s)")
    ap.add_argument("--models", type=Path, help="where the benchmark's model folders go (a temp dir)")
    ap.add_argument("--keep-models", action="store_true", help="keep the benchmark's folders")
    ap.add_argument(
        "--parts",
        default="env,tests,serve,kernels,bench",
        help="which parts, comma-separated (env,tests,serve,kernels,bench)",
    )
    args = ap.parse_args()
    args.cuda = args.die.startswith("cuda")
    args.tmp = Path(tempfile.mkdtemp(prefix="pantheon-gpu-check-"))
    if args.models is None:  # in memory where there is room: an 8B folder (16 GB) writes in seconds there
        shm = Path("/dev/shm")
        big = shm.is_dir() and shutil.disk_usage(shm).free > (24 << 30)
        args.models = (
            Path(tempfile.mkdtemp(prefix="pantheon-gpu-check-", dir=shm)) if big else args.tmp / "models"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        LOG = open(args.out / "gpu_check.log", "w")
    os.environ.setdefault("PANTHEON_COMPILE", "0")  # the servers' and benchmarks' decode: eager, stated
    say(
        f"gpu_check on {args.die}: {' '.join(sys.argv[1:])}; PANTHEON_COMPILE={os.environ['PANTHEON_COMPILE']}"
    )
    wanted = set(args.parts.split(","))
    watchdog(args)
    parts = [
        ("env", part_env),
        ("tests", part_tests),
        ("serve", part_serve),
        ("kernels", part_kernels),
        ("bench", part_bench),
    ]
    for name, fn in parts:
        if name in wanted:
            run_part(name, fn, args)
        if args.out:
            (args.out / "gpu_check.json").write_text(
                json.dumps(dict(results=RESULTS, figures=FIGURES), indent=1, default=str)
            )
    finish(args)
    if LOG is not None:
        LOG.close()
    if not args.keep_models:
        shutil.rmtree(args.tmp, ignore_errors=True)
        shutil.rmtree(args.models, ignore_errors=True)
    return sum(1 for r in RESULTS if r["ok"] is False)


if __name__ == "__main__":
    raise SystemExit(main())
