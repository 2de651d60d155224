"""The ``pantheon serve`` flags and ``--help``, generated from the settings table.

Every row with a flag becomes one argparse argument, its help the row's help followed by its
default and its variables (``(default 8) [env: PANTHEON_BATCH_SLOTS, QWEN35_BATCH_SLOTS]``); the
rows without a flag (the spec's engine knobs) are listed in the epilog. Argparse only collects
what was typed (every default is None, "not given"): the table's defaults and checks are applied
by ``build_config``, after the variables and the config file, so that precedence holds.
"""

from __future__ import annotations

import argparse
import textwrap

from pantheon.config.table import REFUSED_ENV, SETTINGS, Setting
from pantheon.config.values import ConfigError, format_size, parse_dies


class ModelAction(argparse.Action):
    """``--model PATH [--name NAME] [--dies LIST]``: ``--name`` and ``--dies`` apply to the
    ``--model`` before them; the result is ``models``, a list of ``{"path", "name", "dies"}``."""

    def __call__(self, parser, ns, value, option=None):
        models = getattr(ns, "models", None) or []
        if option == "--model":
            models.append({"path": value})
        elif not models:
            parser.error(f"{option} must follow the --model it applies to")
        elif option == "--name":
            if "name" in models[-1]:
                parser.error(f"--name given twice for --model {models[-1]['path']}")
            models[-1]["name"] = value
        else:
            try:
                models[-1]["dies"] = parse_dies(value)
            except ConfigError as e:
                parser.error(str(e))
        ns.models = models


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def default_text(row: Setting) -> str | None:
    """The help's words for the row's default (``default 8``, ``default 30 s``,
    ``default: the worker decides``); None when the help says nothing about it."""
    if row.default_doc is not None:
        return f"default: {row.default_doc}"
    d = row.default
    if d is None or d == () or row.kind in ("model", "meta"):
        return None
    if isinstance(d, bool):
        shown = "on" if d else "off"
    elif row.kind in ("size", "size0"):
        shown = format_size(d)
    elif isinstance(d, tuple):
        shown = ",".join(_num(x) for x in d)
    elif isinstance(d, (int, float)):
        shown = _num(d)
    else:
        shown = str(d)
    return f"default {shown}" + (f" {row.unit}" if row.unit else "")


def help_text(row: Setting) -> str:
    """The row's full help: its text, its default, its variables."""
    out = row.help
    if (dt := default_text(row)) is not None:
        out += f" ({dt})"
    if row.env:
        out += f" [env: {', '.join(row.env)}]"
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """One argument per row with a flag, in the table's order."""
    for row in SETTINGS:
        if row.flag is None:
            continue
        # argparse %-formats help strings (for %(default)s): a literal % must be doubled
        kw: dict = {"dest": row.name, "default": None, "help": help_text(row).replace("%", "%%")}
        if row.kind == "model":
            kw.update(action=ModelAction, dest="models", metavar=row.metavar)
        elif row.kind in ("bool", "switch"):
            kw.update(action="store_const", const=True)
        elif row.kind in ("list", "keys"):
            kw.update(action="append", metavar=row.metavar)
        else:
            kw.update(metavar=row.metavar, type={"int": int, "float": float}.get(row.kind, str))
        ap.add_argument(row.flag, **kw)


def epilog() -> str:
    """The variables-only knobs, the refused variables, the precedence and the signals."""

    def para(text: str, indent: str) -> list[str]:
        return textwrap.wrap(
            text, 78, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    lines = ["environment variables without a flag (the spec's engine knobs):"]
    for row in SETTINGS:
        if row.flag is None and row.env:
            lines.append(f"  {' / '.join(row.env)}")
            dt = default_text(row)
            lines += para(row.help + (f" ({dt})" if dt else ""), "      ")
    lines.append(f"  {' / '.join(REFUSED_ENV)}")
    lines += para("refused at startup (a debug knob that copies the full logits every step)", "      ")
    lines += [""] + para(
        "precedence: flag > environment variable > --config file > default. "
        "Spec names (QWEN35_*, BS_*, PN_*) are aliases of the PANTHEON_* ones.",
        "",
    )
    lines += para(
        "SIGTERM/SIGINT: stop admitting (503), let requests finish up to "
        "--drain-timeout, then exit 0; a second signal exits at once.",
        "",
    )
    return "\n".join(lines)


def build_parser(
    prog: str = "pantheon serve", description: str = "Serve models over an OpenAI-compatible HTTP API."
) -> argparse.ArgumentParser:
    """The ``pantheon serve`` parser: every flag of the table, the epilog, no other source."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    return ap
