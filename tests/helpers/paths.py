"""Where things are, found from this file: no absolute paths."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the checkout
TESTS = REPO_ROOT / "tests"
# The reference data (OpenAI's schemas and recorded streams, real chat templates) sits beside the
# checkout, not in it: <checkout>/../shared/specs.
SPECS = REPO_ROOT.parent / "shared" / "specs"


def need_specs() -> Path:
    """``SPECS``, or skip the calling test (or fixture) when the folder is not there."""
    if not SPECS.is_dir():
        pytest.skip(
            f"the shared specs are missing: {SPECS} (they sit beside the checkout, in ../shared/specs)"
        )
    return SPECS
