"""Ollama's API (``/api/*``) on the router, for the official ``ollama`` clients and the tools that
speak Ollama: ``protocol`` (its request and response objects, typed, and the mapping of a request
onto our ``GenerationRequest``), ``listing`` (what ``/api/tags``, ``/api/ps`` and ``/api/show`` say of
a model), ``generation`` (a ``Generation`` whose output is Ollama's NDJSON) and ``routes`` (the
blueprint). Generation and embedding themselves are ``pantheon.api.generation``'s and
``pantheon.api.embedding``'s, as on the OpenAI routes: same admission, slots, template, grammars
and emitter; nothing here imports ``pantheon.api.openai``."""
