"""Two fixes to Triton 3.6's interpreter (``TRITON_INTERPRET=1``), so that the Triton kernels
(``workers/kernels/paged_triton_jit.py``) run on the CPU as compiled on a GPU. Applied by the
tests and ``bench/attention_cuda.py --device cpu`` only; a compiled kernel never sees them.

- A scalar is a 1-element array there, which the interpreter's ``__index__`` turns into an int
  with ``int(array)``: NumPy 2.4 refuses that (triton-lang/triton#9171, fixed after 3.6). The
  kernels' loops run over loaded bounds (``range(start, end, BLOCK_N)``), so each would fail.
- ``tl.dot`` on bf16 multiplies the raw bits (the interpreter keeps bf16 as uint16 and hands
  them to ``np.matmul`` as integers). The fix widens bf16 operands to fp32 first, which is what
  a tensor core computes on them (bf16 x bf16 products are exact in fp32).
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def fix() -> None:
    """Patch the interpreter (once per process; triton must be importable)."""
    ti = importlib.import_module("triton.runtime.interpreter")
    np = importlib.import_module("numpy")
    tl = importlib.import_module("triton.language")
    patch = ti._patch_lang_tensor

    def index(self) -> int:
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    ti._patch_lang_tensor = patched

    builder = ti.InterpreterBuilder
    dot = builder.create_dot

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
