"""What an exception inside one engine step costs: the requests of that step, not the worker.

A step computes one batch for several requests at once, so an exception in it (a bug reached by
one request's shape, a failed allocation) cannot be pinned on one of them: ``Engine.step`` ends
every request the step was running (``workers.errors.StepFailed`` names them; the worker answers each with
``Rejected(internal)``, a 500 to its client) and the engine goes on with the others. That is
safe because a step writes only into what its own requests hold: their KV blocks (freed with
them, never published to the prefix cache before the step commits), their slots' recurrent
states (started over by the next request in the slot: its first chunk is ``fresh``), their
samplers, grammar matchers and draft rows (dropped with them). Requests waiting or running
outside the step are untouched.

Where it is not safe, the exception still ends the process (the router restarts the worker and
reloads its models, as for any death):

- a CUDA error other than running out of memory (an illegal address, a device-side assert, a
  launch failure): it is sticky, the device's context is lost, and every later call would fail
  too; only a new process gets a working context back;
- ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``).

A CUDA out-of-memory error is survivable: the allocator frees what the step had taken.
"""

from __future__ import annotations

import torch

# CUDA's own messages for the errors that leave the context unusable (older torch raises them
# as a plain RuntimeError; newer as torch.AcceleratorError)
_FATAL_CUDA = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "cuDNN error")


def survivable(e: Exception, device: torch.device) -> bool:
    """Whether the engine may go on after ``e`` escaped a step on ``device`` (module docstring)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    if device.type != "cuda":
        return True
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return False
    return not any(m in str(e) for m in _FATAL_CUDA)
