"""Decode steps compiled with ``torch.compile`` (inductor's C++ backend on CPUs), in the background.

At 135M parameters a decode step is mostly the overhead of ~4,800 small eager ops, not the
weights' bytes: inductor fuses the norms, rotary, residuals and softmax into a few C++ loops
and runs the whole step without Python. Measured on SmolLM2-135M (2-core AMD EPYC Zen 5, int8
path): 10.4 against 13.0 ms per step at batch 1, 19 against 33.5 at batch 8
(``bench/decode.py --compile``). The price is the compile: ~115 s cold on 2 cores.

So it is on by default where a C++ compiler is found (``PANTHEON_COMPILE=0`` turns it off) and
never paid inside the load: the engine serves eager as soon as the weights are in, while a
thread of its own (at the lowest OS priority, so the step loop keeps its cores; inductor's C++
builds run as its children and inherit that) compiles the step on rows of one KV block set
aside for it. The runner switches when the compile is done, but trusts each graph only after
one real step ran both ways with the same logits (``check_logits``): that step returns the eager
logits, and the eager run goes second so its cache writes are the ones kept. A compile or a check
that fails leaves the engine eager; ``state`` says why (``/admin/dies``, ``/admin/models``).
A second load of the same model on the same machine takes its compiled graphs from the on-disk
cache (``workers/compile_cache.py``) and is compiled in seconds, not minutes.

Only pure decode steps run compiled (every sampled sequence one token, no prefill chunk): the
steady state. Steps with prefill chunks, prompt logits and other devices stay eager. Two graphs
are built: batch 1 (torch specialises size 1) and batch >= 2 with the batch and the context
length dynamic; a batch >= 2 always carries a padding bias (zeros when no row pads), so no third
variant appears. Once built, the graphs run in dynamo's run-only mode: inputs that would need a
new graph run the step eager instead (counted in ``fallbacks``) and never compile inside a step.

A quantized KV cache (``q8_0`` / ``q4_0``, workers/kernels/kv_quant.py) compiles too: the step
reads its rows through the gather, whose dequantize (int8 or nibbles times the fp16 block scale)
inductor fuses like the rest, and writes them quantized; the check above holds it to the eager
step on the same cache. Its types are part of the compile cache's key (a graph of their own).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from pantheon.core.kv_types import KvCacheTypes
from workers import cpu_paths
from workers.cache import LayerCache
from workers.compile_cache import CompileCache, entry_key
from workers.layers.attention import StepBatch
from workers.models.base import DecoderLM

log = logging.getLogger("pantheon.worker")

# The states ``state`` goes through: compiling -> checking (built, waiting for a real step to
# check it on) -> compiled (a graph checked; the other is checked on its first step); or
# "failed: why" from any of them; "off: why" when no compile was started.
OFF, COMPILING, CHECKING, COMPILED = "off", "compiling", "checking", "compiled"
FAILED = "failed"

# The check's tolerance, relative to the row's largest eager logit: a fused step differs from the
# eager one by rounding only (fp32: ~1e-5 of the scale; bf16 and the int8 path, whose activations
# round to 8 bits, ~1e-2), while a wrong graph (a stale cache entry, a wrong cache row) is off by
# the order of the logits themselves. 0.1 sits between the two with a margin of ~5x either side
# on the models measured (tests/unit/test_compile_background.py prints the figures).
REL_TOLERANCE = 0.1

# The compile thread's OS priority (nice): the lowest, so that the step loop keeps the cores. On
# a host loaded by others it starves the compile (minutes become tens of minutes): tests and
# benches on a shared machine set 0.
NICE = 19

# CPU path layouts inductor fails on, after minutes of tracing (torch 2.13): not started
UNLOWERED = {
    "packed": "inductor cannot lower its oneDNN prepacked linears (mkldnn._linear_pointwise)",
}

# One compile at a time in a process: two would fight over two cores, and inductor's cache
# folder (ours per entry) is an environment variable
_ONE_AT_A_TIME = threading.Lock()


def compiler() -> str | None:
    """The C++ compiler inductor would run (``CXX``, else c++ / g++ / clang++), or None."""
    for name in (os.environ.get("CXX", "").strip(), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def wanted() -> bool:
    """On unless ``PANTHEON_COMPILE`` says 0 / false / off / no."""
    return os.environ.get("PANTHEON_COMPILE", "").strip().lower() not in ("0", "false", "off", "no")


def check_logits(compiled: torch.Tensor, eager: torch.Tensor, rel: float = REL_TOLERANCE) -> str | None:
    """None when ``compiled`` matches ``eager`` ([B, V] fp32 logits of one step), else why not."""
    if compiled.shape != eager.shape:
        return f"logits of shape {tuple(compiled.shape)} against {tuple(eager.shape)}"
    c, e = compiled.float(), eager.float()
    finite = torch.isfinite(e)
    if not torch.equal(torch.isfinite(c), finite):
        return "non-finite logits where the eager step has finite ones"
    diff = torch.where(finite, (c - e).abs(), torch.zeros_like(e)).amax(dim=-1)  # [B]
    scale = torch.where(finite, e.abs(), torch.zeros_like(e)).amax(dim=-1).clamp_min(1.0)
    worst = float((diff / scale).max())
    if worst > rel:
        return f"logits differ from the eager step's by {worst:.3g} of their scale (limit {rel})"
    return None


class CompiledDecode:
    """``fn(input_ids, batch, eager) -> fp32 logits [B, vocab]`` for pure decode batches, or
    None while not ready (or for inputs the built graphs do not cover): run eager then."""

    def __init__(
        self,
        model: DecoderLM,
        caches: list[LayerCache],
        cache: CompileCache | None = None,
        key: str | None = None,
        rel_tolerance: float = REL_TOLERANCE,
    ):
        self.model, self.caches = model, caches
        self.device = model.embed_device
        self.cache, self.key, self.rel = cache, key, rel_tolerance
        self.state = COMPILING
        self.error: str | None = None
        self.seconds = 0.0  # from start to compiled (or failed), the check excluded
        self.cache_note = "off" if cache is None or key is None else ""  # "hit" / "miss" once known
        self.fallbacks = 0  # calls the built graphs did not cover, which ran eager instead
        self.checked: set[bool] = set()  # the graphs (batch > 1?) checked on a real step
        self.closed = False
        self._built = False  # set by the compile thread once both graphs exist
        self._release: Callable[[], None] | None = None
        self._done = threading.Event()

        def step(ids, rot_cos, rot_sin, slots, gather, bias):
            if not torch.compiler.is_compiling():  # folded away in the graphs: counts eager runs
                self.fallbacks += 1
            b = StepBatch(rot_cos, rot_sin, slots, ids.shape[0], gather, bias, [])
            return model.logits(model(ids, {self.device: b}, caches))

        self._fn = torch.compile(step, dynamic=True)
        self._run: Callable[..., torch.Tensor] | None = None

    # ------------------------------------------------------------ building (the compile thread)

    def start(
        self,
        make_tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        read_rows: int,
        write_rows: list[int],
        release: Callable[[], None] | None = None,
        background: bool = True,
    ) -> None:
        """Build both graphs, on a low-priority thread unless ``background`` is False.
        ``write_rows`` are KV rows nobody else uses until ``release`` is called (from the
        thread that steps the engine, after the build); ``read_rows`` bounds the rows read."""
        self._release = release
        self._t0 = time.monotonic()
        if not background:
            self._build(make_tables, read_rows, write_rows)
            return
        threading.Thread(
            target=self._build, args=(make_tables, read_rows, write_rows), name="compile", daemon=True
        ).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ended (compiled or failed); False on timeout."""
        return self._done.wait(timeout)

    def _build(self, make_tables, read_rows: int, write_rows: list[int]) -> None:
        try:  # the lowest priority for this thread and what it spawns (Linux: per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        try:
            self._build_graphs(make_tables, read_rows, write_rows)
            self._run = torch._dynamo.run(self._fn)  # built graphs only, never a new compile
            self._built = True
            self.state = CHECKING  # until a real step ran both ways
            self.seconds = time.monotonic() - self._t0
            log.info("decode step compiled in %.1f s (compile cache: %s)", self.seconds, self.cache_note)
            self._save()
        except Exception as e:  # noqa: BLE001 - any compile failure means: stay eager
            self.seconds = time.monotonic() - self._t0
            self._fail(_why(e))
        finally:
            self._done.set()

    def _build_graphs(self, make_tables, read_rows: int, write_rows: list[int]) -> None:
        # Without duck sizing a context length that happens to equal another size (a stride,
        # the batch) is not fused with it into a guard that the next step breaks.
        from torch._inductor import config as inductor_config
        from torch.fx.experimental import _config as fx_config

        fx_config.use_duck_shape = False
        # C++ builds in this thread's children (so at its priority), not in a pool of workers
        inductor_config.compile_threads = 1
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        folder = None
        if self.cache is not None and self.key:
            try:
                folder, hit = self.cache.open(self.key)
                self.cache_note = "hit" if hit else "miss"
            except OSError as e:  # an unwritable cache: compile without it
                log.warning("compile cache: cannot use %s: %s", self.cache.folder, e)
                self.cache_note = "off"
        with _ONE_AT_A_TIME:
            if folder is None:
                self._trace(make_tables, read_rows, write_rows)
                return
            with temporary_cache_dir(str(folder)):  # the variable is process-wide: one at a time
                self._trace(make_tables, read_rows, write_rows)

    def _trace(self, make_tables, read_rows: int, write_rows: list[int]) -> None:
        with torch.inference_mode():
            for bsz, t in ((1, 19), (3, 23)):
                if self.closed:
                    raise RuntimeError("the engine was closed")
                pos = torch.full((bsz,), t - 1, device=self.device)
                cos, sin = make_tables(pos)
                # fresh tensors with standard strides, as the runner builds them
                gather = torch.arange(bsz * t, device=self.device).view(bsz, t) % read_rows
                rows = [write_rows[i % len(write_rows)] for i in range(bsz)]
                gather[:, -1] = torch.tensor(rows)
                slots = torch.tensor(rows, device=self.device)
                self._call(
                    self._fn,
                    torch.zeros(bsz, dtype=torch.long, device=self.device),
                    StepBatch(cos, sin, slots, bsz, gather, None, []),
                )

    def _save(self) -> None:
        if self.cache is not None and self.key and self.cache_note == "miss":
            self.cache.finish(self.key)

    def _fail(self, why: str) -> None:
        self.error = why
        self.state = f"{FAILED}: {why}"
        self._run = None
        log.warning("compiled decode step left eager: %s", why)

    # ------------------------------------------------------------ serving (the step thread)

    def _call(self, fn, input_ids: torch.Tensor, b: StepBatch) -> torch.Tensor:
        assert b.decode_gather is not None  # a decode batch has its gather
        bias = b.decode_bias
        if input_ids.shape[0] > 1 and bias is None:  # one graph for every batch >= 2
            bias = torch.zeros(
                b.decode_gather.shape[0],
                1,
                1,
                b.decode_gather.shape[1],
                dtype=torch.float32,
                device=self.device,
            )
        # Standard strides: the runner's gather is a slice whose row stride changes with the
        # context (and .contiguous() keeps it when there is one row, which is "contiguous")
        g = b.decode_gather
        if g.stride(0) != g.shape[1]:
            g = g.flatten().clone().view(g.shape)
        return fn(input_ids, b.rot_cos, b.rot_sin, b.slot_mapping, g, bias)

    def __call__(
        self, input_ids: torch.Tensor, b: StepBatch, eager: Callable[[], torch.Tensor]
    ) -> torch.Tensor | None:
        """The step's logits, or None: not built yet (or failed), or inputs that would need a
        new graph; the caller runs the step eager then. A graph not checked yet runs this step
        both ways (``eager`` computes the eager logits) and returns the eager logits."""
        if self._release is not None and self._done.is_set():  # the build's KV rows go back to the pool
            self._release()
            self._release = None
        run = self._run
        if run is None or not self._built:
            return None
        multi = input_ids.shape[0] > 1
        if multi in self.checked:
            before = self.fallbacks
            out = self._call(run, input_ids, b)
            if self.fallbacks != before and self.fallbacks in (1, 10, 100, 1000):
                log.warning(
                    "compiled decode step did not cover these inputs (%d so far): ran eager", self.fallbacks
                )
            return out
        try:
            got = self._call(run, input_ids, b)
        except Exception as e:  # noqa: BLE001 - a graph that cannot run is a failed compile
            self._fail(f"the compiled step raised {_why(e)}")
            return None
        want = eager()  # second, so that the eager step's KV writes are the ones kept
        why = check_logits(got, want, self.rel)
        if why is not None:
            self._fail(f"check against the eager step failed: {why}")
        else:
            self.checked.add(multi)
            if self.state == CHECKING:
                self.state = COMPILED
                log.info("compiled decode step checked against the eager step: switched to it")
        return want

    def close(self) -> None:
        """The engine is gone: a build still running stops at its next graph, its result unused."""
        self.closed = True
        self._run = None


def _why(e: BaseException) -> str:
    """One line of at most 300 characters: the exception's type and its message's first lines
    (inductor's first line alone is often just "LoweringException: AssertionError:")."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text}"[:300]


class NotCompiled:
    """The compile state of an engine that does not compile its decode step (``state``: why)."""

    def __init__(self, why: str):
        self.state = f"{OFF}: {why}" if why else OFF
        self.seconds = 0.0
        self.cache_note = ""
        self.fallbacks = 0

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


class Runner(Protocol):
    """What ``start`` needs of the model runner (workers/runner.py)."""

    kv_types: KvCacheTypes
    native: bool  # decode steps run each layer as one native call (not the graph)

    def compile_decode(
        self, cache: CompileCache | None, key: str | None, background: bool
    ) -> CompiledDecode | str: ...


def start(
    runner: Runner,
    model_path: str,
    layout: Mapping[str, object],
    want: bool | None = None,
    background: bool = True,
) -> CompiledDecode | NotCompiled:
    """Start compiling ``runner``'s decode step when wanted (``want``, else ``PANTHEON_COMPILE``)
    and a C++ compiler is here; the compile state either way. ``layout``: what the compiled code
    depends on besides the model files (the cache key, ``compile_cache.entry_key``)."""
    if not (wanted() if want is None else want):
        return NotCompiled("PANTHEON_COMPILE=0")
    if compiler() is None:
        return NotCompiled("no C++ compiler found (CXX, c++, g++, clang++)")
    if runner.native:
        return NotCompiled(
            "every decode step runs each layer as one native call (workers/layers/decode_layer.py), "
            "faster than the compiled graph"
        )
    spec = cpu_paths.PATHS.get(str(layout.get("cpu_path")))
    if spec is not None and spec.layout in UNLOWERED:
        return NotCompiled(f"the {spec.name} CPU path: {UNLOWERED[spec.layout]}")
    cache = CompileCache()
    key = None
    if runner.kv_types.quantized:  # other graphs (a dequantize in each read): their own entry;
        layout = {**layout, "kv": str(runner.kv_types)}  # a full-width cache keeps its old key
    if cache.limit > 0:
        try:
            key = entry_key(
                model_path,
                {
                    **layout,
                    "torch": torch.__version__,
                    "isa": torch.backends.cpu.get_cpu_capability(),
                    "compiler": compiler(),
                },
            )
        except OSError as e:
            log.warning("compile cache: no key for %s: %s", model_path, e)
    got = runner.compile_decode(cache if key else None, key, background)
    return NotCompiled(got) if isinstance(got, str) else got
