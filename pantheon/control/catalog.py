"""The model catalog: every model the server can serve, loaded or not.

Entries come from two places:

- configured: the ``--model`` flags, or the config file's ``[[models]]`` tables (with
  ``aliases``, ``dies``, ``preload``, ``keep_alive``, ``pin``, ``params`` and the admin load's
  options); these come first and win a name;
- discovered: each ``--models-dir`` root's models, as ``--model`` would name them (a folder's
  name, a ``.gguf`` file's stem, lower-cased): a Hugging Face folder (``config.json``), a
  ``.gguf`` file, a folder holding one, and the same one level further down
  (``root/org/model``). Not preloaded. One that links out of the roots (the folder, or a file
  in it) is listed as failed, as the admin API refuses it. One whose name would hold a control
  character (a newline in a file name) is left out, with a warning (``pantheon.core.names``).

An entry that cannot be read (a truncated GGUF, a ``config.json`` that is not JSON, an
architecture no family serves) is listed with its ``error``; serving it is a 4xx naming the file
and why, never a crash.

The roots are re-read when a name is not found or the list is asked for, but only when a
folder's modification time changed since the last scan (a model copied in appears without a
restart; a flood of unknown names costs a few ``stat`` calls each). A model's description is
read once per file version (its path and modification time).

Torch-free and synchronous: the router calls it on its event loop; a scan reads only
``config.json`` files and GGUF headers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pantheon.core.description import ModelError
from pantheon.core.gguf import GGUFError, find_gguf, served_name
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.names import escaped, has_control
from pantheon.core.sizing import read_shape

log = logging.getLogger("pantheon.control.catalog")

CONFIGURED, DISCOVERED = "configured", "discovered"


@dataclass(frozen=True, eq=False)
class CatalogEntry:
    """One model the server can serve. ``keep_alive`` None: the server's ``--keep-alive``."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    dies: tuple[str, ...] = ()
    preload: bool = False
    keep_alive: float | None = None
    pin: bool = False
    params: Mapping[str, float | int] = field(default_factory=dict)
    quantize: bool = False
    slots: int | None = None
    max_context: int | None = None
    embeddings: bool = False  # the load's option: a chat model serves /v1/embeddings too
    kv_cache_dtype: KvCacheTypes | None = None  # the load's option (None: --kv-cache-dtype)
    draft: str | None = None  # the load's option: a draft model for speculation (workers/draft.py)
    origin: str = DISCOVERED
    error: str | None = None  # why it cannot be served (read at scan time)
    context_limit: int | None = None  # the model's own context length, when it could be read
    modified: int = 0  # unix time its file (GGUF or config.json) was last written
    size_bytes: int = 0  # its weights on disk (the GGUF file, or the folder's weight files)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _is_model(path: str) -> bool:
    if os.path.isfile(path):
        return path.lower().endswith(".gguf")
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "config.json")):
        return True
    try:
        return any(n.lower().endswith(".gguf") for n in os.listdir(path))
    except OSError:
        return False


def _children(folder: str) -> list[str]:
    try:
        return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if not n.startswith(".")]
    except OSError:
        return []


def discover(roots: Iterable[str]) -> list[str]:
    """The model paths under ``roots``: each root's models, and its subfolders' models."""
    found: list[str] = []
    for root in roots:
        for child in _children(root):
            if _is_model(child):
                found.append(child)
            elif os.path.isdir(child):
                found.extend(g for g in _children(child) if _is_model(g))
    return found


def _inside(real: str, roots: Sequence[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def escapes(path: str, roots: Sequence[str]) -> bool:
    """Whether ``path``, or a file in it, resolves outside ``roots`` (a link out of the model
    folder: the admin API's ``--models-dir`` rule, which discovery keeps too)."""
    real = os.path.realpath(path)
    if not _inside(real, roots):
        return True
    if os.path.isdir(real):
        return any(not _inside(os.path.realpath(p), roots) for p in _children(real))
    return False


def _version(path: str) -> tuple[str, int]:
    """What a model's description depends on: its GGUF file's or config.json's mtime."""
    try:
        gguf = find_gguf(path)
    except GGUFError:
        gguf = None
    target = str(gguf) if gguf else os.path.join(path, "config.json")
    try:
        return target, os.stat(target).st_mtime_ns
    except OSError:
        return target, -1


def _weights_size(path: str, target: str) -> int:
    """Bytes of weights: the GGUF file, or a folder's ``.safetensors``/``.bin`` files."""
    try:
        if target.lower().endswith(".gguf"):
            return os.stat(target).st_size
        return sum(
            os.stat(p).st_size
            for p in _children(path)
            if p.endswith((".safetensors", ".bin")) and os.path.isfile(p)
        )
    except OSError:
        return 0


def _folders(roots: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """The modification times a scan's result depends on: the roots and the folders below them,
    two levels deep (``root/org/model``)."""
    out: list[tuple[str, int]] = []
    for root in roots:
        level = [root]
        for _ in range(3):
            nxt: list[str] = []
            for d in level:
                try:
                    out.append((d, os.stat(d).st_mtime_ns))
                except OSError:
                    continue
                nxt.extend(c for c in _children(d) if os.path.isdir(c))
            level = nxt
    return tuple(out)


class Catalog:
    """The configured entries and what the roots hold (see the module doc)."""

    def __init__(self, configured: Sequence[CatalogEntry] = (), roots: Sequence[str] = ()):
        self.roots = tuple(roots)
        self._described: dict[str, tuple[tuple[str, int], str | None, int | None]] = {}
        self._configured = [self._checked(e) for e in configured]
        self._discovered: list[CatalogEntry] = []
        self._seen: tuple[tuple[str, int], ...] | None = None
        self.refresh()

    # ------------------------------------------------------------ reading

    def _describe(self, path: str) -> tuple[str | None, int | None]:
        """(error, context limit) of the model at ``path``, read once per file version."""
        version = _version(path)
        got = self._described.get(path)
        if got is not None and got[0] == version:
            return got[1], got[2]
        try:
            desc = read_shape(path)
            err, ctx = None, desc.context_limit
        except (ModelError, GGUFError, OSError, ValueError) as e:
            err, ctx = getattr(e, "reason", None) or str(e), None
        self._described[path] = (version, err, ctx)
        return err, ctx

    def _checked(self, entry: CatalogEntry) -> CatalogEntry:
        if not _is_model(entry.path):
            why = "nothing there" if not os.path.exists(entry.path) else "not a model folder or .gguf file"
            return replace(entry, error=f"{entry.path}: {why}")
        err, ctx = self._describe(entry.path)
        target, mtime = _version(entry.path)
        return replace(
            entry,
            error=f"{entry.path}: {err}" if err else None,
            context_limit=ctx,
            modified=max(0, mtime // 1_000_000_000),
            size_bytes=_weights_size(entry.path, target),
        )

    def refresh(self, force: bool = False) -> bool:
        """Re-read the roots if a folder changed since the last scan; True if it did."""
        seen = _folders(self.roots)
        if not force and seen == self._seen:
            return False
        self._seen = seen
        taken = {n for e in self._configured for n in e.names}
        # the same path (not the same file: a link under another name is another entry)
        paths = {os.path.abspath(e.path) for e in self._configured}
        found: list[CatalogEntry] = []
        for path in discover(self.roots):
            name = served_name(path)
            if has_control(name):  # (once per change of the folders: refresh() reads them then)
                log.warning("--models-dir: %s is left out: its name has a control character", escaped(path))
                continue
            if name in taken or os.path.abspath(path) in paths:
                continue  # a configured entry (or an earlier root) has it
            taken.add(name)
            entry = CatalogEntry(name=name, path=path)
            if escapes(path, [os.path.realpath(r) for r in self.roots]):
                found.append(replace(entry, error=f"{path}: it links outside the --models-dir folders"))
                continue
            found.append(self._checked(entry))
        self._discovered = found
        for gone in set(self._described) - {e.path for e in self.entries()}:
            del self._described[gone]
        return True

    # ------------------------------------------------------------ asking

    def entries(self) -> list[CatalogEntry]:
        """Configured entries first, then the discovered ones in the roots' order."""
        return [*self._configured, *self._discovered]

    def lookup(self, name: str | None) -> CatalogEntry | None:
        """The entry named (or aliased) ``name``; the roots are re-read on a miss."""
        if not name:
            return None
        hit = self._find(name)
        if hit is None and self.refresh():
            hit = self._find(name)
        return hit

    def get(self, name: str | None) -> CatalogEntry | None:
        """The entry named (or aliased) ``name``, without re-reading the roots."""
        return self._find(name) if name else None

    def known(self, name: str) -> bool:
        """Whether ``name`` is an entry's name or alias (no re-read)."""
        return self._find(name) is not None

    def canonical(self, name: str | None) -> str | None:
        """The entry name ``name`` means (an alias resolved), else ``name`` itself."""
        hit = self._find(name) if name else None
        return hit.name if hit is not None else name

    def _find(self, name: str) -> CatalogEntry | None:
        for e in self.entries():
            if name in e.names:
                return e
        return None
