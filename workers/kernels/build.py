"""Compile a kernel's C source with the system compiler, once per (source and the kernels'
headers, compiler, flags, CPU),
and load it with ctypes.

The shared object is cached under ``PANTHEON_KERNEL_CACHE`` (default ``~/.cache/pantheon/kernels``)
by a hash of the source, the compiler's ``--version``, the flags and the CPU's flags line of
/proc/cpuinfo (``-march=native`` code is only good on the CPU it was built for). It is written
under a temporary name and renamed into place: two workers building at once each rename a
complete file. Any failure (no compiler, a compile error, a load error) gives ``(None, why)``:
the caller keeps its torch path.

``torch`` is imported first on purpose: a kernel built with ``-fopenmp`` NEEDs ``libgomp.so.1``,
and once torch's copy (``torch/lib/libgomp.so.1``, that SONAME) is loaded the dynamic loader
binds the kernel to it rather than loading the system's: one OpenMP runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loaded before any kernel: its libgomp is the one kernels bind to

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# PANTHEON_KERNEL_ISA: the instruction set a kernel is built for. "native" (the default) is this
# CPU's own; the others build the fallbacks a kernel keeps for older CPUs, so that any host can
# run their tests: "avx2" (x86-64-v3: AVX2, FMA, F16C; no AVX-512, no VNNI), "scalar" (x86-64:
# plain C, what a CPU without AVX2 or another architecture runs).
ISAS = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3",), "scalar": ("-march=x86-64",)}


def flags() -> tuple[str, ...]:
    """The compiler flags of this process's builds (``PANTHEON_KERNEL_ISA``); raises ValueError on
    an unknown ISA name."""
    isa = os.environ.get("PANTHEON_KERNEL_ISA", "native").strip() or "native"
    if isa not in ISAS:
        raise ValueError(f"PANTHEON_KERNEL_ISA={isa!r} is not one of {', '.join(ISAS)}")
    return (*FLAGS, *ISAS[isa])


def cache_dir() -> Path:
    env = os.environ.get("PANTHEON_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pantheon" / "kernels"


def compiler() -> list[str] | None:
    """The C compiler's command: ``CC`` if set, else ``cc`` or ``gcc`` on PATH."""
    env = os.environ.get("CC")
    if env:
        return shlex.split(env)
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return ""


def _key(source: bytes, cc: list[str], flags: tuple[str, ...]) -> str:
    """Hash of what the built object depends on; raises OSError / SubprocessError when ``cc``
    does not run."""
    ver = subprocess.run([*cc, "--version"], capture_output=True, timeout=30, check=True).stdout
    h = hashlib.sha256()
    for part in (source, ver, " ".join(flags).encode(), _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(name: str) -> tuple[ctypes.CDLL | None, str]:
    """``workers/kernels/<name>.c`` built (or found in the cache) and loaded: (library, where
    from), or (None, why not)."""
    src = HERE / f"{name}.c"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc; or set CC)"
    try:
        opts = flags()
    except ValueError as e:
        return None, str(e)
    try:
        # the headers every kernel may include (convert.h) are part of what it is built from
        source = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
        key = _key(source, cc, opts)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"compiler {' '.join(cc)!r} does not run: {e}"
    out = cache_dir() / f"{name}-{key}.so"
    how = "cached"
    if not out.exists():
        how = "built"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
            os.close(fd)
        except OSError as e:
            return None, f"kernel cache {out.parent} not writable: {e}"
        try:
            r = subprocess.run(
                [*cc, *opts, "-o", tmp, str(src), "-lm"], capture_output=True, text=True, timeout=300
            )
            if r.returncode != 0:
                err = (r.stderr or r.stdout).strip().splitlines()
                return None, f"{' '.join(cc)} failed ({r.returncode}): {err[0] if err else 'no output'}"
            os.replace(tmp, out)  # atomic: a concurrent build renames an identical file
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"{' '.join(cc)} failed: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(out)), f"{how} {out}"
    except OSError as e:
        return None, f"cannot load {out}: {e}"


# an entry point's ctypes types: (restype, argtypes or None to leave them unset)
Signature = tuple[object, list[object] | None]

# The float kinds the kernels read and write as activations and outputs (convert.h's F32, BF16:
# qmatmul.c's X_F32 / X_BF16, llama_layer.c's and gated_delta.c's kinds): a dtype's code
FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def load(name: str, without: str, entries: dict[str, Signature]) -> tuple[ctypes.CDLL | None, str]:
    """``build(name)`` with its entry points' types set (``entries``): (library, where from),
    or (None, why not), said once in the log as ``without: why`` (what runs instead)."""
    lib, why = build(name)
    if lib is None:
        logging.getLogger("pantheon.worker").warning("%s: %s", without, why)
        return None, why
    for fn, (restype, argtypes) in entries.items():
        f = getattr(lib, fn)
        f.restype = restype
        if argtypes is not None:
            f.argtypes = argtypes
    return lib, why
