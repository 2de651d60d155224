"""Decode at depth: tokens/s decoding after a long prompt, our engine against llama.cpp, per KV type.

    python bench/decode_depth.py                       # SmolLM2-135M Q4_1 GGUF, auto/q8_0/q4_0
    python bench/decode_depth.py --depths 0,2048 --kinds auto,q8_0 --batches 1,8 --rounds 2
    python bench/decode_depth.py --no-peer --json OUT.json

For each KV cache type (``--kinds``: the same type for K and V) and each depth (``--depths``:
0 / 2048 / 8192), our engine (in-process, greedy, ``ignore_eos``) decodes ``--tokens`` (64)
tokens per sequence after a prompt of that many tokens, at each of ``--batches`` (1 and 8)
sequences with distinct prompts; prefill is not timed. Two attention paths for the decode rows:

- ``gather`` (before issue 27's §2): every step copies each sequence's whole cached K and V into
  one dense tensor per layer (``_decode_by_rows``), then attends;
- ``blocks``: ``decode_attention``'s torch path (``PANTHEON_ATTN_KERNEL=0``): reads the paged
  pool by whole blocks, a bounded group at a time (``workers/layers/attention.py``);
- ``kernel`` (now, on the CPU): the native paged kernel (``workers/kernels/paged_decode.c``)
  reads each row's blocks where they lie, no copy.

``--attn torch|kernel|both`` picks ``blocks``, ``kernel`` or both (``--paths`` names any).

Both run on the same prefilled cache: the second path's requests repeat the first's prompts
and find them in the prefix cache (only the last partial block is computed again). A prompt
is at most the model's context limit less the decoded tokens (SmolLM2: 8192 - 65 = 8127 for
depth 8192; llama.cpp runs past its training context).

llama.cpp (``bench/peer.py``; skipped when not built or with ``--no-peer``): ``llama-bench -m FILE
-t THREADS -p 0 -n TOKENS -d DEPTHS -fa 1 -ctk T -ctv T`` (``auto`` = f16: llama.cpp has no bf16 KV
on CPU by default; flash attention on, which quantized V needs), its best repetition. llama-bench
runs one sequence: batch 8's ratio is against that batch-1 figure. ``--shared``: the batch's
prompts share all but their last token, so one prefill serves them all (the prefix cache). Best of ``--rounds`` on our
side too: other work on a shared host only slows a run down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pantheon.core.kv_types import KvCacheTypes  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.cache import kv_block_bytes  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.layers import attention as A  # noqa: E402

LLAMA_KV = {"auto": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}
_BLOCKS = A.decode_attention


def _gather_path(q, b, k_cache, v_cache, sinks=None):
    return A._decode_by_rows(q, b, k_cache, v_cache, sinks)


def use_path(name: str) -> None:
    """Route every paged layer's decode rows through ``name`` (gather | blocks | kernel)."""
    A.decode_attention = _gather_path if name == "gather" else _BLOCKS
    os.environ["PANTHEON_ATTN_KERNEL"] = "1" if name == "kernel" else "0"


def prompt(i: int, n: int, shared: bool = False) -> list[int]:
    """Sequence i's prompt of n tokens; ``shared``: every sequence's differs only in its last token."""
    out = [(31 * j + 7 * (j // 97)) % 5000 + 10 for j in range(max(1, n))]
    if shared:
        out[-1] = 10 + i
        return out
    return [(t + 17 * i) % 5000 + 10 for t in out]


def decode_rate(eng: Engine, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, float]:
    """Prefill ``prompts`` (untimed), then decode ``tokens`` each: (tokens/s over the batch, prefill s)."""
    p = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    for i, pr in enumerate(prompts):
        eng.submit(f"{tag}-{i}", pr, p)
    t = time.perf_counter()
    while any(s.num_output == 0 for s in eng.scheduler.running()) or eng.scheduler.waiting:
        eng.step()
    pre = time.perf_counter() - t
    cached = sum(s.cached_tokens for s in eng.scheduler.running())
    if pre > 5:
        print(
            f"    (prefill of {len(prompts)} x {len(prompts[0])} tokens, {cached} cached: {pre:.0f} s)",
            flush=True,
        )
    t = time.perf_counter()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    return len(prompts) * steps / (time.perf_counter() - t), pre


def llama_depth(
    gguf: Path, kind: str, depths: list[int], tokens: int, threads: int, reps: int
) -> dict[int, float]:
    from bench.peer import _bins

    t = LLAMA_KV[kind]
    cmd = [str(_bins() / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens)]
    cmd += ["-d", ",".join(map(str, depths)), "-fa", "1", "-ctk", t, "-ctv", t, "-r", str(reps), "-o", "json"]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        # Seen on a 2-core Intel Xeon with AMX: llama-bench dies of SIGSEGV at a depth > 0 in the
        # CPU backend's weight repacking (as llama-server at start, bench/peer.py); without
        # repacking it runs, on other (slower) kernels: the figures then say so.
        print(f"  llama-bench died ({e.returncode}); again with --repack 0 (its slower kernels)", flush=True)
        out = subprocess.run(cmd + ["--repack", "0"], check=True, capture_output=True, text=True).stdout
    return {int(r["n_depth"]): float(max(r.get("samples_ts") or [r["avg_ts"]])) for r in json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or model folder (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--kinds", default="auto,q8_0,q4_0")
    ap.add_argument("--depths", default="0,2048,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default=None, help="of gather, blocks, kernel (default: --attn's)")
    ap.add_argument("--attn", choices=("torch", "kernel", "both"), default="both")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--shared",
        action="store_true",
        help="the batch's prompts share all but their last token (one prefill through the prefix "
        "cache: a loaded host's shortcut; the sequences then read the same blocks, which flatters "
        "the block path's cache hits at batch > 1)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from bench.decode import default_gguf
    from bench.pantheon_server import cpu_info

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else default_gguf()
    kinds, depths = args.kinds.split(","), [int(d) for d in args.depths.split(",")]
    attn = {"torch": "blocks", "kernel": "kernel", "both": "blocks,kernel"}[args.attn]
    batches, paths = [int(b) for b in args.batches.split(",")], (args.paths or attn).split(",")
    cpu = cpu_info()
    print(f"{model.name}; CPU {cpu['model_name']}, {cpu['cpus']} CPUs; {args.threads} threads", flush=True)
    rows: list[dict] = []
    cpu_path = None
    for kind in kinds:
        kt = KvCacheTypes(kind, kind)
        peer: dict[int, float] = {}
        if not args.no_peer:
            try:
                peer = llama_depth(model, kind, depths, args.tokens, args.threads, 2)
            except Exception as e:  # noqa: BLE001 - no llama.cpp here: our side alone
                print(f"  llama-bench skipped: {e}", flush=True)
        eng = Engine(
            str(model),
            devices=["cpu"],
            num_slots=max(batches),
            kv_budget_bytes=1 << 20,
            cpu_path=cpu_path,
            compile_decode=False,
        )
        cpu_path, limit, dt = eng.cpu_path, eng.max_model_len, eng.dtype
        per_seq = min(max(depths), limit) + 2 * args.tokens + 64
        budget = kv_block_bytes(eng.cfg, 16, dt, kt) * (-(-per_seq // 16) * max(batches) + 8)
        del eng
        eng = Engine(
            str(model),
            devices=["cpu"],
            num_slots=max(batches),
            kv_budget_bytes=budget,
            cpu_path=cpu_path,
            kv_cache_k=kt.k,
            kv_cache_v=kt.v,
            prefill_chunk=1024,
            compile_decode=False,
        )
        print(f"{kind}: dtype {dt}, CPU path {cpu_path}, KV pool {eng.kv_bytes / 1e6:.0f} MB", flush=True)
        decode_rate(eng, [prompt(0, 16)], 8, "warm")
        for depth in depths:
            n = min(depth, limit - args.tokens - 1)
            for bsz in sorted(batches, reverse=True):  # the largest first: the others find its prompts cached
                prompts = [prompt(i, n, args.shared) for i in range(bsz)]
                got: dict[str, float] = {}
                for r in range(args.rounds):
                    # the order alternates by round: the path run second was measured slower
                    # (q8_0 x8 depth 2048 --shared, kernel then blocks: 342 and 41 tok/s; blocks then
                    # kernel: 185 and 120; batch 8 figures swing with the order: see the report)
                    for path in paths if r % 2 == 0 else paths[::-1]:
                        use_path(path)
                        rate, _pre = decode_rate(eng, prompts, args.tokens, f"{depth}-{bsz}-{path}-{r}")
                        got[path] = max(got.get(path, 0.0), rate)
                use_path("kernel")
                lb = peer.get(depth)
                row = {"kind": kind, "depth": depth, "prompt": n, "batch": bsz, **got, "llama_bench": lb}
                rows.append(row)
                vs = "".join(f"  {p} {got[p] / lb:.2f}x" for p in paths if lb)
                mine = (
                    f"  kernel/blocks {got['kernel'] / got['blocks']:.2f}x"
                    if {"kernel", "blocks"} <= got.keys()
                    else ""
                )
                print(
                    f"  {kind:<5} depth {depth:>5} x{bsz}: "
                    + "  ".join(f"{p} {got[p]:7.1f} tok/s" for p in paths)
                    + mine
                    + f"  (load {os.getloadavg()[0]:.1f})"
                    + (f"  | llama-bench {lb:7.1f} tok/s  ours/theirs:{vs}" if lb else ""),
                    flush=True,
                )
        eng.close()
        del eng
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu["model_name"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
