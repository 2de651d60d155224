"""The one error class the core raises for a bad setting (a CURVE key folder, a listen address):
``ConfigError``, which the configuration layer (``pantheon.config.values``) raises too."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag or environment variable has a value the server cannot run with."""
