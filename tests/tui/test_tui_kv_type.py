"""The dashboard shows a quantized KV cache's type beside its instance (issue 27), and nothing
for a full-width (``auto``) one, so the snapshots of today's dashboards stay as they are."""

from __future__ import annotations

import msgspec
import pytest
from test_tui_app import fixture, make_app, plain, settle

from tui.widgets.slots import SlotGrid

pytestmark = pytest.mark.timeout(60)


async def test_the_slot_grid_names_a_quantized_kv_cache():
    snap = fixture("normal")
    insts = [
        msgspec.structs.replace(i, kv_cache_dtype="q8_0/q4_0") if i.id == "tiny#1" else i
        for i in snap.instances
    ]
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        grid = plain(app.query_one(SlotGrid))
        assert "KV " not in grid  # every instance of the fixture is auto
        app.receive(msgspec.structs.replace(snap, instances=insts, ts=1.0))
        await pilot.pause()
        app.query_one(SlotGrid).show_all = True
        await pilot.pause()
        lines = plain(app.query_one(SlotGrid)).splitlines()
        assert [ln for ln in lines if "KV q8_0/q4_0" in ln and "tiny#1" in ln]
        assert not [ln for ln in lines if "KV" in ln and "tiny#1" not in ln]
