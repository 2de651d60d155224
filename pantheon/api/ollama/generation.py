"""``OllamaGeneration``: the chat route's ``Generation`` (same slots, worker requests, detokenizer,
emitter, grammars and errors) whose output is Ollama's: NDJSON lines (``stream_chunks``) or one
object (``complete``), for ``/api/chat`` (``message``) or ``/api/generate`` (``response``).

It reads the generation's typed pieces (``Piece``: the emitter's ``Delta``s of one batch of
tokens, ``_all_pieces``), as the Responses and completions routes do; nothing is parsed back
from OpenAI JSON. A stream gives a line per piece with text, thinking, whole tool calls or
logprobs, then the final line (``done: true``, ``done_reason``, the counts and durations in
nanoseconds); one that fails midway ends with ``{"error": "..."}``, as Ollama's does.
``raw``: ``/api/generate``'s raw mode, plain text (no reasoning or tool-call parsing).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from pantheon.api.generation import Generation, _pool_error
from pantheon.api.ollama import protocol as ol
from pantheon.chat.emitter import Emitter
from pantheon.control.context import Prepared
from pantheon.control.registry import Instance
from pantheon.core.request import GenerationRequest
from pantheon.errors import ApiError
from pantheon.workerlink.pool import WorkerPool


class OllamaGeneration(Generation):
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
        kind: str,
        raw: bool = False,
    ):
        """``kind``: "chat" or "generate" (the response object's shape)."""
        super().__init__(pool, inst, req, prep, fingerprint, arrived=arrived, on_tokens=on_tokens)
        self.kind, self.raw = kind, raw
        self.placed = time.monotonic()  # made right after the slot was taken

    def _emitter(self):
        if self.raw:
            return Emitter(reasoning=False, stop=self.req.stop, tools_enabled=False, think_open=False)
        return super()._emitter()

    def _final(
        self,
        *,
        content: str = "",
        thinking: str = "",
        calls: list[ol.ToolCall] | None = None,
        lps: list[ol.Logprob] | None = None,
    ) -> ol.ChatResponse | ol.GenerateResponse:
        """The last object: ``done``, its reason and the timings, with the collected output
        (``complete``) or none (a stream's last line)."""
        run = self.runs[0]
        stats = ol.timing(
            arrived=self.arrived,
            placed=self.placed,
            first_token=self.first_token_at,
            ended=time.monotonic(),
            prompt_tokens=len(self.prep.prompt_ids),
            eval_tokens=run.completion_tokens,
        )
        return ol.output(
            self.kind,
            self.model,
            content=content,
            thinking=thinking,
            calls=calls,
            lps=lps,
            done=True,
            reason=ol.done_reason(run.finish_reason),
            stats=stats,
        )

    async def stream_chunks(self) -> AsyncIterator[bytes]:
        calls = ol.ToolCalls()
        try:
            async with contextlib.aclosing(self._all_pieces()) as pieces:
                async for p in pieces:
                    done = calls.feed(p.deltas)
                    if p.finish is not None:
                        done += calls.finish()
                    content = ol.text_of(p.deltas, "content")
                    thinking = ol.text_of(p.deltas, "reasoning")
                    lps = ol.logprobs(p.logprobs) if self.req.logprobs else []
                    if content or thinking or done or lps:
                        yield ol.line(
                            ol.output(
                                self.kind, self.model, content=content, thinking=thinking, calls=done, lps=lps
                            )
                        )
            yield ol.line(self._final())
        except ApiError as e:
            yield ol.line(e.ollama_body())
        except Exception as e:  # noqa: BLE001 - the stream must still end cleanly
            yield ol.line(_pool_error(e, self.id).ollama_body())

    async def complete(self) -> ol.ChatResponse | ol.GenerateResponse:  # type: ignore[override]
        content: list[str] = []
        thinking: list[str] = []
        calls = ol.ToolCalls()
        found: list[ol.ToolCall] = []
        lps: list[ol.Logprob] = []
        async with contextlib.aclosing(self._all_pieces()) as pieces:
            async for p in pieces:
                found += calls.feed(p.deltas)
                content.append(ol.text_of(p.deltas, "content"))
                thinking.append(ol.text_of(p.deltas, "reasoning"))
                if self.req.logprobs:
                    lps += ol.logprobs(p.logprobs)
        found += calls.finish()
        return self._final(content="".join(content), thinking="".join(thinking), calls=found, lps=lps)
