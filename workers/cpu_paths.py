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
  best of each is smallest; rounds disturbed by other work on the cores (seen by a reference op
  timed between the candidates) are discarded and retimed, and when no clean timing can be had
  the first candidate in ``PATHS`` order is kept (``Choice.note`` says so);
- ``apply(model, name)`` lays the loaded model out for that path.

``PANTHEON_CPU_PATH`` (``--cpu-path``) forces one, so every host runs the tests of every path it
can. The bytes each path allocates are what ``pantheon.core.sizing.estimate`` counts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pantheon.core.description import ModelDescription
from pantheon.core.sizing import CPU_PATHS, cpu_path_names, experts_layout
from workers.cpu_pack import PackedLinear

if TYPE_CHECKING:
    from workers.models.base import DecoderLM
from workers.errors import LoadError
from workers.layers.block_embedding import BlockEmbedding
from workers.layers.moe import MoE
from workers.quant import Int4Linear, Int8Linear, grid_groups, int4_fits, replace_linears

AUTO = "auto"


@dataclass(frozen=True)
class PathSpec:
    name: str
    dtype: torch.dtype  # of the activations, the norms and the KV cache
    layout: str  # dense (F.linear) | packed (oneDNN prepacked) | int8 | int4 (weight-only)
    lossy: bool = False  # changes the weights: used only when a load asks to quantize


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
# The table lives in pantheon.core.sizing (torch-free), so the router's estimate and the engine's
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


def file_int4_linear(spec: PathSpec, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A 4-bit file's linear on the int4 path: in int4 groups on its own levels when every group
    of 32 is on a 4-bit grid (``quant.grid_groups``: Q4_0 / Q4_1 / Q4_K), else in int8 rows (the
    Q5_K / Q6_K / Q8_0 tensors a Q4_K_M file mixes in, or fused matrices holding one: 4-bit
    groups would lose what those bits keep). weight: [N, K] in the path's dtype."""
    if spec.layout == "int4" and int4_fits(*weight.shape):
        w = weight.detach().to(spec.dtype)
        packed = grid_groups(w)
        if packed is not None:
            return Int4Linear(w, None if bias is None else bias.detach().to(spec.dtype), packed)
        return make_linear(dataclasses.replace(PATHS["int8"], dtype=spec.dtype), weight, bias)
    return make_linear(spec, weight, bias)


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
    # a lossy layout's error is its quantization's, whatever the dtype around it
    tol = _TOLERANCE[torch.bfloat16] * 8 if spec.lossy else _TOLERANCE[spec.dtype]
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


def mxfp4_experts(cfg: ModelDescription) -> bool:
    """Whether the model's routed experts are stored as MXFP4 (gpt-oss)."""
    return any(s.experts is not None and s.experts.mxfp4 for s in cfg.layers)


def experts_spec(spec: PathSpec, mxfp4: bool) -> PathSpec:
    """How path ``spec`` holds a mixture of experts' routed experts (``sizing.experts_layout``):
    as its linears (prepacked, int8 rows, int4 groups, or dense). MXFP4 experts are held as they
    ship on every path (``MoE(mxfp4=True)``, the MXFP4 kernel): ``spec``, unused for them."""
    layout = experts_layout(spec.layout, DTYPE_NAMES[spec.dtype], mxfp4)
    if layout in (spec.layout, "mxfp4") or probe(layout):
        return spec
    return PathSpec(spec.name, spec.dtype, layout, True)


def quantized_experts(name: str, cfg: ModelDescription) -> str | None:
    """The layout ("int8" / "int4") path ``name`` quantizes a mixture of experts' routed experts
    into (``experts_spec``): a load may quantize them as they arrive (``loader.load_model``'s
    ``experts``). None where it holds them otherwise (prepacked, dense, MXFP4 as they ship)."""
    if mxfp4_experts(cfg):
        return None
    layout = experts_spec(PATHS[name], False).layout
    return layout if layout in ("int8", "int4") else None


def expert_shapes(cfg: ModelDescription) -> list[tuple[int, int, int]]:
    """(N, K, how many) of the routed experts one token runs per step (a mixture of experts'
    ``top_k`` per layer: gate/up and down), run as the path holds them (``experts_spec``)."""
    counts: dict[tuple[int, int], int] = {}
    for spec in cfg.layers:
        if spec.experts is not None:
            e = spec.experts
            for nk in ((2 * e.intermediate, e.hidden), (e.hidden, e.intermediate)):
                counts[nk] = counts.get(nk, 0) + e.top_k
    return [(n, k, c) for (n, k), c in counts.items()]


class _Bench:
    """One path's linear layers for the model's shapes, ready to time at 1 and 8 rows; a mixture
    of experts' routed experts (``experts``) as the path runs them."""

    def __init__(self, name: str, shapes: list[tuple[int, int, int]], experts=(), mxfp4: bool = False):
        spec = PATHS[name]
        # experts as the path holds them (MoE.lay_out, MoE.quantize): the same kernels as linears
        held = experts_spec(spec, mxfp4)
        g = torch.Generator().manual_seed(1)
        self.parts = []
        for i, (n, k, count) in enumerate(shapes):
            part = min(n, 8192)  # a very tall matrix (a large vocabulary's head): a slice, scaled
            s = head_spec(spec) if i == len(shapes) - 1 else spec  # the head is last
            lin = make_linear(s, torch.randn(part, k, generator=g) * 0.02, None)
            xs = {m: torch.randn(m, k, generator=g).to(spec.dtype) for m in (1, 8)}
            self.parts.append((lin, xs, count * n / part))
        for n, k, count in () if mxfp4 else experts:  # MXFP4's: one kernel on every path
            lin = make_linear(held, torch.randn(n, k, generator=g) * 0.02, None)
            xs = {m: torch.randn(m, k, generator=g).to(spec.dtype) for m in (1, 8)}
            self.parts.append((lin, xs, float(count)))

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
    note: str = ""  # why the choice is not the timings' verdict (disturbed timings), else ""


# A fixed op of known cost timed between the candidates in every round: when it runs much slower
# than its best, other work held the cores, and the candidate timed next to it is not believed.
_REF_SHAPE = (64, 1024, 1024)  # [M, K] @ [K, N] in fp32: about 0.13 GFLOP, ~1 ms on two cores
_DISTURBED = 2.5  # a reference this many times its best marks its neighbours disturbed
# ...and one slower than any CPU torch runs on does it (1 GFLOP/s): the whole timing was disturbed
_REF_CAP = 2 * _REF_SHAPE[0] * _REF_SHAPE[1] * _REF_SHAPE[2] / 1e9
_CLEAN_NEEDED = 2  # clean samples each candidate needs before its timing is believed
_MORE_ROUNDS = 2  # retime up to this many times ``rounds`` more rounds when samples are disturbed


class _Reference:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        m, k, n = _REF_SHAPE
        self.a = torch.randn(m, k, generator=g)
        self.b = torch.randn(k, n, generator=g)

    def once(self) -> float:
        t = time.perf_counter()
        torch.mm(self.a, self.b)
        return time.perf_counter() - t


def choose(cfg: ModelDescription, names: list[str], rounds: int = 5, margin: float = 0.1) -> Choice:
    """The candidate whose worse ratio to the fastest (at 1 row and at 8 rows) is smallest.

    The candidates are timed in turns, ``rounds`` times each, keeping each one's best: a burst
    of other work on the cores then hurts them alike rather than deciding the choice. Work that
    holds the cores for longer (another model serving while this one loads) is seen by a fixed
    reference op timed between the candidates in each round: a candidate's sample whose
    neighbouring reference ran much slower than the reference's best (or slower than any CPU
    runs it: the whole timing was disturbed) is discarded, and more
    rounds are timed while too few clean samples are left. When a candidate still has no clean
    sample the timings are not trusted and the first candidate (``PATHS`` order: fewest bytes,
    the path a quiet host picks most often) is kept, said in ``Choice.note``. A path earlier in
    ``PATHS`` (fewer bytes) is kept unless a later one beats it by ``margin``.
    """
    if len(names) == 1:
        return Choice(names[0], {})
    shapes = linear_shapes(cfg)
    # samples[n]: (seconds at 1 row, at 8 rows, the slower reference timed next to them)
    samples: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    refs: list[float] = []
    needed = max(1, min(_CLEAN_NEEDED, rounds))

    def clean(n: str) -> list[tuple[float, float, float]]:
        limit = min(min(refs) * _DISTURBED, _REF_CAP)
        return [s for s in samples[n] if s[2] <= limit]

    with torch.inference_mode():
        benches = {n: _Bench(n, shapes, expert_shapes(cfg), mxfp4_experts(cfg)) for n in names}
        ref = _Reference()
        ref.once()
        for b in benches.values():  # warm up: first calls pick kernels and allocate
            b.once(1)
            b.once(8)
        done = 0
        while True:
            before = ref.once()
            refs.append(before)
            for n, b in benches.items():
                t1, t8 = b.once(1), b.once(8)
                after = ref.once()
                refs.append(after)
                samples[n].append((t1, t8, max(before, after)))
                before = after
            done += 1
            if done < rounds:
                continue
            if done >= rounds * (1 + _MORE_ROUNDS) or all(len(clean(n)) >= needed for n in names):
                break

    def best(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
        return (min(r[0] for r in rows), min(r[1] for r in rows))

    kept = {n: clean(n) for n in names}
    discarded = sum(len(samples[n]) - len(kept[n]) for n in names)
    total = sum(len(samples[n]) for n in names)
    if any(not rows for rows in kept.values()):
        timings = {n: best(kept[n] or samples[n]) for n in names}
        note = (
            f"timings disturbed by other work on the cores ({discarded} of {total} samples, "
            f"{done} rounds): kept {names[0]}, the first candidate in the static order"
        )
        return Choice(names[0], timings, note)
    timings = {n: best(kept[n]) for n in names}
    best1 = min(t[0] for t in timings.values())
    best8 = min(t[1] for t in timings.values())

    def score(n: str) -> float:
        return max(timings[n][0] / best1, timings[n][1] / best8)

    name = names[0]
    for n in names[1:]:
        if score(n) * (1 + margin) < score(name):
            name = n
    note = f"{discarded} of {total} samples discarded as disturbed ({done} rounds)" if discarded else ""
    return Choice(name, timings, note)


def head_spec(spec: PathSpec) -> PathSpec:
    """How the path lays out the LM head: as its linears, but int4's head in int8 rows in the
    path's dtype (a file's head or tied table is seldom stored in 4 bits: SmolLM2's Q4_1 file
    keeps it in Q8_0)."""
    return dataclasses.replace(PATHS["int8"], dtype=spec.dtype) if spec.layout == "int4" else spec


def lays_out_head(name: str | None) -> bool:
    """Whether CPU path ``name`` lays the LM head out on its own (every path but ``dense``, whose
    tied head is the token table itself): then a GGUF's quantized table and untied head may be
    read as their blocks (``loader.load_model``'s ``embed_blocks``)."""
    return name is not None and PATHS[name].layout != "dense"


def apply(
    model: DecoderLM, name: str, cfg: ModelDescription | None = None, laid_out: Container[int] = ()
) -> None:
    """Lay a loaded model (in the path's dtype) out for path ``name``, in place.

    packed / int8 / int4: every decoder linear laid out so, and the LM head too (``head_spec``):
    ``laid_out``: the layers laid out already (by the loader's ``on_layer``, as they were read);
    a tied head gets its own copy (the embedding table stays plain for lookups), an untied one
    is replaced. dense: nothing to do. A mixture of experts' routed experts as ``experts_spec``
    says (``cfg``: the model's description, whose experts may be stored as MXFP4): prepacked one
    by one, or quantized into stacks (MXFP4 experts stay as they are).
    """
    spec = PATHS[name]
    for i, (layer, dev) in enumerate(zip(model.layers, model.layer_devices)):
        if dev.type == "cpu" and i not in laid_out:
            lay_out(layer, name, cfg)
    if lays_out_head(name) and model.embed_device.type == "cpu":
        model.lm_head = head_linear(spec, model)


def head_linear(spec: PathSpec, model: DecoderLM) -> nn.Module:
    """The model's LM head laid out for ``spec`` (``head_spec``). A head held as its blocks
    (``BlockEmbedding``: a token table it is tied to, or an untied head's own) is made in int8
    rows from the blocks (``BlockEmbedding.int8_rows``: the same rows as from the unpacked
    table, which is never made whole); other layouts take the dense weight (a transient unpacked
    copy for such a table)."""
    hs = head_spec(spec)
    table = model.embed_tokens if model.lm_head is None else model.lm_head  # (an untied head's own)
    if isinstance(table, BlockEmbedding) and hs.layout == "int8":
        return Int8Linear(table.int8_rows(hs.dtype), None)
    return make_linear(hs, model.head_weight(), None)


def lay_out(module: nn.Module, name: str, cfg: ModelDescription | None = None) -> None:
    """Lay the linears under ``module`` (a decoder layer, or the parts of a multi-token-prediction
    head: ``workers/mtp.py``) out for path ``name``, in place; its mixtures of experts as
    ``apply`` says. Modules that are no ``nn.Linear`` (a head laid out already) stay."""
    spec = PATHS[name]
    held = experts_spec(spec, cfg is not None and mxfp4_experts(cfg))
    if spec.layout == "int4" and cfg is not None and cfg.int4_source:  # a 4-bit file's own grids
        replace_linears(module, lambda w, b: file_int4_linear(spec, w, b))
    elif spec.layout != "dense":  # (float weights forced onto int4: groups fitted to them)
        replace_linears(module, lambda w, b: make_linear(spec, w, b))
    for m in module.modules():
        if not isinstance(m, MoE):
            continue
        if held.layout == "packed":
            m.lay_out(lambda w: make_linear(spec, w, None))
        elif held.layout in ("int8", "int4"):
            m.quantize(held.layout)
