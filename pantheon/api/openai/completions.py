"""``POST /v1/completions``: the legacy text completion API (lm-eval-harness, aiperf and many
benchmarks speak it), on the same slots, sampler and stop handling as the chat route.

The request is the chat route's sampling fields (checked by the same checks, ``pantheon.api.fields``: ``temperature``,
``top_p``, ``n``, ``stop``, ``seed``, ``max_tokens``, the penalties, ``logit_bias``, ``stream``,
``stream_options``, the extensions) plus:

- ``prompt``: a string, token ids, or a list holding one of those. Several prompts in one
  request are refused with a 400 naming ``prompt`` (send one request per prompt; each gets its
  own slot and queue place);
- ``echo``: the prompt's text comes first in each choice's ``text``; with ``logprobs`` the
  prompt's tokens come first in its ``logprobs`` too, as OpenAI's did (the first token's
  ``token_logprobs`` and ``top_logprobs`` entries are null: nothing predicts it). With ``echo``,
  ``max_tokens: 0`` is pure scoring (lm-evaluation-harness's ``local-completions``): the choice
  is the prompt alone, ``finish_reason`` ``length``, no completion tokens (the worker runs it
  as one token, which is dropped, so the prompt must leave one position of room);
- ``logprobs``: an integer 0..5, the completion API's ``{tokens, token_logprobs, top_logprobs,
  text_offset}`` (``top_logprobs``: the ``logprobs`` most likely tokens at each position);
- ``prompt_logprobs`` (vLLM's, 0..20, not with ``stream``): each choice's ``prompt_logprobs``,
  null first, then per position ``{token_id: {logprob, rank, decoded_token}}`` with the prompt's
  token and the top K. Prompt logprobs are computed in the request's own prefill
  (``workers/prompt_logprobs.py``), so such a request does not use the prefix cache;
- ``suffix`` (insertion) is a 400; ``best_of`` only as ``n``.

No chat template: the prompt is tokenized as is (with the tokenizer's special tokens, as vLLM
does for text). A prompt that does not fit the context is the OpenAI 400 naming ``prompt``,
never capped; a ``max_tokens`` no context holds, whatever the prompt, names ``max_tokens``.

The sampling fields a request leaves out come from the model's defaults, as on the chat route
(``pantheon.models.generation_defaults``). ``max_tokens`` left out: a default ``max_tokens``
(the catalog entry's, the model's ``max_new_tokens``) applies as it does on the chat route, a
ceiling on the completion (no 400 while the prompt leaves a token of room); without one it is
OpenAI's 16, as if given (a prompt that leaves no room for 16 is the 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Blueprint, request

from pantheon import errors
from pantheon.api import fields, flow, structured
from pantheon.api import middleware as ops
from pantheon.api.generation import (
    ChoiceRun,
    Generation,
    _pool_error,
    checked_constraint,
    needs_constraint,
)
from pantheon.api.openai import protocol as oa
from pantheon.api.state import AppState, app_state
from pantheon.chat.detokenize import IncrementalDetokenizer
from pantheon.chat.emitter import Emitter
from pantheon.control.context import Prepared, fit
from pantheon.control.registry import Instance
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError
from pantheon.workerlink.pool import WorkerPool

bp = Blueprint("completions", __name__)

OPENAI_MAX_TOKENS = 16  # the completion API's default

MAX_LOGPROBS = 5  # the completion API's own ceiling
# the body fields shared with the chat route, checked as there (the rest are ours, or refused)
_SHARED = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_window",
    "repeat_last_n",
    "min_tokens",
    "ignore_eos",
    "speculative",
    "session_id",
    "cache_salt",
    "keep_alive",
    "prompt_logprobs",
    # output constraints (pantheon.api.structured), vLLM's names
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class CompletionRequest:
    """A parsed ``/v1/completions`` body: the generation request (its ``prompt`` raw, no
    template), and what the completion API's output needs of the body.

    ``logprobs``: -1 when not asked; ``prompt_logprobs``: the client's own
    (``chat.prompt_logprobs`` is what the worker is asked for, which ``echo`` with ``logprobs``
    needs too)."""

    def __init__(
        self, chat: GenerationRequest, echo: bool, logprobs: int, *, prompt_logprobs: int | None = None
    ):
        self.chat, self.echo, self.logprobs, self.prompt_logprobs = chat, echo, logprobs, prompt_logprobs

    @property
    def prompt(self) -> str | list[int]:
        assert self.chat.prompt is not None
        return self.chat.prompt

    @property
    def score_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt scored, nothing generated."""
        return self.chat.score_only


def parse_completion_request(raw: bytes | str) -> CompletionRequest:
    """Bytes -> ``CompletionRequest``; raises ``ApiError`` (400)."""
    body = fields.load_json(raw)
    if not isinstance(body, dict):
        raise errors.not_an_object()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise errors.invalid_param(
                "prompt", f"one prompt per request here (got {len(prompt)}); send one request per prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise errors.invalid_param(
                "prompt", "'prompt' must be a string, token ids, or a list holding one of those"
            )
        if any(t > fields.INT64_MAX for t in prompt):  # the vocabulary is checked once routed
            raise errors.invalid_param("prompt", "'prompt' holds a token id out of range")
    elif not isinstance(prompt, str):
        raise errors.invalid_param(
            "prompt", "'prompt' must be a string, token ids, or a list holding one of those"
        )
    if body.get("suffix") not in (None, ""):
        raise errors.invalid_param("suffix", "'suffix' (insertion) is not supported")
    n = body.get("n", 1)
    if body.get("best_of") not in (None, n):
        raise errors.invalid_param("best_of", "'best_of' is supported only equal to 'n'")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise errors.invalid_param("echo", "'echo' must be a boolean")
    lp = body.get("logprobs")
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
        raise errors.invalid_param("logprobs", f"'logprobs' must be an integer 0..{MAX_LOGPROBS}")
    given: dict[str, object] = {k: body[k] for k in _SHARED if k in body}
    # echo with max_tokens 0: score the prompt, generate nothing (what OpenAI's took)
    score_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if score_only:
        del given["max_tokens"]
    if lp is not None:
        given["logprobs"] = True
        given["top_logprobs"] = lp
    model = fields.string(given.get("model"), "model")
    # no template, so no messages: the prompt is raw
    chat = fields.generation_request(given, model=model, messages=[])
    fields.with_tools(chat, None, ("auto", None), structured.request_grammar(given))
    chat.prompt, chat.score_only, chat.fallback_max_tokens = prompt, score_only, OPENAI_MAX_TOKENS
    asked = chat.prompt_logprobs
    if echo and lp is not None:  # the prompt's tokens lead the logprobs: the worker computes them
        chat.prompt_logprobs = max(lp, asked or 0)
    return CompletionRequest(chat, echo, -1 if lp is None else lp, prompt_logprobs=asked)


def _prepare(inst: Instance, creq: CompletionRequest) -> Prepared:
    """Check the prompt's token ids against ``inst``'s vocabulary, then fit the request
    (``pantheon.control.context.fit``: the model's defaults, a raw prompt that must fit)."""
    flow.check_token_ids(inst, creq.chat, None if isinstance(creq.prompt, str) else list(creq.prompt))
    return fit(inst, creq.chat)


class TextGeneration(Generation):
    """A ``Generation`` whose output is ``text_completion`` objects: plain text, no template,
    reasoning or tool-call parsing, the completion API's logprobs."""

    def __init__(
        self,
        pool: WorkerPool,
        inst: Instance,
        req: GenerationRequest,
        prep: Prepared,
        fingerprint: str,
        *,
        arrived: float | None = None,
        on_tokens: Callable[[int], None] | None = None,
        creq: CompletionRequest,
        prompt_text: str,
    ):
        super().__init__(pool, inst, req, prep, fingerprint, arrived=arrived, on_tokens=on_tokens)
        self.id = "cmpl-" + self.id.removeprefix("chatcmpl-")
        self.creq, self.prompt_text = creq, prompt_text

    def _emitter(self):
        return Emitter(reasoning=False, stop=self.req.stop, tools_enabled=False, think_open=False)

    def _lp(self, lps: list[dict], start: int) -> dict:
        """Chat-style token logprobs -> the completion API's, offsets from ``start``."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        at = start
        for d in lps:
            out["tokens"].append(d["token"])
            out["token_logprobs"].append(d["logprob"])
            out["top_logprobs"].append({t["token"]: t["logprob"] for t in d["top_logprobs"]})
            out["text_offset"].append(at)
            at += len(d["token"])
        return out

    def _echo_lp(self, run: ChoiceRun) -> dict:
        """The prompt's tokens in the completion API's logprobs (``echo`` with ``logprobs``):
        the first has null ``token_logprobs`` and ``top_logprobs`` entries, as OpenAI's did."""
        piece = self.inst.model_assets.piece
        got, k = run.prompt_logprobs, self.creq.logprobs
        prompt = self.prep.prompt_ids
        tokens = [piece(t)[0] for t in prompt]
        # offsets into the echoed text: where each token's text starts in the prompt's decode
        # (a token's own piece may be part of a character, or a special token's name)
        detok = IncrementalDetokenizer(self.inst.model_assets.tokenizer, skip_special_tokens=False)
        offsets, at, end = [], 0, len(self.prompt_text)
        for t in prompt:
            offsets.append(min(at, end))
            at += len(detok.push(t))
        lps: list[float | None] = [None] * len(prompt)
        tops: list[dict[str, float] | None] = [None] * len(prompt)
        if got is not None:
            lps[1:] = [max(x, -9999.0) for x in got.logprobs]
            tops[1:] = [{piece(t)[0]: max(v, -9999.0) for t, v in top[:k]} for top in got.top]
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _with_echo(self, run: ChoiceRun, lp: dict | None) -> dict | None:
        """``lp`` (the completion's logprobs, or None) led by the prompt's, when echoed."""
        if not (self.creq.echo and self.creq.logprobs >= 0):
            return lp
        head = self._echo_lp(run)
        return head if lp is None else {k: head[k] + lp[k] for k in head}

    def _choice(self, run: ChoiceRun, text: str, lp: dict | None, finish: str | None) -> dict:
        out = {"index": run.index, "text": text, "logprobs": lp, "finish_reason": finish}
        if self.creq.prompt_logprobs is not None:
            piece = self.inst.model_assets.piece
            out["prompt_logprobs"] = oa.prompt_logprobs(
                self.prep.prompt_ids, run.prompt_logprobs, self.creq.prompt_logprobs, lambda t: piece(t)[0]
            )
        return out

    def usage(self) -> dict:
        if not self.creq.score_only:
            return super().usage()
        cached = max(r.cached_tokens for r in self.runs)
        return oa.usage(len(self.prep.prompt_ids), 0, cached_tokens=cached)

    def _body(self, choices: list[dict], usage: dict | None) -> dict:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return self._capped(body)

    async def complete(self) -> dict:
        texts = {r.index: [self.prompt_text] if self.creq.echo else [] for r in self.runs}
        lps: dict[int, list[dict]] = {r.index: [] for r in self.runs}
        scoring = self.creq.score_only  # the one token run is dropped
        async with contextlib.aclosing(self._all_pieces()) as pieces:
            async for p in pieces:
                if not scoring:
                    texts[p.index] += [d.text or "" for d in p.deltas if d.kind == "content"]
                    lps[p.index] += p.logprobs or []
        start = len(self.prompt_text) if self.creq.echo else 0
        choices = [
            self._choice(
                r,
                "".join(texts[r.index]),
                self._with_echo(r, self._lp(lps[r.index], start)) if self.creq.logprobs >= 0 else None,
                "length" if scoring else r.finish_reason or "stop",
            )
            for r in self.runs
        ]
        return self._body(choices, self.usage())

    async def stream_chunks(self) -> AsyncIterator[bytes]:
        offsets = {r.index: len(self.prompt_text) if self.creq.echo else 0 for r in self.runs}
        # echo: the prompt's chunk; with logprobs it waits for the prompt's (the run's first piece)
        echo_waits = self.creq.echo and self.creq.logprobs >= 0
        echoed = set() if echo_waits else {r.index for r in self.runs}
        if self.creq.echo and not echo_waits:
            for r in self.runs:
                yield oa.sse(self._body([self._choice(r, self.prompt_text, None, None)], None))
        try:
            async with contextlib.aclosing(self._all_pieces()) as pieces:
                async for p in pieces:
                    run = self.runs[p.index]
                    if p.index not in echoed:
                        echoed.add(p.index)
                        yield oa.sse(
                            self._body([self._choice(run, self.prompt_text, self._echo_lp(run), None)], None)
                        )
                    if self.creq.score_only:  # the one token run is dropped
                        if p.finish is not None:
                            yield oa.sse(self._body([self._choice(run, "", None, "length")], None))
                        continue
                    text = "".join(d.text or "" for d in p.deltas if d.kind == "content")
                    lp = None
                    if self.creq.logprobs >= 0 and p.logprobs:
                        lp = self._lp(p.logprobs, offsets[p.index])
                    offsets[p.index] += len(text)
                    if text or lp is not None or p.finish is not None:
                        yield oa.sse(self._body([self._choice(run, text, lp, p.finish)], None))
            if self.req.include_usage:
                yield oa.sse(self._body([], self.usage()))
        except ApiError as e:
            yield oa.sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream must still end cleanly
            yield oa.sse(_pool_error(e, self.id).body())
        yield oa.SSE_DONE


async def _place(s: AppState, creq: CompletionRequest, big: bool) -> tuple[Instance, Prepared]:
    """Place the request (``pantheon.api.flow.place``): its prompt tokenized and checked, its
    constraint checked, for the instance, before any slot."""
    req = creq.chat

    async def prepare(inst: Instance) -> Prepared:
        prep = await asyncio.to_thread(_prepare, inst, creq) if big else _prepare(inst, creq)
        if needs_constraint(req, prep):  # what the model cannot enforce is a 400 before any slot
            prep.constraint = await asyncio.to_thread(checked_constraint, inst, req, prep)
        return prep

    req.model, inst, prep = await flow.place(s, req.model, req.session_id, prepare)
    return inst, prep


@bp.post("/v1/completions", provide_automatic_options=False)
async def completions():
    s = app_state()
    arrived = time.monotonic()
    raw = await request.get_data(cache=False)
    big = len(raw) > flow.BIG_BODY
    creq = await asyncio.to_thread(parse_completion_request, raw) if big else parse_completion_request(raw)
    del raw
    ops.body_done()  # the body's bytes leave the --max-body-in-flight count
    req = creq.chat

    def make(inst: Instance, prep: Prepared) -> TextGeneration:
        text = (
            creq.prompt
            if isinstance(creq.prompt, str)
            else inst.model_assets.tokenizer.decode(list(creq.prompt), skip_special_tokens=False)
        )
        return TextGeneration(
            s.pool,
            inst,
            req,
            prep,
            s.config.fingerprint,
            arrived=arrived,
            on_tokens=s.feed.tokens,
            creq=creq,
            prompt_text=text,
        )

    adm = await flow.admit(s, req, lambda: _place(s, creq, big), make)
    return await flow.respond(adm, req.stream)
