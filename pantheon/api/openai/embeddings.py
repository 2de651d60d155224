"""``POST /v1/embeddings``: OpenAI's embeddings API, on the same slots and queue as generation.

A request: parse it (``input`` a string, a list of strings, token ids or a list of those;
``encoding_format`` float | base64; ``dimensions``; ``user`` ignored; ``keep_alive`` as on the
other routes), then ``pantheon.api.embedding.embed_inputs`` (shared with Ollama's ``/api/embed``:
route, check, tokenize, one slot, one ``EmbedRequest`` per input, ``dimensions``), then encode.

``usage.prompt_tokens`` (= ``total_tokens``) counts every input's tokens.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from dataclasses import dataclass

from quart import Blueprint, request

from pantheon import errors
from pantheon.api import fields, flow
from pantheon.api import middleware as ops
from pantheon.api.embedding import embed_inputs, parse_inputs
from pantheon.api.openai import protocol as oa
from pantheon.api.responses import json_response
from pantheon.api.state import app_state

bp = Blueprint("embeddings", __name__)


@dataclass
class EmbeddingsRequest:
    model: str | None
    inputs: list[str | list[int]]
    base64: bool = False
    dimensions: int | None = None
    keep_alive: float | None = None


def parse_embeddings_request(raw: bytes | str) -> EmbeddingsRequest:
    """Bytes -> ``EmbeddingsRequest``; raises ``ApiError`` (400)."""
    body = oa.load_json(raw)
    if not isinstance(body, dict):
        raise errors.not_an_object()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_param("model", "'model' must be a string")
    if "input" not in body:
        raise errors.invalid_param("input", "'input' is required")
    inputs = parse_inputs(body["input"])
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise errors.invalid_param("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise errors.invalid_param("dimensions", "'dimensions' must be a positive integer")
    return EmbeddingsRequest(model, inputs, fmt == "base64", dims, fields.keep_alive_field(body))


def encode_base64(v: list[float]) -> str:
    """OpenAI's base64 form: the float32 little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")


@bp.post("/v1/embeddings", provide_automatic_options=False)
async def embeddings():
    s = app_state()
    raw = await request.get_data(cache=False)
    big = len(raw) > flow.BIG_BODY
    req = await asyncio.to_thread(parse_embeddings_request, raw) if big else parse_embeddings_request(raw)
    del raw
    ops.body_done()  # the body's bytes leave the --max-body-in-flight count
    inst, vectors, tokens = await embed_inputs(
        s, req.model, req.inputs, dims=req.dimensions, keep_alive=req.keep_alive, big=big
    )
    data = [
        {"object": "embedding", "index": i, "embedding": encode_base64(v) if req.base64 else v}
        for i, v in enumerate(vectors)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": inst.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body, headers={"X-Pantheon-Instance": inst.instance_id})
