"""The die a worker owns: what it is called, how much memory it has, and how much is free.

A die is ``cuda:N`` (a real GPU, measured with ``torch.cuda.mem_get_info``) or a virtual CPU die
``cpu:N``. A CPU die has no memory of its own to measure, so its total is the budget the worker
was given and its free memory is that budget minus what the worker has booked for the models it
loaded. That way every path of the router's die manager (admission, placement, out of memory)
runs on a machine without a GPU.

torch is imported only for CUDA dies, so describing a CPU die stays cheap.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import psutil

# Die ids are parsed by the protocol's parser, the one the router uses too (re-exported here).
from pantheon.core.protocol import normalize_die, parse_die

__all__ = ["Die", "engine_device", "normalize_die", "open_die", "parse_die"]


def engine_device(die: str) -> str:
    """The torch device string the engine gets for a die: every ``cpu:N`` is torch's ``cpu``."""
    kind, index = parse_die(die)
    return "cpu" if kind == "cpu" else f"cuda:{index}"


@dataclass
class Die:
    """One die and its memory accounting. Use :func:`open_die` to build one."""

    id: str
    kind: str  # cpu | cuda
    index: int
    device_name: str
    budget_bytes: int | None = None  # CPU dies only: the configured total
    booked_bytes: int = 0  # CPU dies only: weights + KV cache of the loaded models

    @property
    def torch_device(self) -> str:
        return engine_device(self.id)

    def memory(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` right now."""
        if self.kind == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(self.index)
            return int(free), int(total)
        total = int(self.budget_bytes or 0)
        return max(0, total - self.booked_bytes), total

    def book(self, nbytes: int) -> None:
        """Count memory a loaded model holds (a no-op on CUDA, whose free memory is measured)."""
        self.booked_bytes += max(0, int(nbytes))

    def release(self, nbytes: int) -> None:
        self.booked_bytes = max(0, self.booked_bytes - max(0, int(nbytes)))

    def empty_cache(self) -> None:
        """Give memory that torch cached but no longer uses back to the device."""
        if self.kind == "cuda":
            import torch

            with torch.cuda.device(self.index):
                torch.cuda.empty_cache()


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU ({name})" if name else "CPU"


def open_die(die: str, *, budget_bytes: int | None = None, name: str = "") -> Die:
    """Describe a die; raises ValueError for a bad id or a CUDA die this machine does not have.

    A CPU die without a budget gets the machine's total RAM as its budget. ``name``: a worker
    on another host, whose die id the router knows as ``cpu:N@name``.
    """
    kind, index = parse_die(die)
    suffix = f"@{name}" if name else ""
    if name:
        parse_die(f"{kind}:{index}{suffix}")  # ValueError: a name a die id cannot carry
    if kind == "cpu":
        budget = int(budget_bytes) if budget_bytes is not None else psutil.virtual_memory().total
        if budget <= 0:
            raise ValueError(f"cpu die budget must be positive, got {budget}")
        return Die(f"cpu:{index}{suffix}", "cpu", index, _cpu_name(), budget_bytes=budget)
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"die cuda:{index}: CUDA is not available in this process")
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"die cuda:{index}: this machine has {count} CUDA device(s)")
    return Die(f"cuda:{index}{suffix}", "cuda", index, torch.cuda.get_device_properties(index).name)
