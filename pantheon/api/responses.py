"""JSON and error responses, the one way every route answers."""

from __future__ import annotations

from quart import Response

from pantheon.api.openai import protocol as oa
from pantheon.errors import ApiError


def json_response(obj: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(oa.dumps(obj), status=status, headers=headers or {}, content_type="application/json")


def error_response(e: ApiError) -> Response:
    """An ``ApiError`` as the OpenAI error object, with its status and headers."""
    return json_response(e.body(), e.status, e.headers)
