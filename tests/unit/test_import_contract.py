"""The import lines of docs/design.md, checked statically over every module (every import statement,
also the ones inside functions):

- the router (``pantheon/``) never imports torch or ``workers``, nor the offline model writer
  ``makemodel`` (dev tooling: ``pantheon make-model`` reaches it through ``pantheon/cli.py``'s
  table of lazily imported subcommands, which names it as a string);
- ``makemodel/`` imports torch only inside its functions, so importing it stays torch-free, and
  nothing of the HTTP side, the TUI or ``workers``;
- ``workers/`` never imports the HTTP, TUI or tokenizer side: quart, hypercorn, textual, httpx,
  jinja2, tokenizers, nor ``pantheon`` beyond the wire protocol and the torch-free tables it
  shares with the router;
- ``tui/`` talks HTTP only: no torch, zmq, quart, hypercorn, ``workers``, and from ``pantheon``
  only the snapshot types (``pantheon.snapshot``).

The runtime twins of these checks (what a process really has in ``sys.modules``) are in
tests/e2e (test_serve, test_worker, test_workerpool) and tests/tui/test_tui_imports.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT

RULES = {
    "pantheon": {"forbidden": {"torch", "workers", "textual", "makemodel"}, "pantheon_allowed": None},
    "workers": {
        "forbidden": {"quart", "hypercorn", "textual", "httpx", "jinja2", "tokenizers", "tui", "makemodel"},
        # from pantheon only its core: what both processes share (the wire, model descriptions,
        # GGUF metadata, sizing, CURVE keys), which imports nothing else of pantheon (below)
        "pantheon_allowed": {"pantheon.core"},
    },
    "tui": {
        "forbidden": {"torch", "zmq", "quart", "hypercorn", "workers", "msgspec.msgpack"},
        "pantheon_allowed": {"pantheon.snapshot"},
    },
    "makemodel": {
        "forbidden": {"quart", "hypercorn", "textual", "workers", "tui"},
        "pantheon_allowed": {"pantheon.core"},  # the family descriptions and GGUF reading it shares
        "lazy": {"torch"},
    },
}


def imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports, with whether the import sits at module level."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, bool]] = []
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from pantheon.core import protocol" imports pantheon.core.protocol (for an attribute the
            # name is not a module, but its first part still is)
            out += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return out


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(RULES))
def test_import_lines(package):
    rule = RULES[package]
    broken = []
    for path in modules(package):
        rel = path.relative_to(ROOT).as_posix()
        for name, at_top in imports(path):
            head = name.split(".")[0]
            if head in rule.get("lazy", ()):
                if at_top:
                    broken.append(f"{rel} imports {name} at module level (only inside a function)")
                continue
            if head in rule["forbidden"] or name in rule["forbidden"]:
                broken.append(f"{rel} imports {name}")
            allowed = rule["pantheon_allowed"]
            if (
                head == "pantheon"
                and allowed is not None
                and package != "pantheon"
                and not any(name == a or name.startswith(a + ".") for a in allowed)
            ):
                broken.append(f"{rel} imports {name} (only {sorted(allowed)} from pantheon)")
    assert not broken, "\n".join(broken)


def test_the_checker_sees_lazy_and_nested_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom a.b import c\ndef f():\n    import torch\n")
    assert imports(f) == [("os", True), ("a.b.c", True), ("torch", False)]


# The router's packages in layers, lowest first: a module imports from its own layer or below,
# never above (so control/ cannot reach into api/, nor config/ into control/). An import of a
# higher layer under ``if TYPE_CHECKING:`` is a type annotation only and allowed.
LAYERS = [
    {"core", "snapshot", "errors", "logs"},  # what both processes share, the wire, the vocabulary
    {"chat"},
    {"models"},
    {"config"},
    {"workerlink"},
    {"control"},
    {"api"},
    {"serve", "cli", "__main__"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for n in ast.walk(node)}
    return out


def _part(rel: Path) -> str:
    return rel.parts[1].removesuffix(".py")  # pantheon/<part>/... or pantheon/<part>.py


def test_the_router_packages_only_import_downwards():
    broken, seen = [], set()
    for path in modules("pantheon"):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py" and len(rel.parts) == 2:
            continue
        src = _part(rel)
        assert src in LAYER_OF, f"{rel}: put pantheon/{src} in a layer of LAYERS"
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            names = [f"pantheon.{a.name}" for a in node.names] if node.module == "pantheon" else [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] != "pantheon" or len(parts) < 2 or parts[1] not in LAYER_OF:
                    continue
                seen.add((src, parts[1]))
                if LAYER_OF[parts[1]] > LAYER_OF[src] and id(node) not in typing_only:
                    broken.append(f"{rel.as_posix()} imports {name} (a higher layer)")
    assert not broken, "\n".join(broken)
    assert ("api", "control") in seen and ("control", "workerlink") in seen  # the walk works


def test_the_core_both_processes_share_imports_only_itself():
    """``pantheon/core`` (what the router and the workers both import) takes nothing else of
    pantheon, so a worker that imports it pulls in nothing of the router; and neither torch nor
    the HTTP side."""
    broken = []
    for path in modules("pantheon"):
        rel = path.relative_to(ROOT)
        if rel.parts[1] != "core":
            continue
        for name, _top in imports(path):
            head = name.split(".")[0]
            if head in {"torch", "quart", "hypercorn", "textual", "jinja2", "tokenizers", "workers"}:
                broken.append(f"{rel} imports {name}")
            if head == "pantheon" and not (name == "pantheon.core" or name.startswith("pantheon.core.")):
                broken.append(f"{rel} imports {name} (pantheon/core imports only itself)")
    assert not broken, "\n".join(broken)
