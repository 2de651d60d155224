"""A model's load into a worker's engine: peak and final resident memory and load time, against
the bound a load that converts tensor by tensor keeps (issue 41 §4): the final resident bytes
plus the largest checkpoint tensor's bf16 copy.

    python bench/load.py MODEL [--cpu-path bf16] [--threads 2] [--json OUT]
    python bench/load.py FILE.gguf --cpu-path auto --answer 8 --peer   # and llama-server's load

Each load runs in a fresh process (``python bench/load.py --child``): it builds the ``Engine``
(``load_model``, then the CPU path's layout) while a thread samples ``/proc/self/status`` every
10 ms, and reports ``VmHWM`` (the kernel's own peak of resident pages), the sampled peaks of
``VmRSS`` and ``RssAnon`` (tensors and heap: mapped file pages, which the kernel may drop, are
``RssFile``), the same after the load, and the seconds the load took. ``PYTHONPATH`` decides
whose code loads (a checkout before a change, for its figures). ``--answer N``: the loaded engine
then decodes N greedy tokens (it answers, and how long the first answer takes). ``--peer`` (a GGUF):
``llama-server`` on the same file (bench/peer.py), its seconds to a ``/health`` 200, its peak and
final resident memory (sampled from ``/proc/<pid>/status``: it maps the file, so most of its pages
are file-backed), and N tokens from ``/completion``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _status(pid: int | str = "self") -> dict[str, int]:
    """A process's memory lines of /proc/<pid>/status (this one's by default), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def largest_tensor_bf16(model: str) -> int:
    """Bytes of the checkpoint's largest tensor in bf16 (safetensors headers or GGUF)."""
    from pantheon.core.gguf import find_gguf, read_gguf

    found = find_gguf(Path(model))
    if found is not None:
        shapes = [t.shape for t in read_gguf(found).tensors.values()]
    else:
        from workers.loader import check_safetensors, weight_files

        shapes = [
            info["shape"]
            for f in weight_files(Path(model))
            for name, info in check_safetensors(f).items()
            if name != "__metadata__"
        ]
    largest = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        largest = max(largest, n)
    return 2 * largest


def child(model: str, cpu_path: str, threads: int, answer: int = 0) -> dict:
    import torch

    torch.set_num_threads(threads)
    from workers.engine import Engine

    peak = {"VmRSS": 0, "RssAnon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = _status()
            for k in peak:
                peak[k] = max(peak[k], s.get(k, 0))
            time.sleep(0.01)

    before = _status()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t = time.perf_counter()
    eng = Engine(
        model,
        cpu_path=None if cpu_path == "auto" else cpu_path,
        num_slots=1,
        kv_budget_bytes=16 << 20,
        compile_decode=False,
    )
    load_s = time.perf_counter() - t
    done.set()
    thread.join()
    after = _status()
    answered, answer_s = 0, 0.0
    if answer:
        from pantheon.core.protocol import SamplingParams

        t = time.perf_counter()
        eng.submit(
            "load-answer",
            [1, 2, 3, 4, 5, 6, 7, 8],
            SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True),
        )
        while eng.has_work():
            answered += sum(1 for o in eng.step() if o.request_id == "load-answer")
        answer_s = time.perf_counter() - t
    return {
        "answered": answered,
        "answer_s": answer_s,
        "cpu_path": eng.cpu_path,
        "load_s": load_s,
        "weight_bytes": eng.weight_bytes,
        "start": before,
        "final": after,
        "peak_rss": max(peak["VmRSS"], after["VmHWM"]),
        "peak_anon": peak["RssAnon"],
    }


def peer_load(model: str, threads: int, answer: int) -> dict:
    """llama-server's load of the same GGUF: seconds to /health 200, resident memory sampled
    every 10 ms until then, and ``answer`` tokens from /completion."""
    import httpx

    sys.path.insert(0, str(ROOT))
    from bench import peer

    bins = peer.find_bins()
    if bins is None:
        raise SystemExit("llama.cpp is not built: python bench/peer.py build")
    port = peer._free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "bench-load-llama-server.log", "w")
    cmd = [str(bins / "llama-server"), "-m", model, "-t", str(threads), "-c", "2048", "-np", "1"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    peak = 0
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}: see {log.name}")
            peak = max(peak, _status(proc.pid).get("VmRSS", 0))
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        r = httpx.post(
            f"http://127.0.0.1:{port}/completion",
            json={"prompt": "Hello", "n_predict": answer, "temperature": 0, "ignore_eos": True},
            timeout=600,
        )
        answer_s = time.perf_counter() - t
        final = _status(proc.pid)
        return {
            "load_s": load_s,
            "peak_rss": max(peak, final["VmHWM"]),
            "final": final,
            "answered": int(r.json().get("tokens_predicted", 0)),
            "answer_s": answer_s,
        }
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cpu-path", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--answer", type=int, default=0, help="then decode N greedy tokens")
    ap.add_argument("--peer", action="store_true", help="also llama-server's load of the same GGUF")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.cpu_path, args.threads, args.answer)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    r = subprocess.run(
        [
            sys.executable,
            __file__,
            args.model,
            "--child",
            "--cpu-path",
            args.cpu_path,
            "--threads",
            str(args.threads),
            "--answer",
            str(args.answer),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        print(r.stderr[-4000:], file=sys.stderr)
        return r.returncode
    got = json.loads(r.stdout.strip().splitlines()[-1])
    sys.path.insert(0, env["PYTHONPATH"].split(os.pathsep)[0])
    largest = largest_tensor_bf16(args.model)
    final, start = got["final"], got["start"]
    bound = final["RssAnon"] + largest
    got["largest_tensor_bf16"] = largest
    got["bound_anon"] = bound
    print(
        f"{args.model} on {args.cpu_path} (code: {env['PYTHONPATH']}): load {got['load_s']:.1f} s; weights "
        f"{got['weight_bytes'] / GIB:.2f} GiB\n"
        f"  resident: start {start['VmRSS'] / GIB:.2f} GiB, peak {got['peak_rss'] / GIB:.2f} GiB, final "
        f"{final['VmRSS'] / GIB:.2f} GiB (anonymous: peak {got['peak_anon'] / GIB:.2f}, final "
        f"{final['RssAnon'] / GIB:.2f}; file-backed final {final['RssFile'] / GIB:.2f})\n"
        f"  bound: final anonymous + largest tensor in bf16 ({largest / GIB:.2f}) = {bound / GIB:.2f} GiB: "
        f"peak anonymous {'within' if got['peak_anon'] <= bound else 'ABOVE'} it",
        flush=True,
    )
    if args.answer:
        print(
            f"  answered {got['answered']} tokens in {got['answer_s']:.1f} s (path {got['cpu_path']})",
            flush=True,
        )
    if args.peer:
        got["llama_server"] = peer_load(args.model, args.threads, args.answer or 1)
        p = got["llama_server"]
        print(
            f"llama-server: ready in {p['load_s']:.1f} s; resident peak {p['peak_rss'] / GIB:.2f} GiB, final "
            f"{p['final']['VmRSS'] / GIB:.2f} GiB (anonymous {p['final']['RssAnon'] / GIB:.2f}, file-backed "
            f"{p['final']['RssFile'] / GIB:.2f}); answered {p['answered']} tokens in {p['answer_s']:.1f} s\n"
            f"ours / llama-server: load {got['load_s'] / p['load_s']:.2f}x the time, peak resident "
            f"{got['peak_rss'] / p['peak_rss']:.2f}x",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
