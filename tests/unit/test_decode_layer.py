"""The fused decode layer (``workers/layers/decode_layer.py`` / ``llama_layer.c``) against the
layer's own torch code, on the same inputs, layer by layer, inside real decode steps.

In fp32 (activations, K/V pool and rotary tables widened from the captured bf16 step) both
ways run the same linear and attention kernels on the same numbers, so they agree to the order
of float sums (~1e-6): a wrong rotation, head, cache row or residual is off by the order of the
outputs. In the engine's own bf16 they agree to bf16's rounding. Layers and steps it does not
take say why, or run their torch code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.cache import KVCache
from workers.engine import Engine
from workers.layers import decode_layer
from workers.models.llama import LlamaLayer

pytestmark = pytest.mark.skipif(not decode_layer.available(), reason="no C compiler: the torch path only")


def _captured_steps(path, cpu_path: str, monkeypatch, kv_types=None) -> tuple[Engine, list[tuple]]:
    """Decode steps of three requests (contexts over several blocks) run by the torch code,
    each layer's (layer, x, step batch, cache, output) captured. The engine is built with the
    fused layer on (its plans made), then switched off for the steps."""
    from pantheon.core.kv_types import KvCacheTypes

    monkeypatch.setenv("PANTHEON_CPU_PATH", cpu_path)
    kv = kv_types or KvCacheTypes()
    eng = Engine(str(path), num_slots=4, kv_budget_bytes=8 << 20, compile_decode=False,
                 kv_cache_k=kv.k, kv_cache_v=kv.v)  # fmt: skip
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
    got: list[tuple] = []

    def hook(mod, args, out):
        x, b, cache = args
        if not b.prefills and len(got) < 12:
            got.append((mod, x.clone(), b, cache, out.clone()))

    assert eng.model is not None
    hs = [layer.register_forward_hook(hook) for layer in eng.model.layers]
    for i, p in enumerate([list(range(5, 45)), [7, 8, 9], list(range(300, 337))]):
        eng.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_work():
        eng.step()
    for h in hs:
        h.remove()
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "1")
    return eng, got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny"])  # tiny: Qwen3
@pytest.mark.parametrize("cpu_path", ["int4", "int8"])
def test_each_layer_is_its_torch_code(preset, cpu_path, model_factory, monkeypatch):
    eng, steps = _captured_steps(model_factory(preset), cpu_path, monkeypatch)
    assert steps and all(x.shape[0] == 3 for _, x, *_ in steps)  # three decode rows a step
    for layer, x, b, cache, want in steps:
        assert isinstance(layer, LlamaLayer) and isinstance(cache, KVCache)
        native = decode_layer.Native(layer.parts())
        assert native.why is None
        # bf16, as the engine runs: the same to bf16's rounding (the cache row rewritten alike)
        got = native(x, b, cache)
        assert got is not None and got.dtype == x.dtype and _rel(got, want) < 3e-2
        # fp32: the torch code and the fused call on copies of the same widened state
        b32 = dataclasses.replace(b, rot_cos=b.rot_cos.float(), rot_sin=b.rot_sin.float())
        assert isinstance(cache.k, torch.Tensor) and isinstance(cache.v, torch.Tensor)
        k_torch, v_torch = cache.k.float(), cache.v.float()
        k_native, v_native = k_torch.clone(), v_torch.clone()
        c_torch, c_native = KVCache(k_torch, v_torch), KVCache(k_native, v_native)
        monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
        with torch.inference_mode():  # as the engine runs it (Qwen3's norm weights are parameters)
            want32 = layer(x.float(), b32, c_torch)
        monkeypatch.setenv("PANTHEON_FUSED_LAYER", "1")
        got32 = native(x.float(), b32, c_native)
        assert got32 is not None
        assert _rel(got32, want32) < 1e-3  # (~1e-7 Llama; Qwen3's q/k norms amplify to ~4e-4)
        rows = b.slot_mapping
        assert _rel(k_native[rows], k_torch[rows]) < 1e-5 and _rel(v_native[rows], v_torch[rows]) < 1e-5
    eng.close()


def test_bf16_activations_run_the_same_kernel_both_ways(model_factory, monkeypatch):
    """``PANTHEON_LINEAR_ACTIVATIONS=bf16`` (AVX512_BF16 builds): the fused call's int4 linears
    and the torch code's take the bf16 kernel alike (fp32 agreement as with int8)."""
    from workers.kernels import qlinear

    if not qlinear.has_bf16():
        pytest.skip("no AVX512_BF16 here")
    monkeypatch.setenv("PANTHEON_LINEAR_ACTIVATIONS", "bf16")
    qlinear.activations.cache_clear()
    try:
        assert qlinear.activations() == "bf16"
        eng, steps = _captured_steps(model_factory("tiny-llama"), "int4", monkeypatch)
        for layer, x, b, cache, want in steps:
            native = decode_layer.Native(layer.parts())
            got = native(x, b, cache)
            assert got is not None and _rel(got, want) < 3e-2
            b32 = dataclasses.replace(b, rot_cos=b.rot_cos.float(), rot_sin=b.rot_sin.float())
            assert isinstance(cache.k, torch.Tensor) and isinstance(cache.v, torch.Tensor)
            c1, c2 = KVCache(cache.k.float(), cache.v.float()), KVCache(cache.k.float(), cache.v.float())
            monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
            with torch.inference_mode():
                want32 = layer(x.float(), b32, c1)
            monkeypatch.setenv("PANTHEON_FUSED_LAYER", "1")
            got32 = native(x.float(), b32, c2)
            assert got32 is not None and _rel(got32, want32) < 1e-3
        eng.close()
    finally:
        monkeypatch.delenv("PANTHEON_LINEAR_ACTIVATIONS")
        qlinear.activations.cache_clear()


def test_what_it_does_not_take_runs_the_torch_code(model_factory, monkeypatch):
    eng, steps = _captured_steps(model_factory("tiny-llama"), "int4", monkeypatch)
    layer, x, b, cache, want = steps[0]
    native = decode_layer.Native(layer.parts())
    # a step with a prefill chunk, rows that are not the step's decode rows, the switch
    assert native(x, dataclasses.replace(b, prefills=[object()]), cache) is None  # pyright: ignore[reportArgumentType]
    assert native(x[:1], b, cache) is None
    assert native(x, b, cache) is not None
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
    assert not decode_layer.available() and native(x, b, cache) is None
    eng.close()
    # linears in torch's int4 layout: planned out, with the reason
    monkeypatch.setenv("PANTHEON_LINEAR_KERNEL", "0")
    eng, steps = _captured_steps(model_factory("tiny-llama"), "int4", monkeypatch)
    why = decode_layer.Native(steps[0][0].parts()).why
    assert why is not None and "not in our kernel's layout" in why
    eng.close()


def test_a_model_of_native_layers_is_not_compiled(model_factory, monkeypatch):
    """Every decode step runs the native layers (faster than the compiled graph: bench/decode.py
    --compile), so a model of native layers is not compiled."""
    eng = Engine(str(model_factory("tiny-llama")), cpu_path="int4", num_slots=4, kv_budget_bytes=8 << 20,
                 compile_decode=True)  # fmt: skip
    assert eng.runner.native
    assert eng.compiler.state.startswith("off: every decode step runs each layer as one native call")
    eng.close()
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
    eng = Engine(str(model_factory("tiny-llama")), cpu_path="int4", num_slots=4, kv_budget_bytes=8 << 20,
                 compile_decode=False)  # fmt: skip
    assert not eng.runner.native
    eng.close()
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "1")
    gemma = model_factory("tiny-gemma3")
    eng = Engine(str(gemma), cpu_path="int4", num_slots=4, kv_budget_bytes=8 << 20, compile_decode=False)
    assert not eng.runner.native  # Gemma 3's layers are not native
    eng.close()


@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
def test_quantized_kv_rows_are_written_as_the_torch_code_writes_them(kinds, model_factory, monkeypatch):
    """K and V pools of q8_0 / q4_0 rows: the fused call quantizes the step's K/V as
    ``kv_quant.quantize`` does (in fp32, the same bytes) and attends over them."""
    from pantheon.core.kv_types import KvCacheTypes
    from workers.kernels.kv_quant import QuantRows

    model = model_factory("tiny-llama", head_dim=32)  # quantized blocks of 32 run along a head
    eng, got = _captured_steps(model, "int4", monkeypatch, KvCacheTypes(*kinds))
    assert eng.runner.native  # these pools do not keep a model off the native step
    assert got
    for layer, x, b, cache, want in got:
        assert isinstance(cache.k, QuantRows) and (cache.k.kind, cache.v.kind) == kinds
        native = decode_layer.Native(layer.parts())
        out = native(x, b, cache)  # bf16: close to the torch code's output
        assert out is not None and _rel(out, want) < 5e-2
        b32 = dataclasses.replace(b, rot_cos=b.rot_cos.float(), rot_sin=b.rot_sin.float())
        pools = {}
        for who in ("torch", "native"):
            pools[who] = KVCache(
                *(
                    dataclasses.replace(p, data=p.data.clone(), scales=p.scales.clone())
                    for p in (cache.k, cache.v)
                )
            )
        with torch.inference_mode():
            monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
            want32 = layer(x.float(), b32, pools["torch"])
            monkeypatch.setenv("PANTHEON_FUSED_LAYER", "1")
        got32 = native(x.float(), b32, pools["native"])
        assert got32 is not None and _rel(got32, want32) < 1e-4
        rows = b.slot_mapping
        for a, c in zip(
            (pools["native"].k, pools["native"].v), (pools["torch"].k, pools["torch"].v), strict=True
        ):
            assert isinstance(a, QuantRows) and isinstance(c, QuantRows)
            assert torch.equal(a.scales[rows], c.scales[rows])
            same = (a.data[rows] == c.data[rows]).float().mean()
            assert same > 0.99, same  # a level apart only where a product lands on a rounding tie
    eng.close()


@pytest.mark.parametrize(
    ("preset", "kinds"),
    [("tiny-llama", None), ("tiny-qwen2", None), ("tiny", None), ("tiny-llama", ("q8_0", "q4_0"))],
)  # tiny: Qwen3 (its q/k norms)
def test_all_layers_in_one_call_are_the_layer_calls_to_the_bit(preset, kinds, model_factory, monkeypatch):
    """``Layers`` (one ``ll_decode_layers`` call a step) runs each layer's own kernel in turn, so
    every decode step's hidden states and tokens are those of the per-layer calls exactly, and
    it does run the decode steps (the prefill chunks run layer by layer)."""

    model = model_factory(preset, head_dim=32) if kinds else model_factory(preset)
    ran: list[bool] = []
    call = decode_layer.Layers.__call__

    def counted(self, x, b, caches):
        out = call(self, x, b, caches)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(decode_layer.Layers, "__call__", counted)

    def run(stacked: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        k, v = kinds or ("auto", "auto")
        eng = Engine(str(model), cpu_path="int8", num_slots=4, kv_budget_bytes=8 << 20, compile_decode=False,
                     kv_cache_k=k, kv_cache_v=v)  # fmt: skip
        assert eng.model is not None and isinstance(eng.model.fused_layers, decode_layer.Layers)
        if not stacked:
            eng.model.fused_layers = None
        prompts = [list(range(5, 45)), [7, 8, 9], list(range(300, 337))]
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        hidden, tokens = [], [[] for _ in prompts]
        while eng.has_work():
            for t in eng.step():
                tokens[int(t.request_id[1:])].append(t.token)
            assert eng.runner.last_hidden is not None
            hidden.append(eng.runner.last_hidden.clone())
        eng.close()
        return hidden, tokens

    h_one, t_one = run(True)
    assert any(ran) and ran.count(True) >= 5  # the decode steps went through the one call
    ran.clear()
    h_each, t_each = run(False)
    assert not ran  # switched off: never called
    assert t_one == t_each and all(len(t) == 6 for t in t_one)
    assert len(h_one) == len(h_each) and all(torch.equal(a, b) for a, b in zip(h_one, h_each, strict=True))


def test_layers_it_does_not_take_give_no_call(model_factory, monkeypatch):
    """A model whose layers do not all run fused (Gemma 3), or the fused layer switched off:
    no ``Layers``, the layers run one by one."""
    eng = Engine(str(model_factory("tiny-gemma3")), cpu_path="int4", num_slots=4, kv_budget_bytes=8 << 20,
                 compile_decode=False)  # fmt: skip
    assert eng.model is not None and eng.model.fused_layers is None
    eng.close()
    monkeypatch.setenv("PANTHEON_FUSED_LAYER", "0")
    eng = Engine(str(model_factory("tiny-llama")), cpu_path="int4", num_slots=4, kv_budget_bytes=8 << 20,
                 compile_decode=False)  # fmt: skip
    assert eng.model is not None and eng.model.fused_layers is None
    assert decode_layer.Layers.build(eng.model.layers) is None
    eng.close()
