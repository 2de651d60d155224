"""Decode steps replayed as CUDA graphs (workers/cuda_graphs.py).

On the CPU the graphs are not captured but their static-buffer step runs eagerly
(``cuda_graphs=True`` on a CPU die): the padding rows, the one buffer of inputs, the sizes, the
checks and the fallbacks are what a GPU runs; only the capture is left to the ``gpu`` tests.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pantheon.core.protocol import SamplingParams
from workers import cuda_graphs
from workers.cuda_graphs import DecodeGraphs, graph_sizes
from workers.engine import Engine
from workers.models.base import rounded

# Prompts of several lengths and answers of several lengths: the batch shrinks from 5 rows to 1
# (graphs of 8, 4, 2 and 1 rows, padded), contexts cross block boundaries (block_size 16).
PROMPTS = [[5, 17, 300, 41], list(range(100, 160)), [64], [3, 1, 4, 1, 5, 9, 2, 6], [9] * 20]
LENGTHS = [40, 7, 23, 3, 31]


def tokens(path, graphs: bool, dtype: str = "float32", **kw) -> tuple[dict[str, list[int]], Engine]:
    eng = Engine(
        str(path),
        dtype=dtype,
        kv_budget_bytes=4 << 20,
        compile_decode=False,
        cuda_graphs=graphs,
        num_slots=6,
        **kw,
    )
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        eng.submit(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out, eng


def same_tokens(path, **kw) -> DecodeGraphs:
    """The graphs' engine gives the eager engine's tokens: its graphs."""
    want, _ = tokens(path, graphs=False, **kw)
    got, eng = tokens(path, graphs=True, **kw)
    assert got == want
    assert isinstance(eng.compiler, DecodeGraphs), eng.compiler.state
    return eng.compiler


def test_graph_sizes():
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 4]
    assert graph_sizes(4) == [1, 2, 4]
    assert graph_sizes(6) == [1, 2, 4, 8]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(9) == [1, 2, 4, 8, 16]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_graph_steps_give_the_eager_tokens(model_factory, monkeypatch, kernel):
    """Every size the batch shrinks through, padded, gives the eager engine's greedy tokens;
    with the paged kernel (the table read in place) and without it (the graph's gather)."""
    monkeypatch.setenv("PANTHEON_ATTN_KERNEL", kernel)
    path = model_factory("tiny-llama", dtype="float32")
    g = same_tokens(path)
    assert g.state.startswith("graphs: batch 1,2,4,8")
    assert g.kernel == (kernel == "1")
    assert g.checked == {8, 4, 2, 1}  # each size checked against the eager step once
    # every step but the first (the prefills) is a pure decode step: one replay each
    assert g.replays == max(LENGTHS) - 1
    assert g.fallbacks == 0


def test_a_capture_that_fails_leaves_the_runner_eager_and_its_blocks_free(model_factory):
    """Capturing on a CPU die fails (no CUDA stream): the runner says why, stays eager, and the
    padding block goes back to the pool."""
    path = model_factory("tiny-llama", dtype="float32")
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=4 << 20, compile_decode=False)
    free = eng.blocks.num_free
    got = eng.runner.capture_graphs(eng.max_model_len, capture=True)
    assert isinstance(got, str) and got.startswith("capture failed: "), got
    assert eng.runner.graphs is None and eng.blocks.num_free == free


def test_closing_the_engine_lets_its_graphs_go(model_factory):
    """The worker frees a closed engine's memory while still holding the engine (gc, then the
    die's empty_cache): the graphs (the model, the caches, the graphs' pool) must go with close."""
    path = model_factory("tiny-llama", dtype="float32")
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=4 << 20, compile_decode=False, cuda_graphs=True)
    assert isinstance(eng.compiler, DecodeGraphs)
    gone = weakref.ref(eng.compiler)
    eng.close()
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-moe"])
def test_other_architectures_give_the_eager_tokens(model_factory, preset):
    """Qwen3 (q/k norms) and a mixture of experts (its groups counted on the device: nothing in
    its step reads a value back to the host on CUDA)."""
    path = model_factory(preset, dtype="float32")
    g = same_tokens(path)
    assert g.checked == {8, 4, 2, 1} and g.fallbacks == 0


def test_contexts_past_the_graphs_step_eagerly(model_factory, monkeypatch):
    """Without the kernel the graphs' tables are GATHER_CONTEXT wide: longer contexts run the
    eager step, with the same tokens, and come back to the graphs when the batch allows."""
    monkeypatch.setenv("PANTHEON_ATTN_KERNEL", "0")
    monkeypatch.setattr(cuda_graphs, "GATHER_CONTEXT", 48)
    path = model_factory("tiny-llama", dtype="float32")
    g = same_tokens(path)
    assert g.max_context == 48 and g.width == 3
    assert g.fallbacks > 0 and g.replays > 0


def test_the_padding_block_is_held_then_freed(model_factory):
    path = model_factory("tiny-llama", dtype="float32")
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=4 << 20, compile_decode=False, cuda_graphs=True)
    assert isinstance(eng.compiler, DecodeGraphs)
    total = eng.blocks.num_blocks
    assert eng.blocks.num_free == total - 1
    eng.compiler.close()
    assert eng.blocks.num_free == total


def test_recurrent_layers_replay_through_their_slots(model_factory):
    """Qwen3.5 (Gated DeltaNet layers beside attention): each row's state through its static
    slot, the padding rows' through the scratch slot; the eager engine's tokens."""
    path = model_factory("tiny-qwen3.5-text", dtype="float32")
    g = same_tokens(path)
    # (prompts are cut at block boundaries for the state checkpoints: the second step still
    # prefills two prompts' tails beside three decode rows, so one step fewer is pure decode)
    assert g.checked == {8, 4, 2, 1} and g.replays == max(LENGTHS) - 2 and g.fallbacks == 0


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gpt-oss", "tiny-gemma4"])
def test_sliding_window_models_read_their_rings_in_the_graph(model_factory, preset):
    """Gemma 3 (its local RoPE), gpt-oss (sinks) and Gemma 4 (KV sharing): the rings' views built
    from the static slots and lengths give the eager engine's tokens, contexts past the window."""
    g = same_tokens(model_factory(preset, dtype="float32"))
    assert g.windows and g.checked == {8, 4, 2, 1} and g.fallbacks == 0
    assert len(PROMPTS[1]) > max(g.windows), g.windows  # (a 60-token prompt: past every window)


def test_off_by_default_on_a_cpu_die(model_factory):
    path = model_factory("tiny-llama", dtype="float32")
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=4 << 20, compile_decode=False)
    assert eng.runner.graphs is None


@pytest.mark.gpu
def test_captured_graphs_give_the_eager_tokens_on_cuda(model_factory, monkeypatch):
    """On cuda:0: captured, replayed, the eager engine's tokens (fp32; bf16 decodes too)."""
    path = model_factory("tiny-llama", dtype="float32")
    g = same_tokens(path, devices=["cuda:0"])
    assert g.replays == max(LENGTHS) - 1 and g.fallbacks == 0
    bf, eng = tokens(model_factory("tiny-llama"), graphs=True, devices=["cuda:0"], dtype="bfloat16")
    assert isinstance(eng.compiler, DecodeGraphs), eng.compiler.state
    assert all(len(v) == n for v, n in zip(bf.values(), LENGTHS))


@pytest.mark.gpu
def test_hybrid_and_expert_models_capture_on_cuda(model_factory):
    """Qwen3.5 (recurrent states through static slots; FLA's kernels when installed), gpt-oss and
    Gemma 3 (sliding windows' rings) give the eager tokens in fp32; a mixture of experts in bf16 (torch's grouped GEMM, nothing read back
    to the host) captures, passes each size's check and decodes."""
    for preset in ("tiny-qwen3.5-text", "tiny-gpt-oss", "tiny-gemma3"):  # (rings: sliding windows)
        g = same_tokens(model_factory(preset, dtype="float32"), devices=["cuda:0"])
        assert g.fallbacks == 0, preset
    out, eng = tokens(model_factory("tiny-qwen3-moe"), graphs=True, devices=["cuda:0"], dtype="bfloat16")
    assert isinstance(eng.compiler, DecodeGraphs), eng.compiler.state
    assert not eng.compiler.state.startswith("failed"), eng.compiler.state
    assert eng.compiler.checked == {8, 4, 2, 1}
    assert all(len(v) == n for v, n in zip(out.values(), LENGTHS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_rounded_scale_multiplies_as_its_tensor_did(dtype):
    """Gemma's embedding scales multiply by ``rounded(x, dtype)`` (a Python float), not by a 0-dim
    tensor made on the device each step (a host-to-device copy, refused inside a capture): the
    products are the same to the bit."""
    a = torch.randn(257, 64).to(dtype)
    for x in (24.0**0.5, 1536**0.5, 33.3):
        assert torch.equal(a * torch.tensor(x).to(dtype), a * rounded(x, dtype))


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value back to the host or copy host data to the device:
    inside a CUDA graph's capture each is refused (or waits for the device, which a replay
    cannot), so a step that dispatches one cannot be captured."""

    FORBIDDEN = ("lift_fresh", "item", "_local_scalar_dense", "is_nonzero", "nonzero", "bincount")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.FORBIDDEN:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "preset", ["tiny-llama", "tiny", "tiny-qwen3.5-text", "tiny-gemma3", "tiny-gpt-oss", "tiny-gemma4"]
)
def test_the_graph_step_never_reads_the_host(model_factory, monkeypatch, preset):
    """The step a graph holds, run here through torch's own layers (the native CPU layers off,
    attention by the torch gather), dispatches no op that a capture would refuse: what a CUDA die
    captures is this code. (A mixture of experts is left out: on the CPU, and in fp32 on CUDA,
    its experts loop over the counts read back; bf16 on CUDA takes the grouped GEMM instead.)
    The gated-delta step's C kernel is one of those CPU layers (it checks its slots on the host)."""
    monkeypatch.setenv("PANTHEON_ATTN_KERNEL", "0")
    monkeypatch.setenv("PANTHEON_GDN_KERNEL", "0")
    eng = Engine(
        str(model_factory(preset, dtype="float32")),
        dtype="float32",
        kv_budget_bytes=8 << 20,
        compile_decode=False,
        cuda_graphs=True,
        num_slots=6,
    )
    eng.model.fused_layers = None  # (the CPU's native layers: a CUDA die runs the torch ones)
    g = eng.compiler
    assert isinstance(g, DecodeGraphs)
    modes: list[_HostReads] = []

    def watched(fn):
        def run():
            mode = _HostReads()
            modes.append(mode)
            with mode:
                return fn()

        return run

    g.run = {size: watched(fn) for size, fn in g.run.items()}
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        eng.submit(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert len(modes) >= max(LENGTHS) - 2
    assert [m.seen for m in modes if m.seen] == []
