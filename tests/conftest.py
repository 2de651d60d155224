"""Shared fixtures: small random-weight models written once per test session.

Each preset is written by ``makemodel.make_model`` into a session temp folder, so the
tests load real safetensors files and a real trained tokenizer, exactly as a user's folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Two cores here: keep torch from oversubscribing when tests spawn workers.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The decode step compiles in the background by default (workers/compiled.py): a minute or two
# of both cores per load, which the suite's many workers must not pay. tests/unit/test_compiled.py
# turns it on where it is the subject.
os.environ.setdefault("PANTHEON_COMPILE", "0")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    # PANTHEON_REF_DEVICE=cpu runs the tests marked gpu(ref_device=True) on the CPU instead (the
    # device reference tests, tests/unit/test_gpu_reference.py: how they are checked without a GPU)
    on_cpu = os.environ.get("PANTHEON_REF_DEVICE", "").startswith("cpu")
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is not None and not (on_cpu and mark.kwargs.get("ref_device")):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Return ``make(preset, **overrides) -> Path``; each distinct call is written once."""
    from makemodel import make_model

    cache: dict[tuple[str, str], Path] = {}

    def make(preset: str, **overrides) -> Path:
        key = (preset, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{preset}")
            cache[key] = make_model(preset, out, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    """The ``tiny`` preset (Qwen3 architecture), bf16 weights."""
    return model_factory("tiny")
