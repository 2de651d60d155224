"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them, answered by the router's own
tokenizer (no worker round trip, no slot).

=======  ============  ==================================================================
POST     /tokenize     ``{model, prompt}`` or ``{model, messages, add_generation_prompt?,
                       tools?, chat_template_kwargs?}``, ``add_special_tokens?`` (default:
                       true for a prompt, false for messages, whose template writes them),
                       ``return_token_strs?`` -> ``{count, max_model_len, tokens,
                       token_strs}``
POST     /detokenize   ``{model, tokens}`` -> ``{prompt}``
=======  ============  ==================================================================

A token id is one of the model's (``pantheon.api.generation.vocab_size``: its embedding's rows, which a
completion prompt's ids are checked against too); the rows past the tokenizer's own tokens
(a vocabulary padded to a multiple of 32 or 64) decode to nothing.

The messages are the chat route's (validated by ``parse_chat_request``) and rendered by the
same template, so ``count`` is what a chat request's prompt would hold. ``max_model_len`` is the
instance's real per-request limit.
"""

from __future__ import annotations

import asyncio

from quart import Blueprint, request

from pantheon import errors
from pantheon.api import middleware as ops
from pantheon.api.generation import vocab_size
from pantheon.api.openai import protocol as oa
from pantheon.api.responses import json_response
from pantheon.api.state import app_state
from pantheon.chat.template import TemplateError
from pantheon.control.context import limit_of
from pantheon.models.assets import ModelAssets

bp = Blueprint("tokenize", __name__)


async def _body() -> dict:
    raw = await request.get_data(cache=False)
    body = oa.load_json(raw or b"{}")
    ops.body_done()
    if not isinstance(body, dict):
        raise errors.not_an_object()
    return body


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise errors.invalid_param(key, f"'{key}' must be a boolean")
    return v


def _tokenize(assets: ModelAssets, body: dict) -> list[int]:
    """The token ids of the body's prompt or messages (runs off the event loop)."""
    if "messages" in body:
        if "prompt" in body:
            raise errors.invalid_param("prompt", "give 'prompt' or 'messages', not both")
        req = oa.parse_chat_request(
            {
                "model": body.get("model"),
                "messages": body["messages"],
                **{k: body[k] for k in ("tools", "chat_template_kwargs") if k in body},
            }
        )
        add_gen = _flag(body, "add_generation_prompt", True)
        try:
            text = assets.template.render(
                req.messages,
                tools=req.tools or None,
                add_generation_prompt=add_gen,
                **req.chat_template_kwargs,
            )
        except TemplateError as e:
            raise errors.chat_template_refused(e.message) from None
        special = _flag(body, "add_special_tokens", False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise errors.invalid_param("prompt", "'prompt' (a string) or 'messages' is required")
        special = _flag(body, "add_special_tokens", True)
    return assets.tokenizer.encode(text, add_special_tokens=special).ids


@bp.post("/tokenize", provide_automatic_options=False)
async def tokenize():
    body = await _body()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_param("model", "'model' must be a string")
    inst = app_state().registry.route(model, None)  # 404 / 503 as the chat route
    ids = await asyncio.to_thread(_tokenize, inst.model_assets, body)
    strs = (
        [inst.model_assets.tokenizer.id_to_token(i) for i in ids]
        if _flag(body, "return_token_strs", False)
        else None
    )
    return json_response(
        {"count": len(ids), "max_model_len": limit_of(inst), "tokens": ids, "token_strs": strs}
    )


@bp.post("/detokenize", provide_automatic_options=False)
async def detokenize():
    body = await _body()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.invalid_param("model", "'model' must be a string")
    inst = app_state().registry.route(model, None)
    ids = body.get("tokens")
    vocab = vocab_size(inst)  # the bound a prompt's ids are checked against, the same model's
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise errors.invalid_param("tokens", "'tokens' must be an array of token ids")
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise errors.invalid_param("tokens", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    text = await asyncio.to_thread(inst.model_assets.tokenizer.decode, ids, skip_special_tokens=False)
    return json_response({"prompt": text})
