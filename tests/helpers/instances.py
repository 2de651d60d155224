"""A published registry ``Instance`` around a model's assets, for tests that run the router's
generation code without a server (the real dataclass, so a test sees every field the code reads)."""

from __future__ import annotations

from pantheon.control.registry import READY, Instance, Slots
from pantheon.models.assets import ModelAssets


def ready_instance(assets: ModelAssets, name: str = "tiny", die: str = "cpu:0") -> Instance:
    """``name``'s instance on ``die``, ready, with ``assets`` (no worker has reported: ``loaded``
    is None, so its vocabulary is the tokenizer's)."""
    return Instance(
        name=name,
        instance_id=f"{name}#1",
        path=str(assets.path),
        dies=(die,),
        gate=Slots(1),
        state=READY,
        assets=assets,
    )
