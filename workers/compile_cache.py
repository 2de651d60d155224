"""The on-disk cache of compiled decode steps: one folder per (model, machine, torch, layout) key.

A compiled decode step costs minutes of inductor work on a small CPU; the second load of the
same model on the same machine should not pay it again. Each entry is a folder that inductor
uses as its whole cache (``TORCHINDUCTOR_CACHE_DIR``, set for that compile only, through torch's
own ``temporary_cache_dir``): the FX graph cache, the AOTAutograd cache and the built C++
kernels (.so) of one model's step. The next compile of the same key traces the step (dynamo)
and finds every graph and kernel built.

Why that of torch's three options (measured on the tiny preset, 2-core EPYC, host loaded; see
README): cold 126 s; torch's mega-cache (``save_cache_artifacts`` / ``load_cache_artifacts``)
82 s, because its artifacts leave out the C++ kernels, which are built again; the inductor
cache folder 16 s. An AOTInductor package (``aoti_load_package``) would skip the trace too, but
it is an export of the whole step with the weights as constants (the model's bytes a second
time on disk, and the KV pool's in-place writes as exported buffer mutations), and it is keyed
by nothing torch checks: a stale package would run the wrong graph; not built. Inductor keys its
entries on each graph's contents, so an entry left by older model code is a miss, never a wrong
step: our key only picks the folder.

The key (``entry_key``) holds what changes the compiled code: the model files' names, sizes and
mtimes (a hash of gigabytes would cost more than it saves), the CPU path and dtype, the KV pool's
shape and slot count, torch's version, the CPU's ISA, the C++ compiler and the Python version.
The cache (``PANTHEON_COMPILE_CACHE_DIR``, default ``~/.cache/pantheon/compile``) is bounded by
``PANTHEON_COMPILE_CACHE_MAX_MB`` (1024; 0 turns it off): the least recently used entries go
first.

Torch-free on purpose: the bookkeeping here is unit-tested without compiling anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("pantheon.worker")

DEFAULT_MAX_MB = 1024


def cache_folder() -> Path:
    """``PANTHEON_COMPILE_CACHE_DIR``, else ``pantheon`` in the user's cache dir, ``compile``."""
    raw = os.environ.get("PANTHEON_COMPILE_CACHE_DIR", "").strip()
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("PANTHEON_CACHE_DIR")
    if base:
        return Path(base) / "compile"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pantheon" / "compile"


def max_bytes() -> int:
    """The folder's bound: ``PANTHEON_COMPILE_CACHE_MAX_MB`` (0 turns the cache off)."""
    raw = os.environ.get("PANTHEON_COMPILE_CACHE_MAX_MB", "").strip()
    try:
        mb = int(raw) if raw else DEFAULT_MAX_MB
    except ValueError:
        mb = DEFAULT_MAX_MB
    return max(0, mb) << 20


def model_identity(model_path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime ns) of the model's file, or of every file in its folder."""
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def entry_key(model_path: str, layout: Mapping[str, object]) -> str:
    """The hex key of one compiled step: the model files' identity, ``layout`` (CPU path, dtype,
    torch version, ISA, slots, KV pool shape: whatever the caller's graphs depend on) and this
    Python."""
    doc = {
        "model": str(Path(model_path).resolve()),
        "files": model_identity(model_path),
        "layout": {k: str(v) for k, v in sorted(layout.items())},
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


class CompileCache:
    """Entry folders in ``folder``, at most ``limit`` bytes in all (0: the cache is off).

    An entry is "hit" when a compile of its key worked before (its ``done`` file); a folder
    without it (a compile that failed or was cut short) is used again, as inductor's cache."""

    DONE = "done"

    def __init__(self, folder: Path | None = None, limit: int | None = None):
        self.folder = folder if folder is not None else cache_folder()
        self.limit = max_bytes() if limit is None else limit

    def path(self, key: str) -> Path:
        return self.folder / key

    def open(self, key: str) -> tuple[Path, bool]:
        """The entry's folder (made if new; now the most recently used) and whether it holds a
        compile that worked."""
        p = self.path(key)
        p.mkdir(parents=True, exist_ok=True)
        now = time.time()
        os.utime(p, (now, now))
        return p, (p / self.DONE).is_file()

    def finish(self, key: str) -> None:
        """Mark the entry as a compile that worked, then evict the oldest entries over the bound."""
        try:
            (self.path(key) / self.DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        except OSError as e:
            log.warning("compile cache: cannot write %s: %s", self.folder, e)
        self.evict(keep=key)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, folder) of every entry, least recently used first."""
        out = []
        try:
            for d in self.folder.iterdir():
                if d.is_dir():
                    try:
                        out.append((d.stat().st_mtime, folder_bytes(d), d))
                    except OSError:
                        continue
        except OSError:
            return []
        return sorted(out)

    def evict(self, keep: str | None = None) -> list[Path]:
        """Remove the least recently used entries until the cache fits its bound; ``keep`` (the
        entry just written) is never removed."""
        entries = self.entries()
        total = sum(size for _m, size, _p in entries)
        gone = []
        for _mtime, size, d in entries:
            if total <= self.limit:
                break
            if d.name == keep:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            gone.append(d)
        return gone


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
