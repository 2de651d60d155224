"""``check()``: the dequantization kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) against
``workers/gguf_blocks.py``'s torch ops on the same random blocks, every format; returns the
formats checked and, for each that differs, how many values do. Run in a subprocess per ISA by
tests/unit/test_dequant_kernel.py."""

from __future__ import annotations

import numpy as np
import torch

from workers import gguf_blocks
from workers.kernels import dequant

# byte offsets of each format's fp16 scales, kept finite and small in random blocks (MXFP4's scale is
# an e8m0 byte: every value a power of two); tests/e2e/test_gguf.py's random blocks use them too
HALVES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "MXFP4": (),
}


def random_blocks(rng: np.random.Generator, type_name: str, n: int) -> np.ndarray:
    """``n`` blocks of ``type_name`` of random bytes, their fp16 scales finite and small
    (``HALVES``): [n, block bytes] uint8."""
    _block, nbytes = gguf_blocks.LAYOUT[type_name]
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for at in HALVES[type_name]:
        raw[:, at : at + 2] = (rng.standard_normal((n, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw


def check() -> dict:
    rng = np.random.default_rng(7)
    checked, differ = [], {}
    for name in dequant.TYPES:
        block, _ = gguf_blocks.LAYOUT[name]
        n = 5000  # past the kernel's threshold for threads
        b = torch.from_numpy(random_blocks(rng, name, n))
        want = torch.empty(n, block)
        step = max(1, gguf_blocks.CHUNK_VALUES // block)
        for i in range(0, n, step):
            gguf_blocks.BLOCKS[name](b[i : i + step], want[i : i + step])
        got = torch.empty(n, block)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            dequant.blocks(b, name, got)
            bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
            if bad:
                differ[f"{name}@{threads}"] = bad
        checked.append(name)
    return {"checked": checked, "differ": differ}


def check_grid() -> dict:
    """``dequant.grid_fit`` against ``workers.quant._grid_fit`` on the same groups: 4-bit grids of
    every span (L = 1 .. 15 levels used, fp16-rounded steps and minima, as a Q4_K file's unpacked
    values are), constant groups, and off-grid ones (6-bit levels); the same levels, steps,
    minima and verdict, bit for bit, on one and two threads; and the fit packed in one native pass
    (``dequant.q4_groups``) the torch packing's bytes, or None where a group is off every grid;
    the min/max fit of groups off every grid (``dequant.q4_affine``) the torch fit's bytes."""
    from workers.quant import _affine_groups, _grid_fit, _q4_pack

    g = torch.Generator().manual_seed(3)
    r = 6000
    levels = torch.randint(1, 16, (r, 1), generator=g)  # the highest level a group uses
    q = torch.minimum(torch.randint(0, 16, (r, 32), generator=g), levels).float()
    q[:, 0], q[:, 1] = 0, levels[:, 0].float()  # its lowest and highest level both present
    step = (torch.rand(r, 1, generator=g) * 0.01 + 1e-4).half().float()
    lo = (torch.randn(r, 1, generator=g) * 0.05).half().float()
    on_grid = lo + q * step  # [r, 32]
    on_grid[:50] = on_grid[:50, :1]  # constant groups
    off_grid = torch.randint(0, 64, (r, 32), generator=g).float() * step + lo  # 6-bit levels
    tiny = lo * 1e-3 + q * step * 1e-3  # steps and minima that are fp16 subnormals
    out: dict = {"same": True, "packed": True, "verdicts": []}
    for w in (on_grid, off_grid, on_grid[::7], tiny):
        want = _grid_fit(w.contiguous(), 1e-3)
        # the fit packed in the kernel's layout (dequant.q4_groups), a group a row of [N, 32]
        # and four a row of [N / 4, 128]: quant._q4_pack's bytes, fp16 rounded as torch rounds
        packs = []
        for k in (32, 128):
            n = w.shape[0] * 32 // k
            m = n * k // 32  # groups used
            grid = (
                want[0][:m].view(n, k // 32, 32),
                want[1][:m].view(n, k // 32),
                want[2][:m].view(n, k // 32),
            )
            packs.append((w[:m].reshape(n, k), _q4_pack(*grid) if want[3] else None))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = dequant.grid_fit(w, 1e-3)
            same = got[3] == want[3] and all(
                torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got[:3], want[:3])
            )
            out["same"] &= bool(same)
            for weight, ref in packs:
                mine = dequant.q4_groups(weight, 1e-3)
                ok = (mine is None) == (ref is None) and (
                    mine is None
                    or ref is None
                    or torch.equal(mine[0], ref[0])
                    and torch.equal(mine[1].view(torch.int16), ref[1].view(torch.int16))
                )
                out["packed"] &= bool(ok)
        out["verdicts"].append(bool(want[3]))
    # off every grid: the min/max fit to fp16 scales in one native pass (dequant.q4_affine), the
    # torch fit's bytes; constant groups (a step that rounds to 0 in fp16) and tiny spans included
    odd = torch.cat([off_grid, on_grid[:48], tiny[:64] * 1e-3, off_grid[:64] * 300]).reshape(-1, 128)
    ref = _q4_pack(*_affine_groups(odd, torch.float16))
    out["affine"] = True
    for threads in (1, 2):
        torch.set_num_threads(threads)
        mine = dequant.q4_affine(odd)
        out["affine"] &= torch.equal(mine[0], ref[0]) and torch.equal(
            mine[1].view(torch.int16), ref[1].view(torch.int16)
        )
    return out


def check_int8_rows() -> dict:
    """``dequant.int8_rows`` / ``int8_rows_blocks`` against ``workers.quant.int8_rows_of``'s torch
    ops: the same int8 rows and fp32 scales, bit for bit, for fp32 and bf16 weights (rows of very
    different scales, an all-zero row, values on the .5 rounding edges) and for a Q6_K table's
    blocks (fp32, and rounded to bf16 first), on one and two threads."""
    from workers.quant import int8_rows_of

    def torch_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return int8_rows_of(lambda a, b: w[a:b], w.shape[0], w.shape[1], torch.float32, w.device)

    g = torch.Generator().manual_seed(5)
    w = torch.randn(700, 384, generator=g) * torch.logspace(-6, 2, 700)[:, None]
    w[3] = 0
    w[4] = torch.arange(384) - 191.5  # halves: nearest-even rounding decides
    cases = {"fp32": w, "bf16": w.bfloat16()}
    rng = np.random.default_rng(9)
    blocks = torch.from_numpy(random_blocks(rng, "Q6_K", 600)).view(300, 2, 210)
    table = torch.empty(600, 256)
    gguf_blocks.BLOCKS["Q6_K"](blocks.reshape(600, 210), table)
    table = table.view(300, 512)
    out: dict = {"same": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, x in cases.items():
            got, want = dequant.int8_rows(x), torch_rows(x)
            out["same"][f"{name}@{threads}"] = torch.equal(got[0], want[0]) and torch.equal(
                got[1].view(torch.int32), want[1].view(torch.int32)
            )
        for bf16 in (False, True):
            got = dequant.int8_rows_blocks(blocks.contiguous(), "Q6_K", 512, bf16)
            want = torch_rows(table.bfloat16().float() if bf16 else table)
            out["same"][f"Q6_K{'-bf16' if bf16 else ''}@{threads}"] = torch.equal(
                got[0], want[0]
            ) and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    return out
