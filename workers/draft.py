"""A draft model for speculative decoding: a small model of the target's tokenizer proposes.

Loaded beside the target (``Engine(draft=PATH)``, the load's ``draft`` option) with the same
loader, on the target's first device, on the target's CPU path where the draft's files allow it.
What it proposes is verified exactly as prompt lookup's drafts are (``workers/speculation.py``):
a proposal is one token per position (greedy argmax of the draft), a one-hot draft
distribution, so ``sampler.verify`` keeps greedy output token for token and sampled output
distributed as the target's, whatever the draft says. The draft only changes how many tokens a
step emits.

Its KV pool has the target's block count and block size and is addressed by the same block
tables (``ModelRunner`` over the target's ``BlockManager``): a sequence's blocks hold its target
rows in the target's pool and its draft rows in this one, so allocation, prefix sharing,
preemption and freeing need no second bookkeeping. What the draft adds per sequence is how far
its rows are computed (``Sequence.draft_computed``) and which of them came from its own
proposals (``Sequence.draft_fed``), checked against the tokens the step really kept:

    tokens   t0 .. t(L-1)              L = len(tokens); t(L-1) pending (the target has not run it)
    catch-up rows draft_computed .. L-1  one prefill chunk of the draft (a decode row when one)
                                       -> argmax = d0
    k - 1 decode steps feed d0 .. d(k-2) at L .. L+k-2 -> d1 .. d(k-1)

After the verify the rows L .. L+k-2 stay valid as far as the drafts were accepted; the next
catch-up recomputes from there (typically the target's own token: one row). Rows past it are
overwritten later, as the target's rejected rows are. A preempted sequence
(``Scheduler._preempt``) starts its draft over with its recomputed target rows.

A prefix hit reuses the draft's rows too: the draft keeps, per block, the prefix-cache hash of
the full block whose rows it computed there (``_filled``; a rewrite by a proposal or a partial
rewrite drops it), so a new (or preempted) sequence starts its catch-up after the leading blocks
whose record is its own block's hash (same hash: same tokens from position 0, same rows).
A catch-up is at most ``catch_up`` rows per step over the sequences (the target's prefill chunk):
a sequence further behind (a new long prompt) catches up over several steps, decoding without
drafts meanwhile.

Refused at load (``LoadError``, the load fails as a whole): a draft whose tokenizer differs from
the target's (the whole vocabulary, id for id, from ``tokenizer.json`` or the GGUF metadata), a
draft with recurrent or sliding-window layers (its rows could not be taken back), and a target
that cannot speculate at all.
"""

from __future__ import annotations

import json

import torch

from pantheon.core.kv_types import KvCacheTypes
from workers import cpu_paths
from workers.block_manager import BlockManager
from workers.cache import check_kv_types, kv_block_bytes
from workers.cpu_pack import weight_bytes
from workers.errors import LoadError
from workers.grammar import model_tokenizer_json
from workers.loader import load_model, resolve_dtype
from workers.model_config import ModelConfig, load_config
from workers.models.base import DecoderLM
from workers.runner import ModelRunner
from workers.scheduler import Sequence, StepPlan


def vocabulary(model_path: str) -> dict[int, str]:
    """A model's tokens by id: its tokenizer's model vocabulary and added tokens."""
    try:
        tok = json.loads(model_tokenizer_json(model_path))
    except (OSError, ValueError) as e:
        raise LoadError("invalid", f"cannot read the tokenizer of {model_path}: {e}") from None
    # parsed JSON: a BPE / WordPiece dict (token -> id) or a Unigram list of [piece, score]
    vocab: dict[str, int] | list[list[object]] = (tok.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):  # BPE / WordPiece: token -> id
        out = {int(i): str(t) for t, i in vocab.items()}
    else:  # Unigram: [[piece, score], ...] in id order
        out = {i: str(entry[0]) for i, entry in enumerate(vocab)}
    for added in tok.get("added_tokens") or []:
        out[int(added["id"])] = str(added["content"])
    return out


def check_same_tokenizer(target: str, draft: str) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's (``LoadError``)."""
    a, b = vocabulary(target), vocabulary(draft)
    if a == b:
        return
    differ = sorted(i for i in a.keys() | b.keys() if a.get(i) != b.get(i))
    first = differ[0]
    raise LoadError(
        "invalid",
        f"draft {draft}: its tokenizer differs from the model's ({len(b)} tokens against {len(a)}; "
        f"{len(differ)} ids differ, first id {first}: {b.get(first)!r} against {a.get(first)!r}): "
        "a draft must share the model's tokenizer",
    )


def check_draft_config(cfg: ModelConfig, draft: str) -> None:
    """A draft's rows must be paged and rewindable, as the target's (``LoadError``)."""
    if not cfg.rewindable:
        kind = "sliding-window" if cfg.windows else "recurrent"  # a ring is a slot state too
        raise LoadError(
            "invalid",
            f"draft {draft}: it has {kind} layers, whose state cannot be taken back past rejected "
            "drafts; use a draft of full-attention layers only",
        )


class DraftModel:
    """The draft's weights, runner and KV pool (addressed by the target's block tables)."""

    def __init__(
        self,
        path: str,
        cfg: ModelConfig,
        blocks: BlockManager,
        device: torch.device,
        *,
        layout: tuple[str | None, str],
        quantize: bool,
        num_slots: int,
        target_vocab: int,
        catch_up: int = 512,
        kv_types: KvCacheTypes = KvCacheTypes(),
    ):
        self.path, self.cfg, self.blocks = path, cfg, blocks
        self.cpu_path, dtype = layout  # draft_layout's answer
        self.dtype = resolve_dtype(dtype, cfg, device)
        as_blocks = cpu_paths.lays_out_head(self.cpu_path)  # as engine_build.load_weights
        model, _ = load_model(path, [str(device)], dtype, None, cfg, embed_blocks=as_blocks)
        self.model: DecoderLM = model
        if getattr(self.model, "embed_only", False):
            raise LoadError("invalid", f"draft {path}: an embedding model cannot draft")
        if self.cpu_path is not None:
            cpu_paths.apply(self.model, self.cpu_path, cfg)
        elif quantize:
            from workers.quant import quantize_int8

            quantize_int8(self.model)
        self.runner: ModelRunner = ModelRunner(self.model, cfg, blocks, self.dtype, num_slots, 0, kv_types)
        # token ids past either vocabulary are never proposed (an embedding table padded further)
        self.vocab = min(cfg.vocab_size, target_vocab)
        self.context_limit = cfg.context_limit
        self.forwards = 0  # draft passes run since load (catch-ups and decode steps)
        self.caught_up = 0  # rows the catch-ups computed since load
        self.catch_up = catch_up  # the most rows one step catches up (the target's prefill chunk)
        # block -> the hash of the block whose draft rows it holds (full blocks the draft
        # computed from a sequence's own tokens): a prefix hit reuses them (``_cached_rows``)
        self._filled: dict[int, bytes] = {}

    @property
    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.draft`` to at most ``k`` proposed tokens for each (sequence, k), batched:
        one catch-up pass, then ``k - 1`` decode passes. A sequence whose verify rows find no
        free blocks (or past the draft's context) gets no draft and decodes as usual; one
        further behind than ``catch_up`` positions (a new long prompt) catches up that many and
        drafts from a later step."""
        go: list[tuple[Sequence, int]] = []
        behind: list[tuple[Sequence, int]] = []  # (sequence, rows to catch up), no draft this step
        budget = self.catch_up
        for s, k in wants:
            s.draft = []
            n = _valid_rows(s)
            if n < len(s.block_hashes) * self.blocks.block_size:  # a new or preempted sequence
                n = max(n, self._cached_rows(s))
            s.draft_computed, s.draft_fed = n, []
            # The draft writes rows up to L + k - 2 and the verify needs L - 1 .. L - 1 + k: both
            # in the blocks the verify takes (the scheduler only checks them again).
            if k < 1 or len(s.tokens) + k > self.context_limit:
                continue
            if not self.blocks.ensure(s.block_table, s.num_computed + 1 + k):
                continue
            gap = len(s.tokens) - n
            if gap > budget and gap > 1:
                if budget > 0:  # rows n .. n + budget - 1: all computed target positions
                    behind.append((s, budget))
                    self.caught_up += budget
                    budget = 0
                continue
            budget -= gap
            self.caught_up += gap
            go.append((s, k))
        if not go and not behind:
            return
        # Catch-up: rows draft_computed .. L-1, ending on the pending token, whose logits give d0.
        # A one-row gap (the usual one after a verify) is a decode row, the others prefill chunks
        # (a sequence behind: a chunk that stops short, which gives no logits row).
        shadows = [_shadow(s) for s, _k in go]
        one = [sh for sh, (s, _k) in zip(shadows, go) if len(s.tokens) - s.draft_computed == 1]
        chunks = [(sh, len(s.tokens) - s.draft_computed) for sh, (s, _k) in zip(shadows, go) if sh not in one]
        chunks += [(_shadow(s), n) for s, n in behind]
        firsts = self._argmax(self.runner.run(StepPlan(decode=one, prefill=chunks)))
        self.forwards += 1
        for s, n in behind:
            self._wrote(s, s.draft_computed, s.draft_computed + n)
            s.draft_computed += n
        order = one + [sh for sh, _n in chunks[: len(go) - len(one)]]  # the row order of the logits
        first = dict(zip(map(id, order), firsts))
        # Decode steps: each sequence feeds its newest draft until it has k; fewer each step.
        live: list[tuple[Sequence, Sequence, int]] = []
        for sh, (s, k) in zip(shadows, go):
            self._wrote(s, s.draft_computed, len(s.tokens))
            s.draft = [first[id(sh)]]
            s.draft_computed = len(s.tokens)
            sh.tokens = s.tokens + s.draft  # a copy: position L holds d0 now
            sh.num_computed = len(s.tokens)
            live.append((s, sh, k))
        while live := [(s, sh, k) for s, sh, k in live if len(s.draft) < k]:
            picks = self._argmax(self.runner.run(StepPlan(decode=[sh for _s, sh, _k in live], prefill=[])))
            self.forwards += 1
            for (s, sh, _k), t in zip(live, picks):
                self._wrote(s, s.draft_computed, s.draft_computed + 1, proposal=True)
                s.draft_fed.append(s.draft[-1])  # the row just written holds this proposal
                s.draft_computed += 1
                s.draft.append(t)
                sh.tokens.append(t)
                sh.num_computed += 1

    def _cached_rows(self, s: Sequence) -> int:
        """Leading positions of ``s`` whose draft rows a full block already holds: blocks whose
        record is the hash of ``s``'s block there (the same tokens from position 0 on), at most
        up to the pending token."""
        bs, n = self.blocks.block_size, 0
        for b, h in zip(s.block_table, s.block_hashes):
            if self._filled.get(b) != h:
                break
            n += bs
        return min(n, len(s.tokens) - 1)

    def _wrote(self, s: Sequence, p0: int, p1: int, proposal: bool = False) -> None:
        """The draft wrote rows ``p0 .. p1 - 1`` of ``s``: record each full block they complete
        from ``s``'s tokens (under its hash, when the prefix cache gave it one); forget the
        record of a block they only partly rewrote, or rewrote with a proposal."""
        bs = self.blocks.block_size
        for i in range(p0 // bs, -(-p1 // bs)):
            b = s.block_table[i]
            if not proposal and (i + 1) * bs <= p1 and i < len(s.block_hashes):
                self._filled[b] = s.block_hashes[i]
            else:
                self._filled.pop(b, None)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        """logits: [B, vocab] fp32 -> each row's most likely token within both vocabularies."""
        return logits[:, : self.vocab].argmax(dim=-1).tolist()

    def close(self) -> None:
        self.runner = None  # pyright: ignore[reportAttributeAccessIssue]  # dropped for good
        self.model = None  # pyright: ignore[reportAttributeAccessIssue]


def _valid_rows(s: Sequence) -> int:
    """How many leading positions of ``s`` hold draft rows computed from its tokens: the rows
    its proposals were fed at count only as far as the step kept those proposals. (A step keeps
    the accepted drafts plus one token, so the cap at the pending token alone gives the same
    answer today; the check keeps it right for any other way of keeping tokens.)"""
    n = s.draft_computed
    fed = s.draft_fed
    if fed:
        base = n - len(fed)
        kept = 0
        for want, got in zip(fed, s.tokens[base : base + len(fed)]):
            if want != got:
                break
            kept += 1
        n = base + kept
    # at most up to the pending token, which the catch-up always computes (its logits give d0)
    return min(n, len(s.tokens) - 1)


def _shadow(s: Sequence) -> Sequence:
    """The view of ``s`` the draft runner computes: its tokens and block table, positions from
    ``draft_computed`` on (the runner reads only tokens, positions, tables and the slot)."""
    return Sequence(
        request_id=s.request_id,
        prompt_len=s.prompt_len,
        tokens=s.tokens,  # read only by the catch-up; replaced by a copy before the drafts
        max_tokens=s.max_tokens,
        num_computed=s.draft_computed,
        block_table=s.block_table,
        slot=s.slot,
        use_cache=False,
    )


def draft_layout(
    cfg: ModelConfig, device: torch.device, dtype: str, cpu_path: str | None, quantize: bool
) -> tuple[str | None, str]:
    """The draft's CPU path (None off the CPU) and dtype: on a CPU die the target's path when the
    draft's files allow it, else the draft's first candidate (fewest bytes; a small draft is not
    worth timing the paths for)."""
    if device.type != "cpu":
        return None, dtype
    names = cpu_paths.candidates(
        quantize=quantize,
        dtype=dtype,
        quantized_source=cfg.quantized_source,
        int4_source=cfg.int4_source,
    )
    name = cpu_path if cpu_path in names else names[0]
    return name, cpu_paths.DTYPE_NAMES[cpu_paths.PATHS[name].dtype]


def draft_block_bytes(
    cfg: ModelConfig, block_size: int, dtype: str, device: torch.device, kv_types: KvCacheTypes
) -> int:
    """Bytes one block of the draft's KV pool takes (its layers' K and V at its dtype)."""
    return kv_block_bytes(cfg, block_size, resolve_dtype(dtype, cfg, device), kv_types)


def load_draft_config(
    path: str, target_path: str, kv_types: KvCacheTypes, devices: list[torch.device]
) -> ModelConfig:
    """The draft's description, checked before any weight is read: the same tokenizer as the
    target, only paged attention layers, KV cache types it can hold."""
    cfg = load_config(path)
    check_draft_config(cfg, path)
    check_same_tokenizer(target_path, path)
    try:
        check_kv_types(cfg, kv_types, devices)
    except ValueError as e:
        raise LoadError("invalid", f"draft {path}: {e}") from None
    return cfg
