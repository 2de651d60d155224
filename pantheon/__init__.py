"""Pantheon: an OpenAI-compatible, multi-model inference server.

This package is the router side (HTTP, registry, chat templates, tokenization). It never
imports torch or textual; the torch code lives in ``workers`` and the dashboard in ``tui``.
"""

__version__ = "0.1.0"
