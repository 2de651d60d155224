"""How a CPU die runs the linear layers: each way ("path") probed by running it, the fastest chosen
by timing it on the model's own shapes.

Which kernel is fastest depends on the instruction set and on the batch: on an AVX-512/AMX Xeon
oneDNN's prepacked bf16 weights stream at close to memory bandwidth at any batch; on an AVX2-only
EPYC the bf16 reorder raises, and plain bf16 is fine at one row but 10x slower at eight (no native
bf16 dot products), where fp32 wins. So nothing is assumed from flags or ``hasattr``:

- ``probe(name)`` runs the path once on a small tensor and checks the numbers against an fp32
  reference; a path that raises or is wrong is never used (``probe_all`` at worker start);
- ``choose(cfg, candidates)`` times the candidates that probe well on the model's linear shapes
  at 1 row (batch-1 decode) and 8 rows (a full batch), and keeps the one whose worse ratio to the
  best of each is smallest;
- ``apply(model, name)`` lays the loaded model out for that path.

``PANTHEON_CPU_PATH`` (``--cpu-path``) forces one, so every host runs the tests of every path it
can. The bytes each path allocates are what ``pantheon.models.sizing.estimate`` counts.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.models.description import ModelDescription
from pantheon.models.sizing import CPU_PATHS, cpu_path_names
from workers.cpu_pack import PackedLinear

if TYPE_CHECKING:
    from workers.models.base import DecoderLM
from workers.errors import LoadError
from workers.quant import Int4Linear, Int8Linear, int4_fits

AUTO = "auto"


@dataclass(frozen=True)
class PathSpec:
    name: str
    dtype: torch.dtype  # of the activations, the norms and the KV cache
    layout: str  # dense (F.linear) | packed (oneDNN prepacked) | int8 | int4 (weight-only)
    lossy: bool = False  # changes the weights: used only when a load asks to quantize


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# The table lives in pantheon.models.sizing (torch-free), so the router's estimate and the engine's
# layout can never disagree on what a path allocates.
PATHS: dict[str, PathSpec] = {
    name: PathSpec(name, _DTYPES[dt], layout, lossy) for name, (dt, layout, lossy) in CPU_PATHS.items()
}
_TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def forced_path() -> str | None:
    """The path ``PANTHEON_CPU_PATH`` forces, or None for auto. Raises on an unknown name."""
    raw = os.environ.get("PANTHEON_CPU_PATH", AUTO).strip() or AUTO
    if raw == AUTO:
        return None
    if raw not in PATHS:
        raise LoadError("invalid", f"PANTHEON_CPU_PATH={raw!r} is not one of auto, {', '.join(PATHS)}")
    return raw


def isa() -> str:
    """The vector ISA torch dispatches to here: avx512 | avx2 | default (or another arch's)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def make_linear(spec: PathSpec, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """One linear layer laid out for ``spec``. weight: [N, K] (any float dtype)."""
    w = weight.detach().to(spec.dtype)
    b = None if bias is None else bias.detach().to(spec.dtype)
    if spec.layout == "packed":
        return PackedLinear(w, b)
    if spec.layout == "int8":
        return Int8Linear(w, b)
    if spec.layout == "int4":  # a shape the int4 kernel does not take stays in int8 rows
        return Int4Linear(w, b) if int4_fits(*w.shape) else Int8Linear(w, b)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b, requires_grad=False)
    return lin


@functools.cache
def probe(name: str) -> str | None:
    """Run path ``name`` once on small tensors: None when it works, else why it does not."""
    spec = PATHS[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * 0.1  # [N, K]
    x = torch.randn(8, 64, generator=g)  # [M, K]
    bias = torch.randn(48, generator=g)
    ref = F.linear(x.to(spec.dtype).float(), w.to(spec.dtype).float(), bias.to(spec.dtype).float())
    try:
        with torch.inference_mode():
            lin = make_linear(spec, w, bias)
            got = torch.cat([lin(x[:1].to(spec.dtype)), lin(x.to(spec.dtype))]).float()
    except Exception as e:  # noqa: BLE001 - any failure means: not on this host
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    want = torch.cat([ref[:1], ref])
    tol = _TOLERANCE[spec.dtype] * (8 if spec.lossy else 1)
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= tol:  # also catches NaN
        return f"wrong results (relative error {err:.2g} > {tol:g})"
    return None


def probe_all() -> dict[str, str | None]:
    """Every path's probe result on this host: name -> None (works) or the reason it fails."""
    return {name: probe(name) for name in PATHS}


def candidates(
    *,
    quantize: bool,
    dtype: str = AUTO,
    forced: str | None = None,
    quantized_source: bool = False,
    int4_source: bool = False,
) -> list[str]:
    """The paths a load may use: the forced one alone, or every path that probes well and fits
    the load's ``quantize`` and ``dtype`` asks. Raises ``LoadError`` when none is left."""
    if forced:
        why = probe(forced)
        if why:
            raise LoadError(
                "unsupported",
                f"CPU path {forced!r} (PANTHEON_CPU_PATH) does not work on this host ({isa()}): {why}",
            )
        return [forced]
    if dtype == "float16":
        dtype = "bfloat16"  # fp16 matmuls are slow on CPUs; bf16 has the same size and more range
    works = {n: probe(n) or "" for n in PATHS}
    names = cpu_path_names(quantize, dtype, works, quantized_source, int4_source)
    if not names:
        raise LoadError(
            "unsupported", f"no CPU path works on this host ({isa()}) for quantize={quantize}, dtype={dtype}"
        )
    return names


def linear_shapes(cfg: ModelDescription) -> list[tuple[int, int, int]]:
    """(N, K, how many) of the model's linear layers (its description's, as the engine fuses
    them), the LM head last."""
    counts: dict[tuple[int, int], int] = {}
    for spec in cfg.layers:
        for nk in spec.linears:
            counts[nk] = counts.get(nk, 0) + 1
    return [(n, k, c) for (n, k), c in counts.items()] + [(cfg.vocab_size, cfg.hidden_size, 1)]


class _Bench:
    """One path's linear layers for the model's shapes, ready to time at 1 and 8 rows."""

    def __init__(self, name: str, shapes: list[tuple[int, int, int]]):
        spec = PATHS[name]
        g = torch.Generator().manual_seed(1)
        self.parts = []
        for i, (n, k, count) in enumerate(shapes):
            part = min(n, 8192)  # a very tall matrix (a large vocabulary's head): a slice, scaled
            s = head_spec(spec) if i == len(shapes) - 1 else spec  # the head is last
            lin = make_linear(s, torch.randn(part, k, generator=g) * 0.02, None)
            xs = {m: torch.randn(m, k, generator=g).to(spec.dtype) for m in (1, 8)}
            self.parts.append((lin, xs, count * n / part))

    def once(self, rows: int) -> float:
        """Seconds one step's linears take with ``rows`` rows, from one timed call per shape."""
        total = 0.0
        for lin, xs, weight in self.parts:
            t = time.perf_counter()
            lin(xs[rows])
            total += (time.perf_counter() - t) * weight
        return total


@dataclass
class Choice:
    name: str
    timings: dict[str, tuple[float, float]]  # path -> (seconds at 1 row, at 8 rows) per step


def choose(cfg: ModelDescription, names: list[str], rounds: int = 5, margin: float = 0.1) -> Choice:
    """The candidate whose worse ratio to the fastest (at 1 row and at 8 rows) is smallest.

    The candidates are timed in turns, ``rounds`` times each, keeping each one's best: a burst
    of other work on the cores then hurts them alike rather than deciding the choice. A path
    earlier in ``PATHS`` (fewer bytes) is kept unless a later one beats it by ``margin``.
    """
    if len(names) == 1:
        return Choice(names[0], {})
    shapes = linear_shapes(cfg)
    best = {n: [float("inf"), float("inf")] for n in names}
    with torch.inference_mode():
        benches = {n: _Bench(n, shapes) for n in names}
        for b in benches.values():  # warm up: first calls pick kernels and allocate
            b.once(1)
            b.once(8)
        for _ in range(rounds):
            for n, b in benches.items():
                best[n][0] = min(best[n][0], b.once(1))
                best[n][1] = min(best[n][1], b.once(8))
    timings = {n: (t[0], t[1]) for n, t in best.items()}
    best1 = min(t[0] for t in timings.values())
    best8 = min(t[1] for t in timings.values())

    def score(n: str) -> float:
        return max(timings[n][0] / best1, timings[n][1] / best8)

    name = names[0]
    for n in names[1:]:
        if score(n) * (1 + margin) < score(name):
            name = n
    return Choice(name, timings)


def replace_linears(module: nn.Module, make) -> None:
    """Swap every ``nn.Linear`` under ``module`` for ``make(weight, bias)``, in place."""
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, make(sub.weight, sub.bias))


def head_spec(spec: PathSpec) -> PathSpec:
    """How the path lays out the LM head: as its linears, but int4's head in int8 rows (a file's
    head or tied table is seldom stored in 4 bits: SmolLM2's Q4_1 file keeps it in Q8_0)."""
    return PATHS["int8"] if spec.layout == "int4" else spec


def apply(model: DecoderLM, name: str) -> None:
    """Lay a loaded model (in the path's dtype) out for path ``name``, in place.

    packed / int8 / int4: every decoder linear laid out so, and the LM head too (``head_spec``):
    a tied head gets its own copy (the embedding table stays plain for lookups), an untied one
    is replaced. dense: nothing to do.
    """
    spec = PATHS[name]
    if spec.layout == "dense":
        return
    for layer, dev in zip(model.layers, model.layer_devices):
        if dev.type == "cpu":
            replace_linears(layer, lambda w, b: make_linear(spec, w, b))
    if model.embed_tokens.weight.device.type == "cpu":
        model.lm_head = make_linear(head_spec(spec), model.head_weight(), None)
