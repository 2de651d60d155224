"""``python -m makemodel``: the same command as ``pantheon make-model``."""

import sys

from makemodel.cli import cli

raise SystemExit(cli(sys.argv[1:]))
