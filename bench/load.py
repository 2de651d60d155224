"""A model's load into a worker's engine: peak and final resident memory and load time, against
the bound a load that converts tensor by tensor keeps (issue 41 §4): the final resident bytes
plus the largest checkpoint tensor's bf16 copy.

    python bench/load.py MODEL [--cpu-path bf16] [--threads 2] [--json OUT]

Each load runs in a fresh process (``python bench/load.py --child``): it builds the ``Engine``
(``load_model``, then the CPU path's layout) while a thread samples ``/proc/self/status`` every
10 ms, and reports ``VmHWM`` (the kernel's own peak of resident pages), the sampled peaks of
``VmRSS`` and ``RssAnon`` (tensors and heap: mapped file pages, which the kernel may drop, are
``RssFile``), the same after the load, and the seconds the load took. ``PYTHONPATH`` decides
whose code loads (a checkout before a change, for its figures).
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


def _status() -> dict[str, int]:
    """This process's memory lines of /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
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


def child(model: str, cpu_path: str, threads: int) -> dict:
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
    eng = Engine(model, cpu_path=cpu_path, num_slots=1, kv_budget_bytes=16 << 20, compile_decode=False)
    load_s = time.perf_counter() - t
    done.set()
    thread.join()
    after = _status()
    return {
        "load_s": load_s,
        "weight_bytes": eng.weight_bytes,
        "start": before,
        "final": after,
        "peak_rss": max(peak["VmRSS"], after["VmHWM"]),
        "peak_anon": peak["RssAnon"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cpu-path", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.cpu_path, args.threads)))
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
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
