"""The engine: one model, its KV pool, the scheduler and the sampler, behind a small API.

    engine = Engine("/models/qwen3", devices=["cpu"], num_slots=8, kv_budget_bytes=512 << 20)
    engine.submit("req-1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step():   # TokenOut: request_id, token, logprob, top, finish
            ...

No HTTP, no ZeroMQ: the worker process wraps this. ``step`` returns every new token at once;
the caller sends them on (one message per step), so a slow consumer never blocks the loop.

An engine is built from one ``EngineSpec`` (``pantheon/core/engine_spec.py``: the worker passes
the ``LoadModel`` it got, which is one; the keywords above are its fields), in the named steps
of ``workers/engine_build.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from pantheon.core.engine_spec import EngineSpec
from pantheon.core.protocol import (
    SPECULATIVE_ON,
    SPECULATIVE_TOKENS,
    EmbedOut,
    InstanceStats,
    Pooling,
    SamplingParams,
    SlotInfo,
    TokenOut,
)
from workers import compiled
from workers import engine_build as build
from workers.block_manager import BlockManager
from workers.errors import LoadError, RequestRejected, StepFailed
from workers.grammar import Constraint, Grammars, apply_masks
from workers.mtp import MtpDraft
from workers.pooling import Pooled
from workers.prompt_logprobs import PromptLogprobsAcc
from workers.runner import ModelRunner
from workers.sampler import SamplerState, sample, verify
from workers.scheduler import Scheduler, Sequence, StepPlan
from workers.speculation import SpecStats, propose
from workers.step_budget import StepBudget
from workers.step_guard import survivable

__all__ = ["Engine", "LoadError", "RequestRejected", "StepFailed"]


EMBED_BATCH = 64  # whole inputs an encoder (BERT) runs in one step, at most
EMBED_STEP_TOKENS = 16384  # and their tokens, at most (one input longer than that runs alone)


class Engine:
    def __init__(
        self,
        spec: EngineSpec | str,
        *,
        progress: Callable[[int, int], None] | None = None,
        **fields: object,
    ):
        """Build the engine ``spec`` describes (``workers/engine_build.py``'s steps, in order);
        ``Engine(path, **fields)`` is ``Engine(EngineSpec(path=path, **fields))``. ``progress``
        is called with (tensors done, total) as the weights load. Raises ``LoadError``."""
        spec = spec if isinstance(spec, EngineSpec) else build.spec_of(spec, fields)
        p = build.plan(spec)  # config, KV types, draft checks, CPU path, dtype, block budget
        cfg = self.cfg = p.cfg
        self.engine_spec, self.devices, self.dtype, self.kv_types = spec, p.devices, p.dtype, p.kv_types
        self.cpu_path, self.cpu_timings, self.cpu_note = p.cpu_path, p.cpu_timings, p.cpu_note
        self.encoder, self.num_slots, self.max_model_len = p.encoder, p.num_slots, p.max_model_len
        self.vocab_size, self.eos_token_ids = cfg.vocab_size, list(cfg.eos_token_ids)
        self.model = build.load_weights(p, progress)
        # a model that only embeds (BERT): bidirectional attention, a prompt is never split
        self.embed_only = bool(getattr(self.model, "embed_only", False))
        ck = self.checkpoints = build.checkpoint_index(p)
        self.prefix_cache = spec.prefix_cache and (not cfg.slot_state_layers or ck is not None)
        self.blocks = BlockManager(p.num_blocks, spec.block_size, enable_cache=self.prefix_cache)
        # (an encoder's prompts are never split: whole_prompts)
        self.scheduler = Scheduler(
            self.blocks, p.num_slots, spec.prefill_chunk, p.max_model_len, ck, self.embed_only
        )
        # Prefill per step: at most prefill_chunk, fewer when measured steps would outgrow the
        # target (a slow CPU, a big model), so decoding streams keep flowing past long prompts.
        self.budget = StepBudget(spec.step_target_s, spec.prefill_chunk, crossover=_attention_crossover(cfg))
        self.runner: ModelRunner = ModelRunner(
            self.model, cfg, self.blocks, p.dtype, p.num_slots, ck.capacity if ck else 0, p.kv_types
        )
        self.compiler = build.start_compile(p, self.runner)
        # Speculation (workers/speculation.py) needs rows that can be taken back (paged K/V, or
        # a recurrent state kept per verify row): no sliding ring, no length-dependent RoPE.
        self.spec_supported = cfg.can_speculate and not self.embed_only
        self.recurrent = bool(cfg.recurrent_layers)  # the engine keeps a verify's accepted state
        self.spec = SpecStats()
        self.spec_default = max(0, spec.speculative)  # drafts per step for requests that do not say
        self.draft, self.draft_name = build.make_draft(p, self.model, self.blocks, self.spec_supported)
        if not self.embed_only:
            self.compiler = build.decode_graphs(p, self.runner, self.compiler, self.draft is not None)
        held = build.byte_account(self.model, self.runner, self.draft)
        self.weight_bytes, self.step_read_bytes = held.weight, held.step_read
        self.kv_bytes, self.state_bytes = held.kv, held.state
        self._samplers: dict[str, SamplerState] = {}
        self._constraints: dict[str, Constraint] = {}  # request id -> its grammar, if any
        # request id -> its prompt logprobs so far, until its first token carries them
        self._prompt_lps: dict[str, PromptLogprobsAcc] = {}
        self._embeds: dict[str, Pooled] = {}  # embedding request id -> its pooling so far
        self.embedded: list[EmbedOut] = []  # finished embeddings, taken by take_embedded()
        self.grammars = Grammars(spec.path, cfg.vocab_size, self.eos_token_ids)
        self.grammars.warm()  # on a thread, while the first requests arrive
        # Test and debug hook: called with (sequences, fp32 logits [B, V]) before sampling.
        self.on_logits: Callable[[list[Sequence], torch.Tensor], None] | None = None
        self.steps = 0
        self.step_seconds = 0.0

    # ------------------------------------------------------------ API

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
        use_cache: bool = True,
        prompt_logprobs: int | None = None,
    ) -> None:
        """Queue a request. Raises ``RequestRejected`` if it can never run here.

        Its leading prompt blocks are shared with earlier requests of the same ``cache_salt``
        that had the same tokens (the prefix cache) unless ``use_cache`` is False, or it asks
        for ``prompt_logprobs`` (the top K of each prompt position, on its first ``TokenOut``:
        ``workers/prompt_logprobs.py``), which every prompt position must be computed for.
        """
        if request_id in self._samplers or request_id in self._embeds:
            raise RequestRejected("duplicate", f"request id {request_id!r} is already running")
        if self.embed_only:
            raise RequestRejected("invalid", "this model only embeds: it cannot generate")
        if not prompt:
            raise RequestRejected("invalid", "the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise RequestRejected("invalid", f"prompt token ids must be in [0, {self.vocab_size})")
        if params.max_tokens < 1:
            raise RequestRejected("invalid", "max_tokens must be at least 1")
        bad = next((t for t in params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                "invalid", f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= min(20, self.vocab_size):
            raise RequestRejected("invalid", "prompt_logprobs must be in [0, 20]")
        if len(prompt) >= self.max_model_len:
            raise RequestRejected(
                "context_length",
                f"the prompt has {len(prompt)} tokens; this model takes at most "
                f"{self.max_model_len - 1} plus one generated token",
            )
        if self.blocks.blocks_for(len(prompt) + 1) > self.blocks.num_blocks:
            raise RequestRejected(
                "context_length",
                f"the prompt has {len(prompt)} tokens but the KV pool holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}",
            )
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        if params.grammar is not None:  # compiled (or found in the cache) before the slot is taken
            self._constraints[request_id] = self.grammars.constraint(
                params.grammar,
                sorted(stop),
                params.grammar_after,
                params.grammar_opening if params.grammar_opening >= 0 else None,
            )
        if prompt_logprobs is not None:
            self._prompt_lps[request_id] = PromptLogprobsAcc(list(prompt), prompt_logprobs)
            use_cache = False  # a cache hit would skip the positions asked for
        self._samplers[request_id] = SamplerState.create(params, sorted(stop), self.devices[0])
        spec = self.spec_default if params.speculative is None else params.speculative
        if spec == SPECULATIVE_ON:
            spec = self.spec_default or SPECULATIVE_TOKENS
        spec = spec if self.spec_supported and _speculates(params) else 0
        self.scheduler.add(
            Sequence(
                request_id=request_id,
                prompt_len=len(prompt),
                tokens=list(prompt),
                max_tokens=params.max_tokens,
                stop_ids=frozenset(stop),
                min_tokens=params.min_tokens,
                session_id=session_id,
                cache_salt=cache_salt,
                use_cache=use_cache,
                spec_tokens=spec,
            )
        )

    def submit_embed(self, request_id: str, prompt: list[int], pooling: Pooling, normalize: bool) -> None:
        """Queue an embedding: a prefill of ``prompt`` with no decode, scheduled beside
        generation, nothing kept in the prefix cache; its vector comes out of ``take_embedded``
        after the step that computes its last token. Raises ``RequestRejected``."""
        if request_id in self._samplers or request_id in self._embeds:
            raise RequestRejected("duplicate", f"request id {request_id!r} is already running")
        if not prompt:
            raise RequestRejected("invalid", "the input is empty")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise RequestRejected("invalid", f"input token ids must be in [0, {self.vocab_size})")
        limit = min(self.max_model_len, self.blocks.num_blocks * self.blocks.block_size)
        if len(prompt) > limit:
            raise RequestRejected(
                "context_length", f"the input has {len(prompt)} tokens; this model takes at most {limit}"
            )
        self._embeds[request_id] = Pooled(pooling, normalize)
        self.scheduler.add(
            Sequence(
                request_id=request_id,
                prompt_len=len(prompt),
                tokens=list(prompt),
                max_tokens=1,
                use_cache=False,
                embed=pooling,
            )
        )

    def take_embedded(self) -> list[EmbedOut]:
        """The embeddings finished since the last call."""
        out, self.embedded = self.embedded, []
        return out

    def _pool(self, plan: StepPlan) -> None:
        """Feed each embedding's prefill chunk of this step to its pooling; end the ones whose
        prompt is now computed (their vectors go to ``embedded``)."""
        hidden = self.runner.last_hidden
        # the step's rows: decode rows first (each verifying sequence's among them), then each chunk's
        row = len(plan.decode) + sum(1 + len(s.draft) for s in plan.verify)
        for s, n in plan.prefill:
            pooled = self._embeds.get(s.request_id) if s.embed is not None else None
            if pooled is not None and hidden is not None:
                done = s.num_computed >= s.prompt_len  # committed: num_computed includes this chunk
                pooled.add(hidden[row : row + n], s.num_computed - n, done)
                if done:
                    self.embedded.append(
                        EmbedOut(request_id=s.request_id, vector=pooled.vector(), prompt_tokens=s.prompt_len)
                    )
                    self.scheduler.finish(s)
                    self._forget(s.request_id)
            row += n

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its slot and blocks. Unknown ids are ignored."""
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if isinstance(self.draft, MtpDraft):
            self.draft.forget(request_id)
        self._samplers.pop(request_id, None)
        self._constraints.pop(request_id, None)
        self._prompt_lps.pop(request_id, None)
        self._embeds.pop(request_id, None)

    def request_tables(self) -> dict[str, int]:
        """The size of everything kept per request: all 0 once every request has ended
        (finished, aborted, truncated or failed its grammar); the worker's memory report and
        tests/unit/test_worker_tables.py read it."""
        return {
            "samplers": len(self._samplers),
            "constraints": len(self._constraints),
            "prompt_logprobs": len(self._prompt_lps),
            "embeds": len(self._embeds),
            "sequences": len(self.scheduler._by_id),
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running()),
            "grammar_failures": len(self.grammars.failed),
            "blocks_held": self.blocks.num_used,
        }

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits at every position of ``prompt``: [T, vocab] fp32, computed in one pass.

        Runs outside the scheduler on borrowed blocks (call it between steps); used by the
        reference tests (a request's prompt logprobs come from its own prefill instead:
        ``Submit.prompt_logprobs``).
        """
        seq = Sequence("\0prompt", len(prompt), list(prompt), 1, use_cache=False)
        if not self.blocks.ensure(seq.block_table, len(prompt)):
            raise RequestRejected("context_length", "the KV pool has no room for this prompt now")
        try:
            return self.runner.run(StepPlan(decode=[], prefill=[(seq, len(prompt))]), all_rows=True)
        finally:
            self.blocks.free(seq.block_table)

    def reset_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks)."""
        self.blocks.reset_cache()
        if self.checkpoints is not None:
            self.checkpoints.reset()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenOut]:
        """Run one step: decode every running sequence, plus at most one prefill chunk's worth.

        An exception inside it ends the requests the step ran and raises ``StepFailed`` naming
        them (``workers/step_guard.py``: the engine goes on with the others), unless it leaves
        the device unusable, which is raised as it is."""
        t0 = time.perf_counter()
        try:
            plan = self._plan()
        except Exception as e:  # before the plan: which sequence it was is not known
            if not survivable(e, self.devices[0]):
                raise
            raise self._failed(self.scheduler.running(), [], e) from e
        outs = [TokenOut(s.request_id, -1, finish="length") for s in plan.truncated]
        for s in plan.truncated:
            self._forget(s.request_id)
        if plan.empty:
            return outs
        try:
            return self._run(plan, outs, t0)
        except Exception as e:
            if not survivable(e, self.devices[0]):
                raise
            ran = list(plan.decode) + list(plan.verify) + [s for s, _n in plan.prefill]
            raise self._failed(ran, outs, e) from e

    def _failed(self, seqs: list[Sequence], outs: list[TokenOut], cause: Exception) -> StepFailed:
        """End ``seqs`` (a step that raised ``cause`` ran them); the ``StepFailed`` to raise."""
        ids = [s.request_id for s in seqs]
        for rid in ids:
            self.abort(rid)
        gone = set(ids)
        return StepFailed(ids, [o for o in outs if o.request_id not in gone], cause)

    def _plan(self) -> StepPlan:
        """This step's drafts, then its plan."""
        decoding = False
        wants: list[tuple[Sequence, int]] = []  # (sequence, at most k drafts) for the draft model
        for s in self.scheduler.running():
            decoding = decoding or s.decoding
            if s.spec_tokens and s.decoding:
                # drafts beyond what the request may still emit (max_tokens, the context) are waste
                k = min(
                    s.spec_tokens, s.max_tokens - s.num_output - 1, self.max_model_len - 1 - s.num_computed
                )
                if self.draft is None:
                    s.draft = propose(s.tokens, k) if k > 0 else []
                elif k > 0:
                    wants.append((s, k))
                else:
                    s.draft = []
        if wants:
            assert self.draft is not None
            self.draft.propose(wants)
        if self.encoder:
            # nothing decodes beside an encoder's steps, so no stream waits on their length:
            # a step takes the whole batch (the token bound caps one step's activations)
            return self.scheduler.schedule(max(self.budget.ceiling, EMBED_STEP_TOKENS))
        return self.scheduler.schedule(
            lambda context, pending: self.budget.tokens(decoding, context, pending)
        )

    def _run(self, plan: StepPlan, outs: list[TokenOut], t0: float) -> list[TokenOut]:
        """Compute ``plan``; ``outs`` (its truncations) gains every token it samples."""
        seqs = plan.sampled()
        # The grammar masks of the rows about to be sampled are computed while the model runs.
        guided = [
            (i, c)
            for i, s in enumerate(seqs)
            if (c := self._constraints.get(s.request_id)) is not None and c.masking
        ]
        masks = self.grammars.start_masks([c for _i, c in guided]) if guided else None
        for slot, checkpoint in plan.restores:
            self.runner.load_state(slot, checkpoint)
        # prompt logprobs: the rows of the chunks that predict prompt tokens (before commit
        # moves num_computed past the chunk)
        kept = {
            s: (acc, s.num_computed, acc.rows_wanted(s.num_computed, n))
            for s, n in plan.prefill
            if (acc := self._prompt_lps.get(s.request_id)) is not None
        }
        # the rows the model's own head is fed after the step (before commit moves num_computed)
        fed = self.draft.fed_rows(plan) if isinstance(self.draft, MtpDraft) else []
        logits = self.runner.run(plan, prompt_rows={s: rows for s, (_a, _p, rows) in kept.items()})
        n_verify = sum(1 + len(s.draft) for s in plan.verify)
        cut = logits.shape[0] - n_verify  # the verify chunks' rows come last
        logits, verify_logits = logits[:cut], logits[cut:]
        if kept:
            at = len(seqs)
            for acc, p0, rows in kept.values():
                acc.add(p0, logits[at : at + rows])
                at += rows
            logits = logits[: len(seqs)]
        self.scheduler.commit(plan)
        if self._embeds:
            self._pool(plan)
        if self.checkpoints is not None:
            self._checkpoint(plan)
        if seqs:
            if self.on_logits is not None:
                self.on_logits(seqs, logits)
            if masks is not None:
                apply_masks(logits, [i for i, _c in guided], masks.result())
            states = [self._samplers[s.request_id] for s in seqs]
            recents = [_window(s.tokens, st.params.repetition_window) for s, st in zip(seqs, states)]
            picks = sample(logits, states, recents, [s.num_output for s in seqs])
            for s, pick in zip(seqs, picks):
                c = self._constraints.get(s.request_id)
                complete = c is not None and c.advance(pick.token)
                reason = self.scheduler.append_token(s, pick.token, complete=complete)
                cached = s.cached_tokens if s.num_output == 1 else None
                acc = self._prompt_lps.pop(s.request_id, None) if s.num_output == 1 else None
                prompt_lp = acc.result() if acc is not None else None
                outs.append(
                    TokenOut(s.request_id, pick.token, pick.logprob, pick.top, reason, cached, prompt_lp)
                )
                if reason:
                    self._forget(s.request_id)
        if n_verify:
            outs += self._verify(plan, verify_logits)
        if fed:
            assert isinstance(self.draft, MtpDraft)
            self.draft.feed(fed, self.runner.last_hidden)
        took = time.perf_counter() - t0
        n_prefill = sum(n for _s, n in plan.prefill)
        # Mean positions a prefilled token attended to (chunk from p0, n tokens: p0 + (n + 1) / 2).
        context = sum(n * (s.num_computed - n + (n + 1) / 2) for s, n in plan.prefill) / max(1, n_prefill)
        self.budget.observe(len(plan.decode) + n_verify, n_prefill, took, context)
        self.steps += 1
        self.step_seconds += took
        return outs

    def _verify(self, plan: StepPlan, logits: torch.Tensor) -> list[TokenOut]:
        """Accept what the target agrees with of each verified draft (``sampler.verify``) and
        emit those tokens plus the target's own, cut where the sequence finishes."""
        outs: list[TokenOut] = []
        at = 0
        for run, s in enumerate(plan.verify):
            draft, n = s.draft, 1 + len(s.draft)
            st = self._samplers[s.request_id]
            tokens = verify(logits[at : at + n], draft, st, s.num_output)
            slot, p0 = s.slot, s.num_computed
            taken, reason = self.scheduler.accept(s, tokens)
            if self.recurrent:
                assert slot is not None
                self._keep_verified(s, slot, p0, run, finished=reason is not None)
            at += n
            self.spec.add(len(draft), len(tokens) - 1, len(taken))
            for i, t in enumerate(taken):
                outs.append(TokenOut(s.request_id, t, finish=reason if i == len(taken) - 1 else None))
            if reason:
                self._forget(s.request_id)
        return outs

    def _keep_verified(self, s: Sequence, slot: int, p0: int, run: int, finished: bool) -> None:
        """A hybrid model's verify run ``run`` kept ``s.num_computed - p0`` of its rows: the
        slot's recurrent states become those after the last of them (unless the sequence
        finished and left its slot), and a block boundary those rows passed gets its
        checkpoint as a plain decode's would (``_checkpoint``), from the state after the row
        that ends the block."""
        kept = s.num_computed - p0
        if not finished:
            self.runner.keep_verified(slot, run, kept - 1)
        ck, bs = self.checkpoints, self.blocks.block_size
        edge = s.num_computed // bs * bs  # the newest boundary at or before the computed rows
        if ck is None or not s.use_cache or edge <= p0 or len(s.block_hashes) < edge // bs:
            return
        self._file_checkpoint(
            s, edge, lambda i: self.runner.save_verified(run, edge - p0 - 1, i), decode=True
        )

    def _checkpoint(self, plan: StepPlan) -> None:
        """Keep the recurrent states of the block boundaries this step reached: a prompt's last
        one (its prefill chunk ends there) and, for a decoding sequence, the newest one it has
        passed (replacing its previous one), so a conversation's next turn restores them."""
        bs = self.blocks.block_size
        seqs = [(s, False) for s in plan.decode] + [(s, True) for s, _n in plan.prefill]
        for s, prefill in seqs:
            n = s.num_computed
            if not s.use_cache or s.slot is None or n == 0 or n % bs or len(s.block_hashes) < n // bs:
                continue
            if prefill and n != s.prompt_len // bs * bs:
                continue  # an earlier boundary of a long prompt: not worth a checkpoint
            self._file_checkpoint(s, n, functools.partial(self.runner.save_state, s.slot), decode=not prefill)

    def _file_checkpoint(self, s: Sequence, n: int, save: Callable[[int], None], decode: bool) -> None:
        """File the recurrent states of ``s`` at block boundary ``n`` under its block's hash
        (``save(i)`` writes them into checkpoint ``i``, when the index gives one). A decoding
        sequence keeps one such checkpoint, its newest: the one it had before is dropped."""
        ck = self.checkpoints
        assert ck is not None
        h = s.block_hashes[n // self.blocks.block_size - 1]
        if decode and s.decode_checkpoint is not None and s.decode_checkpoint != h:
            ck.drop(s.decode_checkpoint)
        i = ck.put(h)
        if i is not None:
            save(i)
        if decode:
            s.decode_checkpoint = h

    def stats(self, instance: str) -> InstanceStats:
        slots = []
        for s in self.scheduler.slots:
            if s is None:
                slots.append(SlotInfo("idle"))
            else:
                state = "decode" if s.num_output > 0 and s.decoding else "prefill"
                slots.append(
                    SlotInfo(
                        state,
                        s.request_id,
                        s.prompt_len,
                        min(s.num_computed, s.prompt_len),
                        s.num_output,
                        s.session_id,
                    )
                )
        return InstanceStats(
            instance=instance,
            slots=slots,
            waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_used=self.blocks.num_used,
            weight_bytes=self.weight_bytes,
            kv_bytes=self.kv_bytes,
            kv_blocks_cached=self.blocks.num_cached,
            cache_hit_blocks=self.blocks.hits,
            cache_query_blocks=self.blocks.queries,
            prefill_budget=self.budget.tokens(),
            block_size=self.blocks.block_size,
            spec_verify_steps=self.spec.verify_steps,
            spec_drafted=self.spec.drafted,
            spec_accepted=self.spec.accepted,
            spec_emitted=self.spec.emitted,
            spec_draft=self.draft_name,
            compile_state=self.compiler.state,
            compile_s=round(self.compiler.seconds, 1),
            compile_cache=self.compiler.cache_note,
        )

    def close(self) -> None:
        """Drop the weights and the cache (the worker calls this on unload); the engine is not
        used after."""
        self.grammars.close()
        self.compiler.close()
        # A CUDA die's graphs hold the model, its caches and their own memory: dropped here, so
        # that the worker's gc and empty_cache right after (engine still referenced) free them
        self.compiler = compiled.NotCompiled("closed")
        if self.draft is not None:
            self.draft.close()
        self.runner = None  # pyright: ignore[reportAttributeAccessIssue]  # dropped for good
        self.model = None  # pyright: ignore[reportAttributeAccessIssue]
        if any(d.type == "cuda" for d in self.devices):
            torch.cuda.empty_cache()


def _attention_crossover(cfg) -> float:
    """The context at which a token's attention costs as many FLOPs as its linear layers (see
    ``StepBudget.crossover``); ``inf`` when the shapes do not say."""
    try:
        hid, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    except AttributeError:
        return float("inf")
    try:
        attn_layers = len(cfg.attention_layers) or layers
    except (AttributeError, TypeError):
        attn_layers = layers
    linear = 2 * layers * (hid * (q + 2 * kv) + q * hid + 3 * hid * inter)
    per_position = 4 * attn_layers * q  # q.k and p.v for each query head
    return linear / per_position if per_position > 0 else float("inf")


def _speculates(params: SamplingParams) -> bool:
    """Whether a request's sampling can be checked draft row by draft row (see
    ``workers/speculation.py``): no grammar, no logprobs, no output-dependent penalty."""
    return (
        params.grammar is None
        and not params.logprobs
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
    )


def _window(tokens: list[int], n: int) -> list[int]:
    """The last ``n`` tokens the repetition penalty looks at: -1 all of them, 0 none (a bare
    ``tokens[-0:]`` would be all)."""
    return tokens if n < 0 else tokens[-n:] if n else []
