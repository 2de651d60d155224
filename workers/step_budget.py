"""How many prompt tokens one engine step may prefill, so that a step takes about a target time.

A step decodes one token for every running sequence and spends the rest of its time on prefill
chunks. A fixed chunk size is wrong on every machine but one: 128 tokens of a 0.6B model take
well over a second on two AVX2 cores (every decoding stream stalls that long, and the old
liveness check took the silence for a dead worker) and a few milliseconds on a GPU (prefill
crawls). So the engine measures, as it runs, what a step costs:

    step_s ~= decode_s + per_token_s * prefill_tokens

``decode_s`` from steps that prefilled nothing and ``per_token_s`` from steps that did (less
the decode part), each an exponential moving average, and gives the next step
``(target_s - decode_s) / per_token_s`` prefill tokens, clamped to ``[floor, ceiling]``. The
floor keeps a long prompt moving even when decoding alone fills the target; the ceiling is the
configured ``prefill_chunk`` (the most one step may take, and the whole budget until the first
measurements come in).

A prefill token also attends to every position before it, so its cost grows with the context:

    per_token_s ~= base_s * (1 + context / crossover)

where ``context`` is the mean number of positions a token of the step attends to and
``crossover`` is the context at which attention costs as much as the rest of the model (the
engine's estimate from the model's shapes: linear FLOPs per token over attention FLOPs per
attended position; ``inf``, the default, leaves the context out). Steps are measured as
``base_s`` (the cost scaled back to no context), and a step that starts a chunk at ``context``
gets the ``n`` whose ``n * base_s * (1 + (context + n / 2) / crossover)`` fills the room: without
this the average of short-context steps let an 8k-token prompt's late chunks run at several
times the target.

A step that prefills only a few tokens (fewer than ``MIN_MEASURED_TOKENS``) is not measured:
its time is mostly what any step costs (the weights read once, the step's own work), so divided
by its few tokens it overstates a token's cost. Counted, a run of short prompts (embeddings
one at a time) shrinks the budget, and a batch of them arriving after is prefilled a prompt or
two a step, where one step could take the whole batch. Unless the step took (at least half of)
what the budget gave it: then the few tokens were the budget's choice, not the prompt's, and
without measuring them a slow first estimate (a cold first step) would hold the chunks small
for good (a 0.8B hybrid model prefilled 16 or 32 tokens a step at a third of the target).

While sequences decode, a step that also prefills costs at most ``DECODE_SHARE`` decode-only
steps (and never more than the target): a stream beside a long prompt keeps about a quarter of
its speed, and the prompt gets the rest of the time. With the target alone a stream beside an
8k-token prefill got one token per 0.5 s step (SmolLM2 on two cores: 44.6 tok/s alone, 2.0 beside
it; ``bench/beside.py``). Without decoding sequences the whole target is prefill. Unless every
prompt waiting for its prefill finishes within the target (``pending``): then the step takes
them all, as llama.cpp's and vLLM's batches do. A burst of short prompts beside a stream gets its
first tokens from one step (the stream waits that step, at most the target, once) instead of a
few prompts a step behind the cap: eight 25-token prompts on Qwen3.5-0.8B had their first
tokens over three to four steps.

No torch here: the scheduler and its tests use it as plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pantheon.core.engine_spec import PREFILL_CHUNK, STEP_TARGET_S

MIN_PREFILL_TOKENS = 16  # one KV block: a prompt always moves forward
DECODE_SHARE = 4  # while sequences decode, a prefilling step costs at most this many decode steps
_ALPHA = 0.3  # weight of the newest measurement in the moving averages
MIN_MEASURED_TOKENS = 64  # a step that prefills fewer says little of a token's cost (see above)


@dataclass
class StepBudget:
    """Prefill tokens per step from measured step times. ``observe`` after each step,
    ``tokens()`` before the next."""

    target_s: float = STEP_TARGET_S  # CPU: a decode stream waits at most about this long for a joiner
    ceiling: int = PREFILL_CHUNK
    floor: int = MIN_PREFILL_TOKENS
    decode_s: float | None = None  # EWMA of a step that only decodes
    per_token_s: float | None = None  # EWMA of the cost of one prefill token at no context
    crossover: float = math.inf  # context at which a token's attention costs as much as the rest
    given: int | None = None  # the last ``tokens()`` answer: what the next step may prefill

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError(f"the step target must be positive, got {self.target_s}")
        self.floor = max(1, min(self.floor, self.ceiling))

    def observe(self, n_decode: int, n_prefill: int, seconds: float, context: float = 0.0) -> None:
        """Record one step: ``n_decode`` decoded rows, ``n_prefill`` prefilled tokens that attend
        to ``context`` positions on average."""
        if seconds < 0 or (n_decode == 0 and n_prefill == 0):
            return
        if n_prefill == 0:
            self.decode_s = _ewma(self.decode_s, seconds)
            return
        if n_prefill < MIN_MEASURED_TOKENS and (self.given is None or 2 * n_prefill < self.given):
            return  # a short prompt, not a small budget: mostly the step's fixed cost (above)
        decode = self.decode_s if n_decode and self.decode_s is not None else 0.0
        # A step shorter than our decode estimate still says prefill was cheap, not free.
        per_token = max(seconds - decode, seconds * 0.1) / n_prefill
        self.per_token_s = _ewma(self.per_token_s, per_token / (1 + max(0.0, context) / self.crossover))

    def tokens(self, decoding: bool = True, context: int = 0, pending: int | None = None) -> int:
        """Prefill tokens for the next step; ``decoding``: some sequence decodes in it too;
        ``context``: positions already computed of the sequence it prefills; ``pending``: the
        prompt tokens every sequence waiting for its prefill still has (None: unknown)."""
        self.given = self._tokens(decoding, context, pending)
        return self.given

    def _tokens(self, decoding: bool, context: int, pending: int | None = None) -> int:
        if self.per_token_s is None or self.per_token_s <= 0:
            return self.ceiling
        if decoding and self.decode_s:  # streams beside a prefill keep ~1/DECODE_SHARE of their speed
            whole = self._fit(self.target_s, decoding, context)
            if pending is not None and pending <= whole:
                return whole  # every waiting prompt finishes now (_fit clamps it already)
            return self._fit(min(self.target_s, DECODE_SHARE * self.decode_s), decoding, context)
        return self._fit(self.target_s, decoding, context)

    def _fit(self, target: float, decoding: bool, context: int) -> int:
        """The prefill tokens a step of ``target`` seconds has room for (within floor, ceiling)."""
        room = target - ((self.decode_s or 0.0) if decoding else 0.0)
        a = self.per_token_s
        assert a is not None and a > 0  # (_tokens answered the ceiling before any measurement)
        if math.isinf(self.crossover) or self.crossover <= 0:
            n = int(room / a)
        else:  # n * a * (1 + (context + n / 2) / crossover) = room, for n >= 0
            qa = a / (2 * self.crossover)
            qb = a * (1 + max(0, context) / self.crossover)
            n = int((-qb + math.sqrt(qb * qb + 4 * qa * max(room, 0.0))) / (2 * qa))
        return max(self.floor, min(self.ceiling, n))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
