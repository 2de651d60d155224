"""Compile the paged attention kernels (``workers/kernels/paged_triton_jit.py``) for a CUDA
target without a GPU: Triton's own front end, its optimizer and ``ptxas`` (bundled with the
triton wheel) all run on the host. What the interpreter never checks fails here as it would on
the device: a global a compiled kernel may not read, a type or shape the code generator refuses,
shared memory past the target's limit.

    python tests/helpers/triton_aot.py [ARCH]     # ARCH 90 (Hopper) by default

Prints one line per kernel and configuration (its shared memory) and exits non-zero at the first
that does not compile. Run without ``TRITON_INTERPRET`` (under it ``triton.jit`` builds
interpreted functions, which do not compile).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402  # pyright: ignore[reportMissingImports]
from triton.backends.compiler import GPUTarget  # noqa: E402  # pyright: ignore[reportMissingImports]
from triton.compiler import ASTSource  # noqa: E402  # pyright: ignore[reportMissingImports]

from workers.kernels import paged_triton as PT  # noqa: E402
from workers.kernels import paged_triton_jit as J  # noqa: E402

DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (dtype, query heads per KV head, head width): SmolLM2, Qwen3 / Llama-8B, gpt-oss, D 256, fp32
CONFIGS = [
    (torch.bfloat16, 3, 64),
    (torch.bfloat16, 4, 128),
    (torch.float16, 8, 64),
    (torch.bfloat16, 16, 256),
    (torch.float32, 8, 128),
]


def compile_one(fn, ptrs: dict[str, str], const: dict[str, object], arch: int, warps: int) -> tuple[int, str]:
    """Compile ``fn`` (a ``triton.jit`` function) with pointer args typed by ``ptrs``, the others
    32-bit ints, ``const`` as its constexprs: its shared memory in bytes, its registers and spills."""
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in inspect.signature(fn.fn).parameters}
    src = ASTSource(fn, sig, constexprs=const)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 2})
    return int(k.metadata.shared), resources(k.asm["cubin"])


def resources(cubin: bytes) -> str:
    """Registers a thread, and its stack frame (spills and local arrays: local memory, slow), of
    a kernel's cubin, read by the ``cuobjdump`` that the triton wheel bundles (``-res-usage``)."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"{m.group(1)} registers, a {m.group(2)}-byte stack frame" if m else "resources unknown"


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    for dtype, g, d in CONFIGS:
        t = DT[dtype]
        prec = "ieee" if dtype == torch.float32 else "tf32"
        name = f"{t} G={g} D={d}"
        shared, res = compile_one(
            J.partials,
            {"Q": "*" + t, "K": "*" + t, "V": "*" + t, "TAB": "*i64", "LENS": "*i64"}
            | {"O_PART": "*fp32", "LSE_PART": "*fp32"},
            dict(
                G=g,
                G_PAD=max(16, PT.triton_next_pow2(g)),
                D=d,
                BS=16,
                BLOCK_N=PT._block_n(d),
                PRECISION=prec,
            ),
            arch,
            8 if d > 128 else 4,
        )
        print(f"partials {name}: {shared} bytes of shared memory, {res}", flush=True)
        for has_sinks in (False, True):
            compile_one(
                J.merge,
                {"O_PART": "*fp32", "LSE_PART": "*fp32", "LENS": "*i64", "SINKS": "*fp32", "OUT": "*" + t},
                dict(D=d, HAS_SINKS=has_sinks),
                arch,
                1 if d <= 128 else 2,
            )
            cfg = PT.prefill_config(g, d, dtype)
            shared, res = compile_one(
                J.prefill,
                {"Q": "*" + t, "K": "*" + t, "V": "*" + t, "TAB": "*i32", "TILES": "*i32"}
                | {"SINKS": "*fp32", "OUT": "*" + t},
                dict(
                    G=g,
                    ROWS=cfg.rows,
                    BLOCK_M=cfg.block_m,
                    D=d,
                    BS=16,
                    BLOCK_N=cfg.block_n,
                    HAS_SINKS=has_sinks,
                    PRECISION=prec,
                ),
                arch,
                cfg.warps,
            )
            print(f"prefill {name} sinks={has_sinks}: {shared} bytes of shared memory, {res}", flush=True)
    print("all compiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
