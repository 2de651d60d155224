"""The model's own multi-token-prediction head as its draft (``draft = "mtp"``): Qwen3.5's
``mtp.*``, run as vLLM's ``mtp`` method runs it.

The head is one more decoder layer, fed at position ``p`` the target's final hidden state there
and the embedding of the token after it, to predict the token after that:

    x_p  = fc( [ norm_e(embed(t[p+1])) ; norm_h(h[p]) ] )     fc: [H, 2H], no bias
    y_p  = norm( layer(x_p) )                                  one full-attention layer, own K/V
    t[p+2] ~ argmax lm_head(y_p)                              the target's embeddings and head

So for a sequence of ``L`` tokens (``t[L-1]`` pending: the target has not run it), the head's
row ``L-2`` (the target's hidden state at ``L-2``, the pending token's embedding) proposes
``d0`` = ``t[L]``, and each further draft feeds the head its own last output in place of the
target's hidden state (which does not exist yet): row ``L-1`` takes ``d0`` and ``y[L-2]`` and
proposes ``d1``, and so on, ``k`` rows for ``k`` drafts.

The target's hidden states come from its steps (``observe``: the rows each step computed, kept
per speculating sequence until the head has run them; a verify's rows only as far as they were
accepted). The head's rows before ``L-1`` are always computed from the target's states
(``Sequence.draft_computed`` counts them); its drafting rows, fed its own outputs, are rewritten
by the next catch-up, which runs every target row the last step kept (one row after a plain
decode step, 1 + accepted after a verify, a whole prompt after its prefill).

Its K/V pool is addressed by the target's block tables, as a draft model's
(``workers/draft.py``), one layer's rows a block. A sequence that starts on a prefix-cache hit
has no target states for the cached positions: the head's rows there are whatever the pool
holds (rows of the sequence that filed those blocks, when it speculated too), which changes
what it proposes, never what is emitted (every draft is verified).

Checked at load: the checkpoint has a head (``mtp_num_hidden_layers``), read from its safetensors
(``mtp.*``) or from a GGUF file (llama.cpp's converter writes it as the block after the model's,
its own tensors ``nextn.*``); only its first layer is used (Qwen3.5 has one). Its linears take
the target's CPU path.
"""

from __future__ import annotations

import torch
from torch import nn

from pantheon.core.description import ModelDescription, mtp_description
from pantheon.core.kv_types import KvCacheTypes
from workers import cpu_paths
from workers.block_manager import BlockManager
from workers.cache import LayerCache
from workers.cpu_pack import weight_bytes
from workers.errors import LoadError
from workers.layers.attention import StepBatch
from workers.loader import NoInit, load_part
from workers.models import Target, family
from workers.models.base import DecoderLM
from workers.runner import ModelRunner
from workers.scheduler import Sequence, StepPlan


class MtpHead(DecoderLM):
    """The head as a one-layer model the runner runs: ``hidden_in`` (the states it is fed, one
    per input row, in the step's row order) is set before each run."""

    def __init__(self, inner: DecoderLM, target: DecoderLM, hidden: int, eps: float):
        nn.Module.__init__(self)  # not DecoderLM's: the embeddings and head are the target's
        self.embed_tokens = target.embed_tokens
        self.layers = inner.layers  # one full-attention layer
        self.norm = inner.norm
        self.lm_head = None  # the target's, set once the head's own weights are in
        norm = type(inner.norm)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm(hidden, eps)
        self.pre_fc_norm_hidden = norm(hidden, eps)
        self.layer_devices: list[torch.device] = []
        self.hidden_in: torch.Tensor | None = None
        # the LM head the drafts are picked with, when not the model's own: a 4-bit copy
        # (``draft_head``), a few times faster than a bf16 head over a large vocabulary
        self.draft_head: nn.Module | None = None

    def own(self) -> list[nn.Module]:
        """The modules whose weights are the head's (not the target's)."""
        mods = [self.layers[0], self.norm, self.fc, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden]
        return mods + ([self.draft_head] if self.draft_head is not None else [])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] -> [M, vocab] fp32, through the draft's own head if it has one."""
        if self.draft_head is not None:
            return self.draft_head(hidden).float()
        return super().logits(hidden)

    def forward(
        self, input_ids: torch.Tensor, batches: dict[torch.device, StepBatch], caches: list[LayerCache]
    ) -> torch.Tensor:
        """input_ids: [N] (row p: the token at p + 1), ``hidden_in``: [N, hidden] -> [N, hidden]."""
        h_in = self.hidden_in
        assert h_in is not None and h_in.shape[0] == input_ids.shape[0], "hidden_in: one row per input row"
        e = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))  # [N, H]
        x = self.fc(torch.cat((e, self.pre_fc_norm_hidden(h_in.to(e.dtype))), dim=-1))  # [N, H]
        x = self.layers[0](x, batches[self.layer_devices[0]], caches[0])
        return self.norm(x)


def head_description(model_path: str, cfg: ModelDescription) -> ModelDescription:
    """The checkpoint's head as its one-layer description (``mtp_description``), checked before
    any weight is read: ``LoadError`` when the checkpoint has none."""
    one = mtp_description(cfg)
    if one is None:
        raise LoadError(
            "invalid", f"{model_path} has no multi-token-prediction head (mtp.*): it cannot draft with 'mtp'"
        )
    return one


def load_head(
    model_path: str, cfg: ModelDescription, one: ModelDescription, target: DecoderLM, device: torch.device,
    dtype: torch.dtype, cpu_path: str | None, quantize: bool,
) -> MtpHead:  # fmt: skip
    """The checkpoint's head (``one``: its ``head_description``), on ``device`` in ``dtype``, its
    linears laid out as the target's (``cpu_path``; on CUDA int8 when ``quantize``)."""
    fam = family(cfg)
    with torch.device("meta"), NoInit():
        head = MtpHead(fam.build(one), target, cfg.hidden_size, cfg.rms_norm_eps)
    for m in head.own():
        m.to(dtype)
        m.to_empty(device=device)
    head.layer_devices = [device]
    # the family's names for its one layer and final norm, as the checkpoint's mtp.* names
    ours = {
        n: t for n, t in fam.targets(head, one).items() if n.startswith(("model.layers.0.", "model.norm."))
    }
    targets: dict[str, Target] = {
        **ours,
        "mtp.fc.weight": Target(head.fc.weight, 0, cfg.hidden_size),
        "mtp.pre_fc_norm_embedding.weight": Target(_weight(head.pre_fc_norm_embedding), 0, cfg.hidden_size),
        "mtp.pre_fc_norm_hidden.weight": Target(_weight(head.pre_fc_norm_hidden), 0, cfg.hidden_size),
    }
    n = cfg.num_layers  # llama.cpp's converter writes the head as block n (its nextn tensors too)
    load_part(model_path, cfg, targets, _rename, lambda name: _gguf_rename(name, n))
    head.eval()
    if cpu_path is not None:
        # once, over the whole head: its layer (its experts too) and the fc; a second pass over the
        # layer would lay its experts out again from stacks already let go (a packed path's)
        cpu_paths.lay_out(head, cpu_path, cfg)
    elif quantize:
        from workers.quant import quantize_int8

        quantize_int8(head)
    head.lm_head = target.lm_head  # None: tied to the (shared) embedding table
    head.draft_head = draft_head(target, cfg, cpu_path)
    return head


def draft_head(target: DecoderLM, cfg: ModelDescription, cpu_path: str | None) -> nn.Module | None:
    """A 4-bit copy of the model's LM head for picking drafts (``cpu_paths``' int4 layout; int8
    rows for a shape it does not take), on the CPU paths that compute in bf16 (the fp32 ones are
    the exact ones: their drafts are the reference's), when the head's dense weight is at hand
    (tied to the embedding table, or an untied head left plain). Each draft pass runs the head
    over the whole vocabulary: on Qwen3.5-0.8B's 248k x 1024 that is 19.7 ms in bf16 and 4.8 ms
    in 4 bits a pass on a 2-core Xeon, against 83 ms for the model's step. The draft's argmax may
    differ from the full head's where two logits are close: it changes what is proposed, never
    what is emitted (every draft is verified against the model's own head)."""
    if cpu_path is None or cpu_paths.PATHS[cpu_path].dtype != torch.bfloat16:
        return None
    if cfg.tie_word_embeddings or target.lm_head is None:  # (a tied head's laid-out copy aside)
        weight = target.embed_table()
    elif isinstance(target.lm_head, nn.Linear):
        weight = target.lm_head.weight
    else:  # an untied head laid out already: its dense weight is gone
        return None
    return cpu_paths.make_linear(cpu_paths.PATHS["int4"], weight, None)


def _weight(norm: nn.Module) -> torch.Tensor:
    w = norm.weight
    assert isinstance(w, torch.Tensor)  # a norm's weight
    return w


# llama.cpp's names of the head's own tensors (``blk.N.nextn.*``) -> the checkpoint's
_NEXTN = {
    "eh_proj.weight": "mtp.fc.weight",
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "shared_head_norm.weight": "model.norm.weight",
}


def _gguf_rename(name: str, n: int) -> str | None:
    """A GGUF tensor's family name (``model.layers.N.*`` for block ``n``'s layer tensors,
    ``mtp.blk.N.nextn.*`` for its own) as ``load_head``'s targets name it; None: not the head's."""
    layer, nextn = f"model.layers.{n}.", f"mtp.blk.{n}.nextn."
    if name.startswith(layer):
        return "model.layers.0." + name[len(layer) :]
    if name.startswith(nextn):
        return _NEXTN.get(name[len(nextn) :])
    return None


def _rename(name: str) -> str | None:
    """A checkpoint tensor's name as ``load_head``'s targets name it; None: not the head's."""
    if name.startswith("mtp.layers.0."):
        return "model.layers.0." + name[len("mtp.layers.0.") :]
    if name == "mtp.norm.weight":
        return "model.norm.weight"
    return name if name.startswith("mtp.") else None


class MtpDraft:
    """The head, its runner and K/V pool (addressed by the target's block tables), and the
    target's hidden states each speculating sequence has not fed it yet."""

    def __init__(
        self,
        head: MtpHead,
        one: ModelDescription,
        blocks: BlockManager,
        dtype: torch.dtype,
        num_slots: int,
        kv_types: KvCacheTypes = KvCacheTypes(),
    ):
        self.model: MtpHead = head
        self.blocks = blocks
        self.runner: ModelRunner = ModelRunner(head, one, blocks, dtype, num_slots, 0, kv_types)
        self.vocab = one.vocab_size
        self.context_limit = one.context_limit
        self.forwards = 0  # head passes run since load (catch-ups and drafting steps)
        self.caught_up = 0  # rows the catch-ups computed since load
        # request id -> (first position, the target's final hidden states from there [n, H]):
        # what the next catch-up feeds the head (its last row is kept after it, to draft from
        # again when the target computed nothing new in between)
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    @property
    def weight_bytes(self) -> int:
        """The head's own weights (its embeddings and LM head are the target's)."""
        return sum(weight_bytes(m) for m in self.model.own())

    @staticmethod
    def fed_rows(plan: StepPlan) -> list[tuple[Sequence, int, int]]:
        """Each speculating sequence of the model's step ``plan`` (read before the step commits),
        the first position it computes and its first row in the step's hidden states (plain
        decode rows, verify rows, then each prefill chunk's)."""
        rows: list[tuple[Sequence, int, int]] = []
        at = 0
        for s in plan.decode:
            if s.spec_tokens:
                rows.append((s, s.num_computed, at))
            at += 1
        for s in plan.verify:
            if s.spec_tokens:
                rows.append((s, s.num_computed, at))
            at += 1 + len(s.draft)
        for s, n in plan.prefill:
            if s.spec_tokens and s.embed is None:
                rows.append((s, s.num_computed, at))
            at += n
        return rows

    def feed(self, fed: list[tuple[Sequence, int, int]], hidden: torch.Tensor | None) -> None:
        """After the model's step (``fed_rows``): the model's final hidden states ``hidden``
        ([rows, H]) of the rows each sequence kept (a verify's: as far as it was accepted); a
        finished sequence's are dropped."""
        assert hidden is not None  # (a model the head drafts for never runs the compiled step)
        for s, p0, at in fed:
            if s.finish is not None:
                self.forget(s.request_id)
            elif s.num_computed > p0:
                self.observe(s, p0, hidden[at : at + s.num_computed - p0])

    def observe(self, s: Sequence, p0: int, rows: torch.Tensor) -> None:
        """The target computed positions ``p0 ..`` of ``s`` (kept: a verify's accepted rows);
        ``rows``: their final hidden states [n, H]."""
        have = self._hidden.get(s.request_id)
        if have is not None and have[0] + have[1].shape[0] == p0:
            self._hidden[s.request_id] = (have[0], torch.cat((have[1], rows)))
        else:  # the first rows, or rows recomputed (a preempted sequence)
            self._hidden[s.request_id] = (p0, rows.clone())
            s.draft_computed = min(s.draft_computed, p0)

    def forget(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.draft`` to at most ``k`` proposed tokens for each (sequence, k), batched:
        one catch-up pass (the target rows not yet fed, ending on the pending token's
        predecessor: its output gives d0), then ``k - 1`` drafting passes. A sequence with no
        target states yet, or whose verify rows find no free blocks, gets no draft."""
        go: list[tuple[Sequence, int, torch.Tensor]] = []  # (sequence, k, the states to feed)
        for s, k in wants:
            s.draft = []
            have = self._hidden.get(s.request_id)
            n_tok = len(s.tokens)
            if have is None or k < 1 or n_tok + k > self.context_limit:
                continue
            start, rows = have
            if start + rows.shape[0] != n_tok - 1:  # states up to the pending token's predecessor
                continue
            c = min(max(s.draft_computed, start), n_tok - 2)  # the first row to (re)compute
            if not self.blocks.ensure(s.block_table, s.num_computed + 1 + k):
                continue
            go.append((s, k, rows[c - start :]))
            s.draft_computed = c
        if not go:
            return
        # Catch-up: rows draft_computed .. L-2 of each; a one-row gap is a decode row, the others
        # prefill chunks (the runner's row order: decode rows, then each chunk).
        shadows = [_shadow(s) for s, _k, _h in go]
        one = [i for i, (_s, _k, h) in enumerate(go) if h.shape[0] == 1]
        many = [i for i, (_s, _k, h) in enumerate(go) if h.shape[0] > 1]
        order = one + many
        self.model.hidden_in = torch.cat([go[i][2] for i in order])
        plan = StepPlan(
            decode=[shadows[i] for i in one], prefill=[(shadows[i], go[i][2].shape[0]) for i in many]
        )
        picks = self._argmax(self.runner.run(plan))
        out = self._last_rows(plan)  # [G, H]: each sequence's last output, in ``order``
        self.forwards += 1
        self.caught_up += sum(h.shape[0] for _s, _k, h in go)
        live: list[tuple[Sequence, Sequence, int, torch.Tensor]] = []
        for j, i in enumerate(order):
            s, k, _h = go[i]
            sh = shadows[i]
            n_tok = len(s.tokens)
            start, rows = self._hidden[s.request_id]
            self._hidden[s.request_id] = (n_tok - 2, rows[-1:])  # fed; the last kept to draft again
            s.draft_computed = n_tok - 1
            s.draft = [picks[j]]
            sh.tokens = s.tokens[1:] + [picks[j]]  # shifted: row p takes the token at p + 1
            sh.num_computed = n_tok - 1
            live.append((s, sh, k, out[j : j + 1]))
        # Drafting: each sequence feeds its newest draft and the head's own last output.
        while live := [x for x in live if len(x[0].draft) < x[2]]:
            self.model.hidden_in = torch.cat([h for _s, _sh, _k, h in live])
            plan = StepPlan(decode=[sh for _s, sh, _k, _h in live], prefill=[])
            picks = self._argmax(self.runner.run(plan))
            hidden = self.runner.last_hidden
            assert hidden is not None
            self.forwards += 1
            for j, (s, sh, _k, _h) in enumerate(live):
                s.draft.append(picks[j])
                sh.tokens.append(picks[j])
                sh.num_computed += 1
            live = [(s, sh, k, hidden[j : j + 1]) for j, (s, sh, k, _h) in enumerate(live)]
        self.model.hidden_in = None

    def _last_rows(self, plan: StepPlan) -> torch.Tensor:
        """The last pass's output row of each sequence of ``plan`` (decode rows, then each
        chunk's last row): [G, H]."""
        hidden = self.runner.last_hidden
        assert hidden is not None
        rows = list(range(len(plan.decode)))
        at = len(plan.decode)
        for _s, n in plan.prefill:
            at += n
            rows.append(at - 1)
        return hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        """logits: [B, vocab] fp32 -> each row's most likely token."""
        return logits[:, : self.vocab].argmax(dim=-1).tolist()

    def close(self) -> None:
        self.runner = None  # pyright: ignore[reportAttributeAccessIssue]  # dropped for good
        self.model = None  # pyright: ignore[reportAttributeAccessIssue]
        self._hidden.clear()


def _shadow(s: Sequence) -> Sequence:
    """The view of ``s`` the head's runner computes: its tokens shifted by one (row ``p`` takes
    the token at ``p + 1``), its block table and slot, positions from ``draft_computed`` on."""
    return Sequence(
        request_id=s.request_id,
        prompt_len=s.prompt_len,
        tokens=s.tokens[1:],
        max_tokens=s.max_tokens,
        num_computed=s.draft_computed,
        block_table=s.block_table,
        slot=s.slot,
        use_cache=False,
    )
