"""Grammar-constrained decoding in the worker: one llguidance matcher per constrained request.

The router turns a request's constraint (``response_format``, ``guided_*``, a required tool
call) into an llguidance grammar, checks that it compiles, and sends it in
``SamplingParams.grammar``. Here, per step:

1. before the forward pass, :meth:`Grammars.start_masks` computes the allowed-token bitmask of
   every constrained row on a thread (llguidance releases the GIL and fans out over its own
   threads), so the mask is ready when the logits are;
2. after it, :func:`apply_masks` sets every disallowed logit to ``-inf`` (on the logits' device),
   before penalties and sampling, so greedy, temperature, top-k/p, seeds and ``n`` all still work;
3. :meth:`Constraint.advance` feeds the chosen token to the matcher. When the grammar is complete
   (``is_stopped``) the request finishes with ``stop`` at once.

A matcher can fail after it was built (llguidance meets some of its limits only while matching:
a lexer that builds too many expressions, an Earley row past ``max_items_in_row``). Its mask
then allows nothing, so what comes out no longer follows the grammar: the constraint records the
failure (:attr:`Grammars.failed`, by the request id the worker gave it with :meth:`Grammars.label`)
and ends the request, and the worker turns that end into a ``Rejected`` (an error for the client,
never a ``stop``). Failures are logged in one line: the grammar's hash and its first 200
characters, never the whole grammar (``LIMITS.verbose_errors`` is off: llguidance's verbose
errors quote it).

Compiled grammars are cached by the grammar text's hash (a matcher is compiled once, then
``deep_copy``-ed per request, which costs microseconds). With ``grammar_after`` (a reasoning
model's ``</think>`` ids), the constraint starts only once those tokens came out.

The tokenizer llguidance needs is read from the model's own files (``tokenizer.json``, or the
GGUF's vocabulary) on the first constrained request, never from the router's process.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg
import torch

from pantheon.core.gguf import find_gguf, read_gguf
from pantheon.core.gguf_tokenizer import tokenizer_json
from pantheon.core.grammar_vocab import LIMIT_VALUES, grammar_tokenizer_json
from workers.errors import RequestRejected

log = logging.getLogger("pantheon.worker.grammar")

CACHE_SIZE = 64  # compiled grammars kept per model
LIMITS = llg.LLParserLimits(**LIMIT_VALUES)
HEAD_CHARS = 200  # of a grammar, in a log line
ERROR_CHARS = 300  # of an llguidance error, in a log line or a rejection


def short_error(message: str) -> str:
    """An llguidance error's first line, cut to ``ERROR_CHARS``."""
    first = (message or "unknown error").strip().split("\n", 1)[0]
    return first[:ERROR_CHARS] + ("..." if len(first) > ERROR_CHARS else "")


def describe(grammar: str) -> str:
    """A grammar in a log line: its hash and its first ``HEAD_CHARS`` characters."""
    return f"{hashlib.sha256(grammar.encode()).hexdigest()[:16]} {grammar[:HEAD_CHARS]!r}"


def model_tokenizer_json(model_path: str) -> str:
    """The Hugging Face ``tokenizer.json`` text of a model folder or GGUF file."""
    gguf = find_gguf(Path(model_path))
    if gguf is not None:
        return tokenizer_json(read_gguf(gguf))
    return (Path(model_path) / "tokenizer.json").read_text(encoding="utf-8")


@dataclass
class Constraint:
    """One request's grammar state.

    With ``after`` (a reasoning block's closing ids) the output is free until it ends with
    them. With ``opening`` too, the reasoning is the model's choice: its first token may be
    ``opening`` (then it is free until ``after``), and anything else starts the grammar at once.
    """

    matcher: llg.LLMatcher
    stop_ids: frozenset[int]  # the request's stop tokens: allowed wherever the grammar may end
    after: tuple[int, ...] = ()
    opening: int | None = None
    state: str = "active"  # "undecided" (first token) | "reasoning" | "active"
    _tail: tuple[int, ...] = ()
    grammar: str = ""  # its text, for the log line of a failure
    request_id: str = ""  # set by ``Grammars.label``
    failed: dict[str, str] | None = None  # where a failure is reported (``Grammars.failed``)
    error: str | None = None  # why the matcher failed, once it did
    consumed: int = 0  # tokens the matcher took

    @property
    def masking(self) -> bool:
        """Whether the next token is masked."""
        return self.state != "reasoning"

    def advance(self, token: int) -> bool:
        """Feed the sampled token; True when the grammar is complete (the request is done)."""
        if self.state == "undecided":
            if token == self.opening:
                self.state = "reasoning"
                return False
            self.state = "active"
        if self.state == "reasoning":
            self._tail = (self._tail + (token,))[-len(self.after) :]
            if self._tail == self.after:
                self.state = "active"
            return False
        if self.matcher.is_error():  # it failed computing the mask this token was sampled under
            return self._fail(self.matcher.get_error())
        if token in self.stop_ids and self.matcher.is_accepting():
            return True  # the model ended where the grammar may end
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return self._fail(self.matcher.get_error() or f"the grammar refused token {token}")
        self.consumed += 1
        return self.matcher.is_stopped()

    def _fail(self, error: str) -> bool:
        """Record the matcher's failure and end the request (the worker makes it an error)."""
        if self.error is None:
            self.error = short_error(error)
            log.warning(
                "grammar failed after %d tokens (request %s): %s; grammar %s",
                self.consumed,
                self.request_id or "?",
                self.error,
                describe(self.grammar),
            )
            if self.failed is not None and self.request_id:
                self.failed[self.request_id] = self.error
        return True


class Grammars:
    """The compiled-grammar cache and the mask thread of one engine."""

    def __init__(self, model_path: str, vocab_size: int, eos_ids: Sequence[int]):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._tokenizer: Future[llg.LLTokenizer] | None = None
        self._compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._executor: llg.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.compiled = 0  # grammars compiled (cache misses)
        self.hits = 0
        self.last: Constraint | None = None  # the newest constraint, until ``label`` names it
        self.failed: dict[str, str] = {}  # request id -> why its matcher failed (``take_failures``)

    def label(self, request_id: str) -> None:
        """Name the constraint the last ``constraint()`` call made (the worker calls this right
        after a submit that carried a grammar), so its failure can be told to that request."""
        if self.last is not None:
            self.last.request_id = request_id
            self.last = None

    def take_failures(self) -> dict[str, str]:
        """The requests whose matcher failed since the last call, and why.

        Emptied in place: every live constraint reports into this same dict (``Constraint.failed``),
        so one built before this call and failing after it must still be heard (a new dict here
        left it writing into the old one, and its request ended as a plain ``stop``)."""
        out = dict(self.failed)
        self.failed.clear()
        return out

    def warm(self) -> None:
        """Start building llguidance's tokenizer on the mask thread (~0.3 s for a 50k
        vocabulary), so the first constrained request does not stall the step loop for it."""
        if self._tokenizer is None:
            self._tokenizer = self._pool().submit(
                lambda: llg.LLTokenizer(
                    grammar_tokenizer_json(model_tokenizer_json(self.model_path)),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_ids,
                )
            )

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        self.warm()
        assert self._tokenizer is not None
        return self._tokenizer.result()

    def _pool(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._thread

    def constraint(
        self, grammar: str, stop_ids: Sequence[int], after: Sequence[int] = (), opening: int | None = None
    ) -> Constraint:
        """A fresh matcher for ``grammar``; raises ``RequestRejected`` if it does not compile."""
        key = hashlib.sha256(grammar.encode()).hexdigest()
        base = self._compiled.get(key)
        if base is None:
            try:
                tokenizer = self.tokenizer
            except Exception as e:  # no tokenizer.json, or one llguidance cannot read
                raise RequestRejected("invalid", f"this model cannot enforce grammars: {e}") from None
            base = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
            if base.is_error():
                error = short_error(base.get_error())
                log.warning("grammar does not compile: %s; grammar %s", error, describe(grammar))
                raise RequestRejected("invalid", f"the grammar does not compile: {error}")
            self._compiled[key] = base
            self.compiled += 1
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
            self.hits += 1
        state = "active" if not after else "reasoning" if opening is None else "undecided"
        c = Constraint(
            base.deep_copy(),
            frozenset(stop_ids),
            tuple(after),
            opening,
            state,
            grammar=grammar,
            failed=self.failed,
        )
        self.last = c
        return c

    def start_masks(self, constraints: Sequence[Constraint]) -> Future[torch.Tensor]:
        """Begin the bitmasks of ``constraints`` (all ``masking``): a future of ``[C, words]`` int32
        on the CPU, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed."""
        if self._executor is None:
            self._executor = llg.LLExecutor()
        return self._pool().submit(self._masks, list(constraints))

    def _masks(self, constraints: list[Constraint]) -> torch.Tensor:
        mask = torch.zeros(len(constraints), self.words, dtype=torch.int32)  # [C, words]
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(
            [(c.matcher, i) for i, c in enumerate(constraints)],
            mask.data_ptr(),
            self.words * 4,
            len(constraints),
        )
        for i, c in enumerate(constraints):
            allow = list(c.stop_ids) if c.matcher.is_accepting() else []  # where the grammar may end
            if c.state == "undecided" and c.opening is not None:
                allow.append(c.opening)  # or the model opens its reasoning first
            for t in allow:
                if 0 <= t < self.vocab_size:
                    mask[i, t // 32] |= _bit(t % 32)
        return mask

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << k) - (1 << 32 if k == 31 else 0)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


@torch.inference_mode()  # the runner's logits are inference tensors
def apply_masks(logits: torch.Tensor, rows: Sequence[int], mask: torch.Tensor) -> None:
    """logits: [B, V] fp32, in place; mask: [len(rows), words] int32 for those rows."""
    dev, vocab = logits.device, logits.shape[1]
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    m = mask.to(dev, non_blocking=True)
    keep = ((m[:, :, None] >> shifts) & 1).reshape(m.shape[0], -1)[:, :vocab].bool()  # [R, V]
    ninf = torch.tensor(float("-inf"), device=dev)
    if list(rows) == list(range(logits.shape[0])):  # every row constrained: one pass
        torch.where(keep, logits, ninf, out=logits)
        return
    for j, r in enumerate(rows):  # a row of a contiguous [B, V] is contiguous: masked in place
        torch.where(keep[j], logits[r], ninf, out=logits[r])
