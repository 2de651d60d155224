"""The GGUF dequantization kernel (``workers/kernels/dequant.c`` through ``dequant.py``): every block
format gives the torch path's values to the bit (random bytes with finite scales, several
thousand blocks: the threaded pass), on the native, AVX2 and plain C builds; gguf-py's reference
for the same bytes is tests/e2e/test_gguf.py's, which runs whichever path the host has."""

from __future__ import annotations

import json

import pytest
from test_qlinear_kernel import _isas, _run

from workers.kernels import dequant

CHECK = "import json; from helpers.dequant_ref import check; print(json.dumps(check()))"


def test_every_format_is_the_torch_paths_to_the_bit_on_every_isa():
    if not dequant.available():
        pytest.skip("no C compiler here: loads keep torch's ops")
    for isa in _isas():
        got = json.loads(_run(CHECK, {"PANTHEON_KERNEL_ISA": isa}))
        assert got["differ"] == {}, (isa, got)
        assert set(got["checked"]) == set(dequant.TYPES), (isa, got)


GRID = "import json; from helpers.dequant_ref import check_grid; print(json.dumps(check_grid()))"


def test_the_grid_fit_is_the_torch_paths_to_the_bit_on_every_isa():
    """A 4-bit file's grids found in one pass a group (``on_grid``'s kernel) give the torch fit's
    levels, steps, minima and verdict: on-grid groups of every span fit, 6-bit ones do not; and
    packed in the same pass (``quant.grid_groups``' kernel), the torch packing's bytes; and a
    weight off every grid fitted min/max in one pass (``quant.q4_groups``), the torch fit's."""
    if not dequant.available():
        pytest.skip("no C compiler here: loads keep torch's ops")
    for isa in _isas():
        got = json.loads(_run(GRID, {"PANTHEON_KERNEL_ISA": isa}))
        assert got["same"] and got["packed"] and got["affine"], (isa, got)
        assert got["verdicts"] == [True, False, True, True], (isa, got)


ROWS = "import json; from helpers.dequant_ref import check_int8_rows; print(json.dumps(check_int8_rows()))"


def test_int8_rows_are_the_torch_paths_to_the_bit_on_every_isa():
    """A weight's int8 rows made in one native pass (``quant.int8_rows``; a token table's from its
    blocks, ``BlockEmbedding.int8_rows``) are the torch ops' rows and scales."""
    if not dequant.available():
        pytest.skip("no C compiler here: loads keep torch's ops")
    for isa in _isas():
        got = json.loads(_run(ROWS, {"PANTHEON_KERNEL_ISA": isa}))
        assert got["same"] and all(got["same"].values()), (isa, got)
