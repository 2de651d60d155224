"""``check()``: the dequantization kernel (whichever ISA ``PANTHEON_KERNEL_ISA`` built) against
``workers/gguf_weights.py``'s torch ops on the same random blocks, every format; returns the
formats checked and, for each that differs, how many values do. Run in a subprocess per ISA by
tests/unit/test_dequant_kernel.py."""

from __future__ import annotations

import numpy as np
import torch

from workers import gguf_weights
from workers.kernels import dequant

# byte offsets of each format's fp16 scales (kept finite and small in random blocks)
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


def check() -> dict:
    rng = np.random.default_rng(7)
    checked, differ = [], {}
    for name in dequant.TYPES:
        block, nbytes = gguf_weights._LAYOUT[name]
        n = 5000  # past the kernel's threshold for threads
        raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
        for at in HALVES[name]:
            raw[:, at : at + 2] = (rng.standard_normal((n, 1)) * 0.01).astype(np.float16).view(np.uint8)
        b = torch.from_numpy(raw)
        want = torch.empty(n, block)
        step = max(1, gguf_weights.CHUNK_VALUES // block)
        for i in range(0, n, step):
            gguf_weights._BLOCKS[name](b[i : i + step], want[i : i + step])
        got = torch.empty(n, block)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            dequant.blocks(b, name, got)
            bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
            if bad:
                differ[f"{name}@{threads}"] = bad
        checked.append(name)
    return {"checked": checked, "differ": differ}
