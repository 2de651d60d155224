"""Pantheon's worker side: the torch model, the KV cache pool and the batch engine.

One worker process owns one die. ``workers.engine.Engine`` is the in-process API the worker
process wraps; it never imports quart, textual or tokenizers.
"""
