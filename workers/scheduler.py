"""Slot states, queue order and the plan of each engine step. No torch here.

A step decodes one token for every sequence that is past its prefill and spends at most
``prefill_chunk`` tokens (or the step budget the engine passes, see ``step_budget``) on
prefill, oldest joiner first, so a decoding sequence waits at
most one chunk for joiners. When the KV pool runs dry, the newest running sequence is
preempted: its blocks are freed and it is recomputed from its tokens later; the others are
untouched. Requests beyond the slot count wait FIFO.

A model with recurrent layers (``checkpoints`` given) reuses a cached prefix only up to the
longest block boundary whose state checkpoint is kept too (``workers/state_checkpoints.py``), and
its prefill chunks end on block boundaries (the prompt's last one included), where the engine
takes those checkpoints.

An embedding (``Sequence.embed`` set) is a sequence that only prefills: it takes a slot and
prefill budget like any prompt, is never sampled, and the engine ends it (``finish``) once its
prompt is computed. A model whose attention is bidirectional (BERT: ``whole_prompts``) cannot
split a prompt across steps: each prefill is the whole prompt, alone in a step when it is larger
than the step's budget.

A decoding sequence with a speculative draft (``Sequence.draft``, set by the engine before
``schedule``: ``workers/speculation.py``) verifies it instead of decoding one token: its pending
token and drafts are ``1 + len(draft)`` decode rows (``StepPlan.verify``), given blocks for
all of them only when the pool has them free (never by preempting); ``accept`` then records what
the target kept. The blocks past the accepted length stay with the sequence and are overwritten.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pantheon.core.engine_spec import SLOTS
from pantheon.core.protocol import FinishReason
from workers.block_manager import BlockManager, block_hash
from workers.state_checkpoints import CheckpointIndex


@dataclass(eq=False)  # identity, not field equality: sequences are tracked by object
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_len: int
    tokens: list[int]  # prompt then output; grows by one per sampled token
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    arrival: int = 0
    session_id: str | None = None
    cache_salt: str | None = None
    use_cache: bool = True  # False: neither reuse nor publish prefix blocks (a capped context)
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks
    num_registered: int = 0  # leading blocks of block_table filed in the prefix cache
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    finish: FinishReason | None = None
    preemptions: int = 0
    restore: int | None = None  # a state checkpoint to load into the slot before its first chunk
    decode_checkpoint: bytes | None = None  # the hash of its newest decode-time state checkpoint
    embed: str | None = None  # an embedding's pooling (protocol.Pooling): prefill only, never sampled
    spec_tokens: int = 0  # drafts per step when it speculates (workers/speculation.py); 0: never
    draft: list[int] = field(default_factory=list)  # this step's drafted tokens, set before schedule()
    # a draft model's progress (workers/draft.py): leading positions whose draft K/V rows are
    # computed, the last len(draft_fed) of them from its own proposals (valid as far as kept)
    draft_computed: int = 0
    draft_fed: list[int] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache; the last of them is the one that predicts the next."""
        return len(self.tokens) - self.num_computed

    @property
    def decoding(self) -> bool:
        """Past its prefill: its one pending token is decoded. Never an embedding, whose last
        pending token is still prompt (a chunk that ends one token short of its prompt left it
        there) and is prefilled, never sampled."""
        return self.embed is None and self.num_computed > 0 and self.pending == 1


@dataclass
class StepPlan:
    """What one step computes: one token per decode sequence, then the prefill chunks."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens of it to compute this step)
    preempted: list[Sequence] = field(default_factory=list)
    truncated: list[Sequence] = field(default_factory=list)  # finished: the pool cannot hold more
    restores: list[tuple[int, int]] = field(default_factory=list)  # (slot, state checkpoint) to load first
    # decoding sequences that verify their draft: 1 + len(draft) decode rows each, every row's
    # logits kept (after the sampled and prompt rows)
    verify: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify

    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token from this step, in row order of the step's logits.

        Fixed when the plan is made: a prefill chunk samples only if it reaches the last token.
        """
        return list(self.decode) + [s for s, _n in self.prefill if s in self._completing and s.embed is None]

    _completing: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        num_slots: int = SLOTS,
        prefill_chunk: int = 128,
        max_model_len: int = 4096,
        checkpoints: CheckpointIndex | None = None,
        whole_prompts: bool = False,
    ):
        self.blocks = blocks
        self.whole_prompts = whole_prompts  # bidirectional attention: a prompt is one chunk
        self.checkpoints = checkpoints
        self.slots: list[Sequence | None] = [None] * num_slots
        self.prefill_chunk = prefill_chunk
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = 0

    # ------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks and slot are free at once."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        if seq.slot is None:
            self.waiting.remove(seq)
        self._release(seq, "abort")
        return True

    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ------------------------------------------------------------ the step

    def schedule(self, prefill_tokens: int | Callable[[int, int], int] | None = None) -> StepPlan:
        """Plan the next step; it prefills at most ``prefill_tokens`` (default ``prefill_chunk``).
        A function is given the context of the sequence the step prefills first (its positions
        already computed, a cached prefix included), once this step's joiners have their slots
        and their prefixes: a joiner that finds 7k positions cached starts 7k deep; and the prompt
        tokens all the slots' prefilling sequences still have."""
        plan = StepPlan(decode=[], prefill=[])
        self._admit(plan)
        running = sorted(self.running(), key=lambda s: s.arrival)
        if callable(prefill_tokens):
            prefilling = [s for s in running if s.slot is not None and not s.decoding and not s.finish]
            first = prefilling[0] if prefilling else None
            prefill_tokens = prefill_tokens(
                first.num_computed if first is not None else 0, sum(s.pending for s in prefilling)
            )

        for seq in running:
            if seq.slot is None or not seq.decoding:
                continue
            # A draft is verified only where its rows fit without preempting anyone; else the
            # sequence decodes one token as usual.
            if seq.draft and self.blocks.ensure(seq.block_table, seq.num_computed + 1 + len(seq.draft)):
                plan.verify.append(seq)
                continue
            seq.draft = []
            if self._grow(seq, seq.num_computed + 1, plan):
                plan.decode.append(seq)

        budget = self.prefill_chunk if prefill_tokens is None else max(1, prefill_tokens)
        for seq in running:
            if budget == 0:
                break
            if seq.slot is None or seq.decoding or seq.finish:
                continue
            if self.whole_prompts and seq.pending > budget and plan.prefill:
                break  # a bidirectional pass is never split: it gets a step of its own
            n = seq.pending if self.whole_prompts else self._chunk(seq, min(budget, seq.pending))
            if not self.blocks.ensure(seq.block_table, seq.num_computed + n):
                break  # wait for decoders to finish; never preempt a decoder for a joiner
            plan.prefill.append((seq, n))
            if n == seq.pending:
                plan._completing.append(seq)
            budget = max(0, budget - n)  # a whole prompt may pass the budget
        return plan

    def _chunk(self, seq: Sequence, n: int) -> int:
        """The tokens of ``seq`` to prefill now, at most ``n``: with recurrent layers the chunk
        ends at the prompt's last block boundary when it would cross it (its state is
        checkpointed there), and a chunk that does not finish the prompt ends on a boundary."""
        if self.checkpoints is None or not seq.use_cache:
            return n
        bs, p0 = self.blocks.block_size, seq.num_computed
        boundary = seq.prompt_len // bs * bs
        if p0 < boundary < p0 + n:
            return boundary - p0
        end = (p0 + n) // bs * bs
        if n < seq.pending and end > p0:
            return end - p0
        return n

    def _admit(self, plan: StepPlan) -> None:
        for i, s in enumerate(self.slots):
            if s is None and self.waiting:
                seq = self.waiting.popleft()
                seq.slot = i
                self.slots[i] = seq
                self._reuse_prefix(seq)
                if seq.restore is not None:
                    plan.restores.append((i, seq.restore))
                    seq.restore = None

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start ``seq`` on the cached blocks of its longest cached prefix."""
        if not seq.use_cache:
            return
        # At least one token is always computed: its logits pick the next token.
        n_full = (len(seq.tokens) - 1) // self.blocks.block_size
        self._extend_hashes(seq, n_full)
        seq.block_table = self.blocks.match(seq.block_hashes[:n_full])
        if self.checkpoints is not None:
            # Recurrent layers: only as far as a boundary whose state is kept too.
            keep = len(seq.block_table)
            while keep and not self.checkpoints.has(seq.block_hashes[keep - 1]):
                keep -= 1
            if keep < len(seq.block_table):
                dropped = seq.block_table[keep:]
                del seq.block_table[keep:]
                self.blocks.free(dropped)  # back to the cache, as they were
                self.blocks.hits -= len(dropped)
            if keep:
                seq.restore = self.checkpoints.get(seq.block_hashes[keep - 1])
                self.checkpoints.hits += 1
        seq.num_registered = len(seq.block_table)
        seq.num_computed = len(seq.block_table) * self.blocks.block_size
        if seq.preemptions == 0:
            seq.cached_tokens = seq.num_computed

    def _extend_hashes(self, seq: Sequence, n_blocks: int) -> None:
        bs = self.blocks.block_size
        while len(seq.block_hashes) < n_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.tokens[i * bs : (i + 1) * bs], seq.cache_salt))

    def _publish(self, seq: Sequence) -> None:
        """File the blocks that this step filled in the prefix cache."""
        n_full = seq.num_computed // self.blocks.block_size
        if not seq.use_cache or n_full <= seq.num_registered:
            return
        self._extend_hashes(seq, n_full)
        for i in range(seq.num_registered, n_full):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered = n_full

    def _grow(self, seq: Sequence, n_tokens: int, plan: StepPlan) -> bool:
        """Make room for ``seq`` to hold ``n_tokens``, preempting newer sequences if needed."""
        while not self.blocks.ensure(seq.block_table, n_tokens):
            victim = max((s for s in self.running() if s is not seq), key=lambda s: s.arrival, default=None)
            if victim is None or victim.arrival < seq.arrival:
                if victim is None:
                    # Alone and the pool still cannot hold it: it has reached the pool's size.
                    plan.truncated.append(seq)
                    self._release(seq, "length")
                else:
                    self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
            if victim in plan.decode:
                plan.decode.remove(victim)
            if victim in plan.verify:
                plan.verify.remove(victim)
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.draft = []
        seq.draft_computed, seq.draft_fed = 0, []  # its draft rows went with its blocks
        seq.preemptions += 1
        assert seq.slot is not None  # only a running sequence is preempted
        self.slots[seq.slot] = None
        seq.slot = None
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    # ------------------------------------------------------------ after the step

    def commit(self, plan: StepPlan) -> None:
        """Record that the plan's tokens are now in the cache."""
        for seq in plan.decode:
            seq.num_computed += 1
            self._publish(seq)
        for seq, n in plan.prefill:
            seq.num_computed += n
            self._publish(seq)

    def append_token(self, seq: Sequence, token: int, *, complete: bool = False) -> FinishReason | None:
        """Add a sampled token; return the finish reason if the sequence is done (and free it).

        ``complete``: the request's grammar is complete with this token, so it stops here."""
        seq.tokens.append(token)
        reason = self._finished(seq, token, complete)
        if reason:
            self._release(seq, reason)
        return reason

    def _finished(self, seq: Sequence, token: int, complete: bool = False) -> FinishReason | None:
        if complete or token in seq.stop_ids and seq.num_output >= max(seq.min_tokens, 1):
            return "stop"
        if seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def accept(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Record a verified draft (``seq`` in ``plan.verify``): ``tokens`` are its accepted
        drafts then the target's own token. Appends them up to the one that finishes the sequence
        (a stop id, max_tokens, the context); the pending token and the accepted drafts among the
        appended are now computed (their K/V rows are right; the rows past them are overwritten
        by later steps). Returns the tokens appended and the finish reason, if any (then ``seq``
        is freed, after its full blocks are filed in the prefix cache, as ``commit`` does)."""
        taken: list[int] = []
        reason: FinishReason | None = None
        for t in tokens:
            seq.tokens.append(t)
            taken.append(t)
            reason = self._finished(seq, t)
            if reason:
                break
        # computed: the pending token, plus each appended token that was a draft the chunk ran
        seq.num_computed += min(len(taken), len(tokens) - 1) + 1
        seq.draft = []
        self._publish(seq)
        if reason:
            self._release(seq, reason)
        return taken, reason

    def finish(self, seq: Sequence) -> None:
        """End a sequence that needs no sampled token (an embedding whose prompt is computed)."""
        self._release(seq, "stop")

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish = reason
        self.blocks.free(seq.block_table)
        if seq.slot is not None:
            self.slots[seq.slot] = None
            seq.slot = None
        self._by_id.pop(seq.request_id, None)
