"""The ``pantheon`` command: one entry point, a subcommand per program.

Each subcommand's module is imported only when it runs, so ``pantheon serve`` never pulls in
torch and ``pantheon tui`` never pulls in zmq.
"""

from __future__ import annotations

import sys

_COMMANDS = {
    "serve": ("pantheon.serve", "start the router (HTTP API) and its workers"),
    "worker": (
        "workers.worker",
        "run one worker process (spawned by serve, or joining one from another host)",
    ),
    "keys": ("pantheon.core.curve", "CURVE keys for workers on other hosts ('keys new DIR')"),
    "make-model": ("makemodel.cli", "write a random-weight model folder from a preset"),
    "tui": ("tui.app", "the live dashboard"),
}


def _usage() -> str:
    lines = ["usage: pantheon COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"pantheon: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
