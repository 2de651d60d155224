"""Embedding on the router side, shared by OpenAI's ``/v1/embeddings``
(``pantheon.api.openai.embeddings``) and Ollama's ``/api/embed`` (``pantheon.api.ollama``).

``parse_inputs`` reads an ``input`` (a string, a list of strings, token ids or a list of those);
``embed_inputs`` runs the rest, in order: route the request (``Registry.route``: 404 / 503; a
catalog model is loaded first) -> check the model embeds (``embedding_of``: 400 naming it) and
``dimensions`` (400 unless the model was trained for Matryoshka sizes, and at most its size) ->
tokenize every input (400 for an empty one or one past the model's context, naming the numbers)
-> acquire one slot for the request (``Registry.acquire_slot``: the FIFO queue, 429 / 503) -> one
``EmbedRequest`` per input to the instance's worker, where each is a prefill beside the running
generations (pooled and normalised there) -> gather the vectors, truncate and renormalise for
``dimensions``. The prompt-token count it returns counts every input's tokens.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
import uuid

from pantheon import errors
from pantheon.api import flow
from pantheon.api.generation import _pool_error, vocab_size
from pantheon.api.state import AppState
from pantheon.control.context import Prepared, limit_of
from pantheon.control.registry import Instance
from pantheon.core.embedding import EmbeddingSpec, served_embedding
from pantheon.core.protocol import EmbedOut, EmbedRequest
from pantheon.errors import ApiError

MAX_INPUTS = 2048  # OpenAI's own ceiling on inputs per request (Ollama's /api/embed too)


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_inputs(value: object, param: str = "input") -> list[str | list[int]]:
    """``input`` -> one entry per input (a string or token ids); 400 naming ``param``."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and _is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(x, str) or _is_ids(x) for x in value):
        if len(value) > MAX_INPUTS:
            raise errors.invalid_param(param, f"'{param}' holds {len(value)} inputs; at most {MAX_INPUTS}")
        return list(value)
    if value == []:
        raise errors.invalid_param(param, f"'{param}' is empty")
    raise errors.invalid_param(
        param, f"'{param}' must be a string, a list of strings, token ids or a list of token-id lists"
    )


def embedding_of(inst: Instance) -> EmbeddingSpec | None:
    """How ``inst`` embeds (its model's own way, or mean pooling when its load asked), or None."""
    return served_embedding(getattr(inst.shape, "embedding", None), inst.embeddings)


def check_dimensions(inst: Instance, spec: EmbeddingSpec, dims: int | None) -> None:
    """A 400 naming ``dimensions`` when the model was not trained for it, or past its size."""
    if dims is None:
        return
    size = int(getattr(inst.shape, "hidden_size", 0) or 0)
    if spec.matryoshka is None:
        raise errors.invalid_param(
            "dimensions", f"the model '{inst.name}' does not support 'dimensions' (no Matryoshka training)"
        )
    if dims > size:
        raise errors.invalid_param(
            "dimensions", f"'dimensions' {dims} is larger than the model's embedding size {size}"
        )
    if spec.matryoshka and dims not in spec.matryoshka:
        sizes = ", ".join(map(str, spec.matryoshka))
        raise errors.invalid_param("dimensions", f"'dimensions' must be one of {sizes} for '{inst.name}'")


def tokenize_inputs(
    inst: Instance,
    inputs: list[str | list[int]],
    param: str = "input",
    truncate: bool = False,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Every input as token ids for ``inst`` (strings with the tokenizer's special tokens, as
    sentence-transformers encodes them, cut to ``max_tokens`` with them as it cuts them: the
    model's ``max_seq_length``); 400 for an empty one, an id outside the vocabulary or one past
    the model's context (``truncate``: cut to the context instead, Ollama's default)."""
    tok, vocab, limit = inst.model_assets.tokenizer, vocab_size(inst), limit_of(inst)
    out: list[list[int]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            if not x:  # its special tokens alone are not a text to embed
                raise errors.invalid_param(param, f"'{param}' {i} is empty")
            enc = tok.encode(x, add_special_tokens=False)
            if max_tokens is not None:
                enc.truncate(max(1, max_tokens - tok.num_special_tokens_to_add(False)))
            ids = tok.post_process(enc).ids
        else:
            ids = list(x)
        if not ids:
            raise errors.invalid_param(param, f"'{param}' {i} is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.invalid_param(
                param, f"'{param}' {i}: token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        if len(ids) > limit and truncate:
            ids = ids[:limit]
        if len(ids) > limit:
            raise errors.input_too_long(limit, len(ids), i)
        out.append(ids)
    return out


async def _place(
    s: AppState,
    model: str | None,
    inputs: list[str | list[int]],
    dims: int | None,
    big: bool,
    param: str,
    truncate: bool,
) -> tuple[Instance, tuple[EmbeddingSpec, list[list[int]]]]:
    """Place the request (``pantheon.api.flow.place``): the model checked to embed, the inputs
    tokenized and checked for the instance, before any slot."""

    def check(inst: Instance) -> tuple[EmbeddingSpec, list[list[int]]]:
        spec = embedding_of(inst)
        if spec is None:
            raise errors.model_cannot_embed(inst.name)
        check_dimensions(inst, spec, dims)
        return spec, tokenize_inputs(inst, inputs, param, truncate, spec.max_tokens)

    async def prepare(inst: Instance) -> tuple[EmbeddingSpec, list[list[int]]]:
        return await asyncio.to_thread(check, inst) if big else check(inst)

    _, inst, ready = await flow.place(s, model, None, prepare)
    return inst, ready


async def embed_inputs(
    s: AppState,
    model: str | None,
    inputs: list[str | list[int]],
    *,
    dims: int | None = None,
    keep_alive: float | None = None,
    big: bool = False,
    param: str = "input",
    truncate: bool = False,
) -> tuple[Instance, list[list[float]], int]:
    """Admit, embed every input on one instance (its worker batches them beside generation),
    release: ``(instance, vectors, prompt tokens)``; ``dims`` truncates and renormalises."""

    async def place() -> tuple[Instance, Prepared]:
        inst, ready = await _place(s, model, inputs, dims, big, param, truncate)
        box.append(ready)
        return inst, Prepared([], "", False, 0)

    box: list[tuple[EmbeddingSpec, list[list[int]]]] = []
    try:
        inst, _ = await flow.through_recovery(s, place, model)
    except ApiError as e:
        s.feed.reject(e.status, model, e.code, e.message)  # counts 429s and 503s
        raise
    spec, ids = box[-1]
    t0 = time.monotonic()
    try:
        vectors = await _run(s, inst, spec, ids)
    finally:
        s.registry.leave(inst)
        s.residency.keep(inst.name, keep_alive)
        s.feed.request_done(time.monotonic() - t0)
    if dims is not None:
        vectors = [_renormalised(v[:dims]) for v in vectors]
    return inst, vectors, sum(len(x) for x in ids)


async def _run(s: AppState, inst: Instance, spec: EmbeddingSpec, ids: list[list[int]]) -> list[list[float]]:
    """One ``EmbedRequest`` per input, all at once; their vectors in input order. Every stream
    is aborted when the client goes away."""
    base = f"embd-{uuid.uuid4().hex[:16]}"
    streams = []
    try:
        for i, prompt in enumerate(ids):
            msg = EmbedRequest(
                request_id=f"{base}-{i}",
                instance=inst.instance_id,
                prompt=prompt,
                pooling=spec.pooling,
                normalize=spec.normalize,
                more=i < len(ids) - 1,
            )
            streams.append(s.pool.submit(inst.die, msg))
        outs = await asyncio.gather(*(st.result() for st in streams))
    except (GeneratorExit, asyncio.CancelledError):
        raise
    except BaseException as e:
        raise _pool_error(e, base) from None
    finally:
        for st in streams:
            st.abort()  # a no-op once the worker answered
    vectors = []
    for out in outs:
        if not isinstance(out, EmbedOut):
            raise errors.worker_no_finish()  # the pool could not hold it, or it was aborted
        n = len(out.vector) // 4
        vectors.append(list(struct.unpack(f"<{n}f", out.vector)))
    return vectors


def _renormalised(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else v
