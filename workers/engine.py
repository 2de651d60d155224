"""The engine: one model, its KV pool, the scheduler and the sampler, behind a small API.

    engine = Engine("/models/qwen3", devices=["cpu"], num_slots=8, kv_budget_bytes=512 << 20)
    engine.submit("req-1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step():   # TokenOut: request_id, token, logprob, top, finish
            ...

No HTTP, no ZeroMQ: the worker process wraps this. ``step`` returns every new token at once;
the caller sends them on (one message per step), so a slow consumer never blocks the loop.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch

from pantheon.core.description import MTP
from pantheon.core.kv_types import KvCacheTypes
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
from pantheon.core.sizing import state_checkpoints
from workers import compiled, cpu_paths
from workers.block_manager import BlockManager
from workers.cache import check_kv_types, kv_block_bytes
from workers.cpu_pack import weight_bytes
from workers.cuda_graphs import DecodeGraphs
from workers.draft import DraftModel, draft_block_bytes, draft_layout, load_draft_config
from workers.errors import LoadError, RequestRejected, StepFailed
from workers.grammar import Constraint, Grammars, apply_masks
from workers.layers.moe import unread_expert_bytes
from workers.loader import load_model, resolve_dtype
from workers.model_config import load_config
from workers.mtp import MtpDraft, head_description, load_head
from workers.pooling import Pooled
from workers.prompt_logprobs import PromptLogprobsAcc
from workers.runner import ModelRunner
from workers.sampler import SamplerState, sample, verify
from workers.scheduler import Scheduler, Sequence, StepPlan
from workers.speculation import SpecStats, propose
from workers.state_checkpoints import CheckpointIndex
from workers.step_budget import DEFAULT_TARGET_S, StepBudget
from workers.step_guard import survivable

__all__ = ["Engine", "LoadError", "RequestRejected", "StepFailed"]


EMBED_BATCH = 64  # whole inputs an encoder (BERT) runs in one step, at most
EMBED_STEP_TOKENS = 16384  # and their tokens, at most (one input longer than that runs alone)


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        devices: list[str] | None = None,
        dtype: str = "auto",
        num_slots: int = 8,
        kv_budget_bytes: int = 256 << 20,
        prefill_chunk: int = 512,
        step_target_s: float = DEFAULT_TARGET_S,
        block_size: int = 16,
        max_model_len: int | None = None,
        quantize: bool = False,
        cpu_path: str | None = None,
        compile_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        prefix_cache: bool = True,
        state_checkpoint_count: int | None = None,
        speculative: int = 0,
        draft: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        kv_types: KvCacheTypes = KvCacheTypes(),
    ):
        if num_slots < 1 or prefill_chunk < 1 or block_size < 1:
            raise LoadError("invalid", "num_slots, prefill_chunk and block_size must be at least 1")
        devices = devices or ["cpu"]
        cfg = load_config(model_path)  # fail fast on config errors before touching weights
        try:  # a KV cache type this model's heads or these devices cannot hold: refused before the weights
            check_kv_types(cfg, kv_types, [torch.device(d) for d in devices])
        except ValueError as e:
            raise LoadError("invalid", str(e)) from None
        # A draft model (workers/draft.py) is checked before either model's weights are read: its
        # tokenizer, its layers, and whether this model can verify drafts at all.
        draft_cfg = None
        if draft is not None:
            if not cfg.can_speculate:
                raise LoadError(
                    "invalid",
                    f"{model_path} cannot speculate (sliding-window layers, or dynamic RoPE): it "
                    "takes no draft model",
                )
            if draft == MTP:  # the model's own head (workers/mtp.py)
                draft_cfg = head_description(model_path, cfg)
            else:
                draft_cfg = load_draft_config(draft, model_path, kv_types, [torch.device(devices[0])])
        asked_dtype = dtype
        # On a CPU die the path (kernel layout and compute dtype) is chosen before the weights
        # are read: forced by ``cpu_path`` / PANTHEON_CPU_PATH, else timed on this model's shapes.
        self.cpu_path: str | None = None
        self.cpu_timings: dict[str, tuple[float, float]] = {}
        self.cpu_note = ""
        if torch.device(devices[0]).type == "cpu":
            forced = cpu_path if cpu_path not in (None, cpu_paths.AUTO) else cpu_paths.forced_path()
            names = cpu_paths.candidates(
                quantize=quantize,
                dtype=dtype,
                forced=forced,
                quantized_source=cfg.quantized_source,
                int4_source=cfg.int4_source,
            )
            choice = cpu_paths.choose(cfg, names)
            self.cpu_path, self.cpu_timings = choice.name, choice.timings
            self.cpu_note = choice.note  # disturbed timings discarded, or the static order kept
            dtype = cpu_paths.DTYPE_NAMES[cpu_paths.PATHS[choice.name].dtype]
        dt = resolve_dtype(dtype, cfg, torch.device(devices[0]))
        # the bytes the KV rows really take as stored (quantized types: their blocks and scales)
        block_bytes = kv_block_bytes(cfg, block_size, dt, kv_types)
        self.kv_types = kv_types
        draft_path: tuple[str | None, str] = (None, asked_dtype)
        if draft == MTP:
            draft_path = (self.cpu_path, dtype)  # the head is laid out as the model
        elif draft_cfg is not None:
            # The draft's pool has as many blocks as the target's (one block table addresses
            # both): the budget (the router booked both pools in it) is shared by their block sizes.
            draft_path = draft_layout(
                draft_cfg, torch.device(devices[0]), asked_dtype, self.cpu_path, quantize
            )
        if draft_cfg is not None:
            block_bytes += draft_block_bytes(
                draft_cfg, block_size, draft_path[1], torch.device(devices[0]), kv_types
            )
        # An encoder that only embeds (BERT: no KV rows, nothing kept per slot) runs a batch of
        # up to EMBED_BATCH whole inputs a step, as sentence-transformers' encode does: its slots
        # and block tables are bookkeeping, and 8 inputs a step left most of a batch waiting
        self.encoder = not cfg.can_generate and not block_bytes
        if self.encoder:
            num_slots = max(num_slots, EMBED_BATCH)
        if block_bytes:
            num_blocks = kv_budget_bytes // block_bytes
        else:
            # No paged layer (every layer slides, each in its ring): the block tables are only
            # the scheduler's and the prefix cache's bookkeeping, and cost no memory.
            longest = min(max_model_len or cfg.context_limit, cfg.context_limit)
            num_blocks = (num_slots + 1) * -(-longest // block_size)
        if num_blocks < 2:
            raise LoadError(
                "out_of_memory",
                f"KV budget of {kv_budget_bytes} bytes holds fewer than 2 blocks "
                f"of {block_size} tokens ({block_bytes} bytes each)",
            )
        self.model, self.cfg = load_model(model_path, devices, dtype, progress, cfg)
        if self.cpu_path is not None:
            cpu_paths.apply(self.model, self.cpu_path, self.cfg)
            if getattr(self.model, "embed_only", False):
                self.model.lm_head = None  # a model that only embeds is never asked for logits
        elif quantize:
            from workers.quant import quantize_int8

            quantize_int8(self.model)
        self.dtype = dt
        self.devices = [torch.device(d) for d in devices]
        self.num_slots = num_slots
        limit = cfg.context_limit  # dynamic NTK stretches past the trained length
        self.max_model_len = min(max_model_len or limit, limit)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        # A recurrent layer's state (or a sliding layer's ring) cannot be rebuilt from cached KV
        # blocks: a model with such layers keeps state checkpoints at block boundaries beside them
        # (workers/state_checkpoints.py)
        self.checkpoints: CheckpointIndex | None = None
        if cfg.slot_state_layers and prefix_cache:
            n = state_checkpoints(num_slots, state_checkpoint_count)
            self.checkpoints = CheckpointIndex(n) if n else None
        self.prefix_cache = prefix_cache and (not cfg.slot_state_layers or self.checkpoints is not None)
        self.blocks = BlockManager(num_blocks, block_size, enable_cache=self.prefix_cache)
        # a model that only embeds (BERT): bidirectional attention, a prompt is never split
        self.embed_only = bool(getattr(self.model, "embed_only", False))
        self.scheduler = Scheduler(
            self.blocks,
            num_slots,
            prefill_chunk,
            self.max_model_len,
            self.checkpoints,
            whole_prompts=self.embed_only,
        )
        # Prefill per step: at most prefill_chunk, fewer when measured steps would outgrow the
        # target (a slow CPU, a big model), so decoding streams keep flowing past long prompts.
        self.budget = StepBudget(
            target_s=step_target_s, ceiling=prefill_chunk, crossover=_attention_crossover(cfg)
        )
        self.runner: ModelRunner = ModelRunner(
            self.model,
            cfg,
            self.blocks,
            dt,
            num_slots,
            self.checkpoints.capacity if self.checkpoints else 0,
            kv_types,
        )
        # The decode step compiles in the background while this engine serves eager (on unless
        # PANTHEON_COMPILE=0; workers/compiled.py); the runner switches once it is checked
        layout = {
            "cpu_path": self.cpu_path,
            "dtype": dt,
            "slots": num_slots,
            "blocks": num_blocks,
            "bs": block_size,
        }
        self.compiler: compiled.CompiledDecode | compiled.NotCompiled | DecodeGraphs = compiled.start(
            self.runner, model_path, layout, compile_decode
        )
        # Speculation (workers/speculation.py) needs rows that can be taken back (paged K/V, or
        # a recurrent state kept per verify row): no sliding ring, no length-dependent RoPE.
        self.spec_supported = cfg.can_speculate and not self.embed_only
        # recurrent layers keep each verify row's state: the engine keeps the accepted one
        self.recurrent = bool(cfg.recurrent_layers)
        self.spec = SpecStats()
        self.spec_default = max(0, speculative)  # drafts per step for requests that do not say
        self.draft: DraftModel | MtpDraft | None = None
        self.draft_name = ""
        if draft_cfg is not None:
            assert draft is not None
            if not self.spec_supported:
                raise LoadError("invalid", f"{model_path} cannot speculate: it takes no draft model")
        if draft == MTP:
            assert draft_cfg is not None
            head = load_head(
                model_path, cfg, draft_cfg, self.model, self.devices[0], dt, self.cpu_path, quantize
            )
            self.draft = MtpDraft(head, draft_cfg, self.blocks, dt, num_slots, kv_types)
            self.draft_name = MTP
        elif draft_cfg is not None:
            assert draft is not None
            self.draft = DraftModel(
                draft,
                draft_cfg,
                self.blocks,
                self.devices[0],
                layout=draft_path,
                quantize=quantize,
                num_slots=num_slots,
                target_vocab=cfg.vocab_size,
                catch_up=prefill_chunk,
                kv_types=kv_types,
            )
            self.draft_name = draft
        # A CUDA die replays its pure decode steps as graphs (workers/cuda_graphs.py), captured
        # now: on unless PANTHEON_CUDA_GRAPHS=0 or ``cuda_graphs`` says; True on a CPU die runs
        # the same static-buffer step eagerly (what the tests check)
        if _graphs_wanted(cuda_graphs, self.devices[0]) and not self.embed_only:
            got = (
                "a draft model reads each step's hidden states"
                if self.draft is not None
                else self.runner.capture_graphs(self.max_model_len)
            )
            self.compiler.close()
            self.compiler = compiled.NotCompiled(f"decode graphs: {got}") if isinstance(got, str) else got
        self.weight_bytes = weight_bytes(self.model)
        # Bytes one decode step streams: everything but the embedding table, of which a step
        # reads only a few rows (unless the head is the table itself, untied and unpacked).
        emb = self.model.embed_tokens.weight
        head_is_table = self.model.lm_head is None
        self.step_read_bytes = self.weight_bytes - (0 if head_is_table else emb.numel() * emb.element_size())
        # ... and of a mixture of experts' stacked experts, the top k one sequence's token chose
        self.step_read_bytes -= unread_expert_bytes(self.model)
        self.kv_bytes = self.runner.kv_bytes
        if self.draft is not None:  # booked with the instance: its own weights and its KV pool
            self.weight_bytes += self.draft.weight_bytes
            self.kv_bytes += self.draft.kv_bytes
        self.state_bytes = self.runner.state_bytes  # the recurrent layers' state pools
        self._samplers: dict[str, SamplerState] = {}
        self._constraints: dict[str, Constraint] = {}  # request id -> its grammar, if any
        # request id -> its prompt logprobs so far, until its first token carries them
        self._prompt_lps: dict[str, PromptLogprobsAcc] = {}
        self._embeds: dict[str, Pooled] = {}  # embedding request id -> its pooling so far
        self.embedded: list[EmbedOut] = []  # finished embeddings, taken by take_embedded()
        self.grammars = Grammars(model_path, cfg.vocab_size, self.eos_token_ids)
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
        return self.scheduler.schedule(lambda context: self.budget.tokens(decoding, context))

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


def _graphs_wanted(asked: bool | None, device: torch.device) -> bool:
    """Decode graphs: as ``asked``, else on a CUDA die unless ``PANTHEON_CUDA_GRAPHS`` says 0."""
    if asked is not None:
        return asked
    off = os.environ.get("PANTHEON_CUDA_GRAPHS", "").strip().lower() in ("0", "false", "off", "no")
    return device.type == "cuda" and not off


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
