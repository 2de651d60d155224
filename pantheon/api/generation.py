"""One chat request end to end, on the router side.

render the chat template -> tokenize -> ``Submit`` to the instance's worker -> stream ``TokenOut``
-> incremental detokenize -> emitter (reasoning / content / tool calls / stop strings) -> deltas,
turned into SSE chunks (``stream_chunks``) or one completion body (``complete``).

- A stop string found by the emitter aborts the worker request at once; so does a client that
  goes away (the generators' ``finally`` sends the abort when they are closed or cancelled).
- ``usage.completion_tokens`` counts the tokens the client received (up to and including the one
  that ended the choice), not what the worker may have generated past a stop string.
- ``n > 1`` runs n worker requests; a seeded request gives choice i the seed ``seed + i``.

A choice runs as named steps: ``Generation._submission`` (its ``Submit``), ``_next_batch`` (the
worker's tokens, traced and counted) and ``ChoiceDecoder.piece`` (tokens -> text -> the output
parser's deltas, and how the choice finished); the streamed and the collected output share them.

Every front end runs on this one machinery: ``Generation``'s own output is the OpenAI chat
route's (``chat.completion`` objects and chunks, built by ``pantheon.api.openai.protocol``); the
completions, Responses and Ollama routes subclass it and read its typed ``Piece``s instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pantheon import errors
from pantheon.api import auth, structured
from pantheon.api.openai import protocol as oa
from pantheon.chat.answer_form import CallOrReply
from pantheon.chat.detokenize import IncrementalDetokenizer
from pantheon.chat.emitter import Delta
from pantheon.chat.output import output_parser
from pantheon.chat.tools import JSON_TOOL_FORMAT, forced_call_prefix
from pantheon.control.context import Prepared
from pantheon.control.registry import Instance
from pantheon.core.protocol import PromptLogprobs, Submit, TokenOut
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError
from pantheon.logs import RequestTrace
from pantheon.models.assets import ModelAssets
from pantheon.workerlink.pool import RequestRejectedError, WorkerDied, WorkerPool
from pantheon.workerlink.streams import RequestStream

log = logging.getLogger("pantheon.api.generation")


# ---------------------------------------------------------------- the pool's errors
#
# Rendering, tokenizing and fitting the context (pass / cap / deny) happen before a Generation,
# in pantheon.control.context (``fit_context``, which makes the ``Prepared``).


def _pool_error(e: BaseException, request_id: str) -> ApiError:
    """What the client is told of a failure: a short message with the request id. The detail
    (a worker's pid, exit signal, last output, model paths) goes to the server log, under the
    same id, and to the admin API (``/admin/dies``: ``last_death``), never to the client."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestRejectedError):
        kind, reason = getattr(e, "kind", "invalid"), getattr(e, "reason", str(e))
        if kind == "context_length":
            return errors.context_length_exceeded(reason)
        if kind == "no_instance":
            return errors.no_instance(reason)
        if kind == "internal":  # the worker's step failed: its traceback is in the worker's log
            log.error("request %s: %s", request_id, reason)
            return errors.generation_failed(request_id)
        return errors.request_rejected(reason, kind)
    if isinstance(e, WorkerDied):
        # Retry-After: the supervisor has the model back within a few seconds
        log.warning("request %s: %s", request_id, e)
        return errors.worker_died(request_id)
    log.exception("request %s: generation failed", request_id, exc_info=e)
    return errors.generation_failed(request_id)


class ForcedCall:
    """The output of a request whose ``tool_choice`` names a function: the prompt already holds
    ``<tool_call>\\n{"name": NAME, "arguments": `` so everything the model writes, up to the
    wrapper's closing ``}`` and ``</tool_call>``, is that call's arguments, streamed as it comes.
    Same interface as the emitter (``feed``, ``finish``, ``stopped``)."""

    keep_special: frozenset[str] = frozenset()  # as the emitter's: it reads no special token

    _TAIL = re.compile(
        r"(?:\}\s*)?\s*(?:<(?:/(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l(?:>)?)?)?)?)?)?)?)?)?)?)?)?$"
    )

    def __init__(self, name: str):
        self.name = name
        self.stopped = False
        self._buf = ""
        self._sent = ""
        self._started = False

    def _header(self) -> list[Delta]:
        if self._started:
            return []
        self._started = True
        return [Delta("tool_call", index=0, id=oa.tool_call_id(), name=self.name, arguments="")]

    def _args(self, text: str) -> list[Delta]:
        self._sent += text
        return self._header() + ([Delta("tool_call", index=0, arguments=text)] if text else [])

    def feed(self, text: str) -> list[Delta]:
        if self.stopped or not text:
            return self._header() if not self.stopped else []
        self._buf += text
        end = self._buf.find("</tool_call>")
        if end >= 0:
            self.stopped = True
            body = self._buf[:end].rstrip()
            self._buf = ""
            return self._args(body[:-1].rstrip() if body.endswith("}") else body)
        tail = self._TAIL.search(self._buf)  # hold what may be the wrapper's end
        cut = tail.start() if tail is not None else len(self._buf)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return self._args(out)

    def finish(self) -> list[Delta]:
        body, self._buf = self._buf.rstrip(), ""
        if body.endswith("}") and not _is_json(self._sent + body) and _is_json(self._sent + body[:-1]):
            body = body[:-1].rstrip()
        return self._args(body)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- a constraint and the model

# The request parameter a constraint came from, by ``GenerationRequest.response_format`` (its kind).
_CONSTRAINT_PARAMS = {
    "json_object": "response_format",
    "json_schema": "response_format",
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}
_model_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, structured.ModelTokenizer]] = (
    weakref.WeakKeyDictionary()
)


def vocab_size(inst: Instance) -> int:
    """The number of token ids ``inst``'s model takes: its worker's (the embedding's rows, what
    the worker checks a request's ids against), else its tokenizer's."""
    if inst.loaded is not None and inst.loaded.vocab_size > 0:
        return inst.loaded.vocab_size
    return int(inst.model_assets.tokenizer.get_vocab_size(with_added_tokens=True))


def model_tokenizer(inst: Instance) -> structured.ModelTokenizer:
    """``inst``'s vocabulary for llguidance, as its worker builds it (the same tokenizer JSON,
    the worker's vocabulary size, the eos ids), made once per model."""
    assets = inst.model_assets
    n = vocab_size(inst)
    per = _model_tokenizers.setdefault(assets, {})
    if n not in per:
        per[n] = structured.ModelTokenizer(assets.tokenizer.to_str(), n, assets.eos_ids)
    return per[n]


Constraint = tuple[str | None, list[int], int]  # (grammar, ids it starts after, <think> id or -1)
NO_CONSTRAINT: Constraint = (None, [], -1)


def _forced_call(req: GenerationRequest) -> bool:
    return bool(req.tools) and req.tools_enabled and req.tool_choice in ("required", "function")


def needs_constraint(req: GenerationRequest, prep: Prepared) -> bool:
    """Whether ``req``'s output is constrained: a grammar, a demanded tool call, or a
    call-or-reply answer (``prep.answer_form``)."""
    return req.grammar is not None or _forced_call(req) or prep.answer_form


def tool_format(inst: Instance, prep: Prepared) -> str:
    """The format of the model's tool calls (its chat template's), unless a forced call was
    opened in the prompt in another one: the prompt's opening is written in
    ``pantheon.control.context``, and the output must continue what it wrote."""
    fmt = inst.model_assets.template.tool_format
    forced = prep.forced
    if forced is not None and prep.prefix != forced_call_prefix(fmt, forced):
        return JSON_TOOL_FORMAT
    return fmt


def constraint_of(inst: Instance, req: GenerationRequest, prep: Prepared) -> Constraint:
    """The grammar the output must match (a demanded tool call's, else the request's), and
    where it starts on a reasoning model: after ``</think>`` when the template opened the
    block; when the model may open one itself, its ``<think>`` id (else -1); on a Harmony
    model (gpt-oss), after ``<|channel|>final<|message|>``, as vLLM starts it; on Gemma 4 with
    thinking on, after ``<channel|>`` when the model opens ``<|channel>``."""
    assets = inst.model_assets
    fmt = assets.template.tool_syntax
    grammar = req.grammar
    if req.tools and _forced_call(req):
        tools = req.tools
        if req.tool_choice_name is not None:
            tools = [t for t in tools if t["function"]["name"] == req.tool_choice_name]
        grammar = structured.tool_grammar(
            tools, prep.forced, prep.prefix, tool_format(inst, prep), token_id=marker_ids(inst)
        )
        if prep.prefix:  # the call is already open in the prompt: no reasoning first
            return grammar, [], -1
    elif prep.answer_form:
        grammar = req.answer_grammar
    if grammar is None or not assets.reasoning:
        return grammar, [], -1
    vocab = _Vocabulary(assets)
    after, opening = fmt.grammar_start(
        vocab, think_open=prep.think_open, thinks=fmt.thinks(req.chat_template_kwargs)
    )
    return grammar, after, opening


class _Vocabulary:
    """A model's tokenizer as ``ToolFormat.grammar_start`` reads it."""

    def __init__(self, assets: ModelAssets):
        self._assets = assets

    def encode(self, text: str) -> list[int]:
        return self._assets.encode(text)

    def token_id(self, text: str) -> int | None:
        return self._assets.tokenizer.token_to_id(text)


def marker_ids(inst: Instance) -> Callable[[str], int | None]:
    """The ids of the model's format's special-token markers in its vocabulary (a grammar spells
    those as tokens: ``structured.MarkerSpeller``)."""
    assets = inst.model_assets
    markers = assets.template.tool_syntax.keep_special
    return lambda m: assets.tokenizer.token_to_id(m) if m in markers else None


def checked_constraint(inst: Instance, req: GenerationRequest, prep: Prepared) -> Constraint:
    """``constraint_of``, run on a matcher over ``inst``'s own vocabulary first: a 400 naming
    the parameter when the model cannot enforce it (up to 0.25 s: call it off the event loop)."""
    if not needs_constraint(req, prep):
        return NO_CONSTRAINT
    c = constraint_of(inst, req, prep)
    if c[0] is not None:
        param = (
            "tools"
            if _forced_call(req) or prep.answer_form
            # the client's field (Ollama's format, Responses' text.format), else the chat body's
            else req.names.get("response_format")
            or _CONSTRAINT_PARAMS.get(req.response_format, "response_format")
        )
        structured.check_for_model(c[0], model_tokenizer(inst), param)
    return c


# ---------------------------------------------------------------- one choice


@dataclass
class Piece:
    index: int
    deltas: list  # emitter Deltas
    logprobs: list[dict] | None
    finish: str | None = None  # set on the choice's last piece


@dataclass
class ChoiceRun:
    index: int
    finish_reason: str | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    tool_calls: bool = False
    call_ids: dict[int, str] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # from its first token, when the request asked


class OutputReader(Protocol):
    """What a choice reads its text with: a chat output parser (``output_parser``), a
    ``ForcedCall`` or a ``CallOrReply``."""

    @property
    def keep_special(self) -> frozenset[str]: ...

    @property
    def stopped(self) -> bool: ...

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class ChoiceDecoder:
    """One choice's tokens -> its ``Piece``s: detokenize incrementally, feed the output parser
    (``emitter``), count what the client receives, and say how the choice finished (a stop
    string the parser found is ``stop``; a stop after a tool call is ``tool_calls``).

    ``pending``: deltas the parser gave for the prompt's opening, sent with the first piece;
    ``logprob``: a token's logprobs entry, when the request asked for them."""

    def __init__(
        self,
        run: ChoiceRun,
        emitter: OutputReader,
        detok: IncrementalDetokenizer,
        pending: list[Delta],
        logprob: Callable[[TokenOut], dict] | None,
    ):
        self.run, self.emitter, self.detok, self.pending, self.logprob = run, emitter, detok, pending, logprob

    def piece(self, toks: list[TokenOut]) -> Piece:
        run, emitter, detok = self.run, self.emitter, self.detok
        deltas, lps, finish = self.pending, [] if self.logprob is not None else None, None
        self.pending = []
        for tok in toks:
            if tok.finish == "abort":
                raise errors.worker_aborted()
            real = tok.token >= 0  # -1: a finish without a token (truncated)
            run.completion_tokens += real
            if tok.cached_tokens:
                run.cached_tokens = tok.cached_tokens
            if tok.prompt_logprobs is not None:
                run.prompt_logprobs = tok.prompt_logprobs
            text = detok.push(tok.token) if real else ""
            new = emitter.feed(text) if text else []
            if emitter.stopped:
                finish = "stop"
            elif tok.finish is not None:
                tail = detok.flush()
                if tail:
                    new += emitter.feed(tail)
                if not emitter.stopped:
                    new += emitter.finish()
                finish = "stop" if emitter.stopped else tok.finish
            if any(d.kind == "reasoning" for d in new):
                run.reasoning_tokens += 1
            deltas += new
            if lps is not None and real and self.logprob is not None:
                lps.append(self.logprob(tok))
            if finish is not None:
                break
        if any(d.kind == "tool_call" for d in deltas):
            run.tool_calls = True
        if finish is not None:
            if finish == "stop" and run.tool_calls:
                finish = "tool_calls"
            run.finish_reason = finish
        return Piece(run.index, deltas, lps, finish)


class Generation:
    """One chat request on one instance: ``n`` choices, streamed or collected."""

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
    ):
        """``arrived``: the request's arrival (``time.monotonic()``), for the time to first
        token; ``on_tokens(n)``: called with each batch's count of generated tokens."""
        self.pool, self.inst, self.req, self.prep = pool, inst, req, prep
        self.id = oa.completion_id()
        self.created = oa.now()
        self.model = inst.name
        self.fingerprint = fingerprint
        self.runs = [ChoiceRun(i) for i in range(req.n)]
        self._envelope: tuple[bytes, bytes] | None = None
        self._streams: list = []
        self.closing = False
        self.ending: ApiError | None = None  # why end() stopped it
        self.trace: RequestTrace | None = None  # the request's (set by ops.attach), if any
        self.arrived = time.monotonic() if arrived is None else arrived
        self.first_token_at: float | None = None
        self.on_tokens = on_tokens
        # With API keys each key is its own prefix-cache domain (pantheon.api.auth).
        self.cache_salt = auth.cache_salt(auth.request_domain(), req.cache_salt)
        # The constraint, built and run against the model's vocabulary before any slot by the
        # route's placement (``checked_constraint`` on a thread); a request placed on another
        # replica than the one it was fitted for is checked here (before the worker sees it):
        # what the model cannot enforce is a 400, never a broken output.
        self.constraint: Constraint = (
            prep.constraint if prep.constraint is not None else checked_constraint(inst, req, prep)
        )

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived

    def shutdown(self) -> None:
        """The server is stopping: end every choice now (its stream ends with an error)."""
        self.end(errors.shutting_down())

    def end(self, err: ApiError) -> None:
        """End every choice now with ``err`` (a stream gets it as an error event, then
        ``[DONE]``): shutdown, or an unload past its drain deadline."""
        self.ending = self.ending or err
        self.closing = True
        for st in self._streams:
            st.abort()

    def _tool_format(self) -> str:
        return tool_format(self.inst, self.prep)

    def _streams_forced_arguments(self) -> bool:
        """A forced call whose prompt left the JSON arguments object open: ``ForcedCall`` streams
        them as they come. (An XML call forced open goes through the emitter, fed the opening.)"""
        return self.prep.forced is not None and self._tool_format() == JSON_TOOL_FORMAT

    def _emitter(self) -> OutputReader:
        req, prep, assets = self.req, self.prep, self.inst.model_assets
        if self._streams_forced_arguments():
            assert prep.forced is not None
            return ForcedCall(prep.forced)
        if prep.answer_form:  # call-or-reply JSON on a template without tools (auto)
            return CallOrReply(reasoning=assets.reasoning, stop=req.stop, think_open=prep.think_open)
        return output_parser(
            self._tool_format(),
            reasoning=assets.reasoning,
            stop=req.stop,
            tools_enabled=req.tools_enabled,
            think_open=prep.think_open,
            tools=req.tools,
        )

    async def _pieces(self, run: ChoiceRun) -> AsyncGenerator[Piece, None]:
        """The choice's output, one ``Piece`` per batch of tokens that arrived together."""
        decoder = self._decoder(run)
        sub = self._submission(run)
        stream = None
        try:
            if self.closing:
                raise self.ending or errors.shutting_down()
            stream = self.pool.submit(self.inst.die, sub)
            self._streams.append(stream)
            while True:
                piece = decoder.piece(await self._next_batch(stream, run))
                yield piece
                if piece.finish is not None:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException as e:
            err = _pool_error(e, self.id)
            if self.trace is not None:
                self.trace.failed(err)
            raise err from None
        finally:
            if stream is not None:
                stream.abort()  # a no-op once the worker finished it

    def _decoder(self, run: ChoiceRun) -> ChoiceDecoder:
        prep, assets = self.prep, self.inst.model_assets
        emitter = self._emitter()
        # special tokens produce no text, except the markers the parser reads (Harmony's)
        detok = IncrementalDetokenizer(
            assets.tokenizer,
            prompt_ids=prep.prompt_ids,
            skip_special_tokens=True,
            keep_special=emitter.keep_special,
        )
        # The emitter reads the call's opening that the prompt holds as if the model wrote it.
        pending = emitter.feed(prep.prefix) if prep.prefix and not isinstance(emitter, ForcedCall) else []
        return ChoiceDecoder(run, emitter, detok, pending, self._logprob if self.req.logprobs else None)

    def _submission(self, run: ChoiceRun) -> Submit:
        """The worker request of choice ``run``: a seeded request gives choice i ``seed + i``."""
        req, prep, assets = self.req, self.prep, self.inst.model_assets
        seed = None if req.seed is None else req.seed + run.index
        grammar, after, opening = self.constraint
        params = req.sampling(
            max_tokens=prep.max_tokens,
            seed=seed,
            stop_token_ids=[] if req.ignore_eos else assets.eos_ids,
            grammar=grammar,
            grammar_after=after,
            grammar_opening=opening,
        )
        return Submit(
            request_id=f"{self.id}-{run.index}-{uuid.uuid4().hex[:6]}",
            instance=self.inst.instance_id,
            prompt=prep.prompt_ids,
            params=params,
            session_id=req.session_id,
            cache_salt=self.cache_salt,
            use_cache=not prep.capped,
            prompt_logprobs=req.prompt_logprobs,
        )

    async def _next_batch(self, stream: RequestStream, run: ChoiceRun) -> list[TokenOut]:
        """The next tokens the worker sent for ``run`` (traced and counted); an empty batch
        means the stream ended without a finish: our ``end()``, else the worker's fault."""
        toks = await stream.next_batch()
        if self.trace is not None and toks:
            self.trace.tokens(run.index, toks)
        if toks:
            self._count(toks)
        if not toks and self.closing:
            raise self.ending or errors.shutting_down()
        if not toks:
            raise errors.worker_no_finish()
        return toks

    def _count(self, toks: list) -> None:
        real = sum(1 for t in toks if t.token >= 0)
        if real and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if real and self.on_tokens is not None:
            self.on_tokens(real)

    def _logprob(self, tok: TokenOut) -> dict:
        assets = self.inst.model_assets
        text, raw = assets.piece(tok.token)
        top = [(assets.piece(t)[0], lp, assets.piece(t)[1]) for t, lp in (tok.top or [])]
        lp = tok.logprob if tok.logprob is not None else 0.0
        return oa.token_logprob(text, lp, raw, top)

    def _all_pieces(self) -> AsyncGenerator[Piece, None]:
        """Every choice's pieces, interleaved as they come."""
        return self._pieces(self.runs[0]) if len(self.runs) == 1 else self._merged()

    async def _merged(self) -> AsyncGenerator[Piece, None]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run: ChoiceRun) -> None:
            try:
                async for p in self._pieces(run):
                    await queue.put(p)
            except BaseException as e:
                await queue.put(e)
                raise
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(r)) for r in self.runs]
        try:
            live = len(tasks)
            while live:
                item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage(self) -> dict:
        return oa.usage(
            len(self.prep.prompt_ids),
            sum(r.completion_tokens for r in self.runs),
            reasoning_tokens=sum(r.reasoning_tokens for r in self.runs),
            cached_tokens=max(r.cached_tokens for r in self.runs),
        )

    # ------------------------------------------------------------ streamed

    def _capped(self, body: dict) -> dict:
        """Context admission capped the prompt: every chunk and the body say so."""
        if self.prep.capped:
            body["context_capped"] = True
        return body

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        if usage is not None:
            return oa.sse(
                self._capped(
                    oa.chunk(
                        self.id,
                        self.created,
                        self.model,
                        self.fingerprint,
                        choices,
                        include_usage=True,
                        usage_=usage,
                    )
                )
            )
        if self._envelope is None:  # the chunk's fixed part, encoded once per request
            empty = oa.sse(
                self._capped(
                    oa.chunk(
                        self.id,
                        self.created,
                        self.model,
                        self.fingerprint,
                        [],
                        include_usage=self.req.include_usage,
                    )
                )
            )
            head, _, tail = empty.partition(b'"choices":[]')
            self._envelope = (head + b'"choices":[', b"]" + tail)
        head, tail = self._envelope
        return head + b",".join(map(oa.dumps, choices)) + tail

    def _delta_dicts(self, run: ChoiceRun, deltas: list) -> list[dict]:
        out: list[dict] = []
        for d in deltas:
            if d.kind in ("content", "reasoning"):
                key = "content" if d.kind == "content" else "reasoning_content"
                if not d.text:
                    continue
                if out and list(out[-1]) == [key]:
                    out[-1][key] += d.text
                else:
                    out.append({key: d.text})
            elif d.kind == "tool_call":
                entry: dict[str, Any] = {"index": d.index}
                if d.index not in run.call_ids:
                    run.call_ids[d.index] = d.id or oa.tool_call_id()
                    entry["id"] = run.call_ids[d.index]
                    entry["type"] = "function"
                    entry["function"] = {"name": d.name or "", "arguments": d.arguments or ""}
                else:
                    entry["function"] = {"arguments": d.arguments or ""}
                if out and list(out[-1]) == ["tool_calls"]:
                    out[-1]["tool_calls"].append(entry)
                else:
                    out.append({"tool_calls": [entry]})
        return out

    async def stream_chunks(self) -> AsyncIterator[bytes]:
        """SSE bytes: role deltas, content deltas, finish chunks, [usage], [DONE]."""
        role = {"role": "assistant", "content": ""}
        for run in self.runs:
            yield self._chunk([oa.chunk_choice(run.index, dict(role))])
        pending_lp: dict[int, list[dict]] = {}
        try:
            async with contextlib.aclosing(self._all_pieces()) as pieces:
                async for p in pieces:
                    lp = pending_lp.pop(p.index, []) + (p.logprobs or [])
                    dicts = self._delta_dicts(self.runs[p.index], p.deltas)
                    for j, delta in enumerate(dicts):
                        yield self._chunk(
                            [
                                oa.chunk_choice(
                                    p.index, delta, None, lp if j == 0 and self.req.logprobs else None
                                )
                            ]
                        )
                    if not dicts and lp:
                        pending_lp[p.index] = lp
                    if p.finish is not None:
                        rest = pending_lp.pop(p.index, None) if self.req.logprobs else None
                        yield self._chunk([oa.chunk_choice(p.index, {}, p.finish, rest or None)])
            if self.req.include_usage:
                yield self._chunk([], self.usage())
        except ApiError as e:
            yield oa.sse(e.body())
        except Exception as e:  # noqa: BLE001 - the stream must still end cleanly
            yield oa.sse(_pool_error(e, self.id).body())
        yield oa.SSE_DONE

    # ------------------------------------------------------------ collected

    async def complete(self) -> dict:
        """The whole completion as one ``chat.completion`` body."""
        out = [{"content": [], "reasoning": [], "calls": {}, "lps": []} for _ in self.runs]
        async with contextlib.aclosing(self._all_pieces()) as pieces:
            async for p in pieces:
                o = out[p.index]
                for d in p.deltas:
                    if d.kind == "tool_call":
                        c = o["calls"].setdefault(
                            d.index, {"id": d.id or oa.tool_call_id(), "name": d.name or "", "args": []}
                        )
                        c["name"] = c["name"] or d.name or ""
                        c["args"].append(d.arguments or "")
                    elif d.kind in ("content", "reasoning"):
                        o[d.kind].append(d.text or "")
                o["lps"] += p.logprobs or []
        choices = []
        for run, o in zip(self.runs, out):
            tcs = [
                oa.tool_call(c["id"], c["name"], "".join(c["args"])) for _, c in sorted(o["calls"].items())
            ]
            msg = oa.message(
                "".join(o["content"]), reasoning="".join(o["reasoning"]) or None, tool_calls=tcs or None
            )
            choices.append(
                oa.choice(
                    run.index, msg, run.finish_reason or "stop", o["lps"] if self.req.logprobs else None
                )
            )
        body = oa.chat_completion(self.id, self.created, self.model, self.fingerprint, choices, self.usage())
        if self.req.prompt_logprobs is not None:  # vLLM's place: the response's, not a choice's
            body["prompt_logprobs"] = self.prompt_logprobs(self.req.prompt_logprobs)
        return self._capped(body)

    def prompt_logprobs(self, k: int) -> list[dict[str, oa.PromptTokenLogprob] | None]:
        """The prompt's logprobs in vLLM's form, top ``k`` (every choice has the same prompt)."""
        piece = self.inst.model_assets.piece
        return oa.prompt_logprobs(
            self.prep.prompt_ids, self.runs[0].prompt_logprobs, k, lambda t: piece(t)[0]
        )
