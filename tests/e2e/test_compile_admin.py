"""The decode step's compile state reaches the admin API: a real ``pantheon serve`` of ``tiny``
with compiling off (the suite's default, tests/conftest.py) shows each instance's ``compile``
row in ``/admin/dies`` and ``/admin/models``, as the worker's stats carry it. The compile itself
is tested in-process (tests/unit/test_compiled.py): a server would pay minutes for it."""

from __future__ import annotations

import httpx
import pytest

from helpers.serve import Server, model_args, until

pytestmark = pytest.mark.timeout(180)


def test_admin_rows_say_the_compile_state(model_factory, tmp_path):
    s = Server(model_args({"tiny": (model_factory("tiny"), "cpu:0")}, 1), tmp_path / "serve.log")
    try:
        s.wait_ready(("tiny",))

        def row():
            dies = httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]
            insts = [i for d in dies for i in d["instances"] if i.get("compile")]
            return insts[0] if insts else None

        inst = until(row, 30, "the worker's stats with the compile state")
        assert inst["compile"] == {"state": "off: PANTHEON_COMPILE=0", "seconds": 0.0, "cache": ""}
        models = httpx.get(s.url + "/admin/models", timeout=10).json()["data"]
        assert [m["compile"]["state"] for m in models] == ["off: PANTHEON_COMPILE=0"]
    finally:
        s.stop()
