"""Shared test helpers, imported as ``helpers.*`` (``tests/`` is on ``sys.path``: pytest puts the
rootdir conftest's folder there, and ``[tool.pytest.ini_options] pythonpath`` names it too).

- ``helpers.paths``: the repository root and the shared specs folder;
- ``helpers.openapi``: ``check(name, obj)``, validation against the OpenAI OpenAPI schemas;
- ``helpers.serve``: ``Server`` (a real ``pantheon serve`` subprocess), ``MSG``, ``check_error``.
"""
