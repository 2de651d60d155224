"""The slot grid shows an instance's speculation (its draft, the share of drafted tokens accepted,
tokens per verify step) on a line under its heading, once it has drafted anything; instances that
never drafted get no line. Each refresh's snapshot brings the counters (nothing is kept between)."""

from __future__ import annotations

import msgspec
import pytest
from test_tui_app import fixture, make_app, plain, settle

from tui.widgets.slots import SlotGrid

pytestmark = pytest.mark.timeout(60)


def _spec(draft: str, steps: int, drafted: int, accepted: int, emitted: int) -> dict:
    return {
        "draft": draft,
        "spec_verify_steps": steps,
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "spec_emitted": emitted,
    }


def _lines(app) -> list[str]:
    return plain(app.query_one(SlotGrid)).splitlines()


async def test_the_slot_grid_shows_speculation_under_its_instance():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:  # wide: every instance's block
        await settle(app, pilot)
        lines = _lines(app)
        spec = [n for n, ln in enumerate(lines) if "spec:" in ln]
        assert len(spec) == 1  # llama#2 only: the fixture's other instances never drafted
        assert lines[spec[0]].strip() == "spec: llama-draft-68m 71% accepted, 2.4 tok/step"
        assert "llama#2" in lines[spec[0] - 1]  # right under its heading

        # the next snapshot's counters: tiny#1 now drafts from its MTP head, llama#2 went on
        snap = fixture("normal")
        more = {
            "tiny#1": _spec("mtp", 10, 10, 9, 19),
            "llama#2": _spec("/models/llama-draft-68m", 2000, 4000, 2000, 4000),
        }
        insts = [msgspec.structs.replace(i, **more.get(i.id, {})) for i in snap.instances]
        app.receive(msgspec.structs.replace(snap, instances=insts, ts=1.0))
        await pilot.pause()
        got = sorted(ln.strip() for ln in _lines(app) if "spec:" in ln)
        assert got == [
            "spec: llama-draft-68m 50% accepted, 2.0 tok/step",
            "spec: mtp 90% accepted, 1.9 tok/step",
        ]


async def test_a_narrow_grid_shows_the_selected_instances_speculation_only():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        assert app.selected == "llama#2"
        assert [ln.strip() for ln in _lines(app) if "spec:" in ln] == [
            "spec: llama-draft-68m 71% accepted, 2.4 tok/step"
        ]
        await pilot.press("down")  # qwen3#3: never drafted, no line
        await pilot.pause()
        assert app.selected == "qwen3#3" and not [ln for ln in _lines(app) if "spec:" in ln]
