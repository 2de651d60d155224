"""How an engine is assembled from its ``EngineSpec`` (``pantheon/core/engine_spec.py``), in the
order the steps must run, each a named function ``Engine.__init__`` calls:

1. ``plan``: everything decided before a weight is read, so that a load that cannot succeed
   fails in milliseconds: the model's description, the KV cache types it can hold, a draft
   model's (or the model's own MTP head's) checks, the CPU path (forced, or timed on this model's
   shapes), the compute dtype, and the block budget (one block's bytes over the target's pool
   and the draft's, and how many blocks the budget holds);
2. ``load_weights``: the model's weights, laid out for the CPU path (or int8 elsewhere);
3. ``checkpoint_index``: a hybrid model's prefix-cache state checkpoints;
4. ``make_draft``: the draft model, or the model's own head, on the engine's block tables;
5. ``decode_graphs``: the pure decode step captured as CUDA graphs (replacing the background
   compile the runner started), or why not;
6. ``byte_account``: the bytes the instance holds and the bytes one decode step streams.

The engine's run-time state (block manager, scheduler, step budget, runner) is built by
``Engine.__init__`` itself between steps 3 and 4, from the plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import torch

from pantheon.core.description import MTP
from pantheon.core.engine_spec import EngineSpec
from pantheon.core.gguf import GGUFFile
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.sizing import state_checkpoints
from workers import compiled, cpu_paths
from workers.block_manager import BlockManager
from workers.cache import check_kv_types, kv_block_bytes
from workers.cpu_pack import weight_bytes
from workers.cuda_graphs import DecodeGraphs
from workers.draft import DraftModel, draft_block_bytes, draft_layout, load_draft_config
from workers.errors import LoadError
from workers.layers.moe import unread_expert_bytes
from workers.loader import load_model, resolve_dtype
from workers.model_config import ModelConfig, read_model
from workers.models.base import DecoderLM
from workers.mtp import MtpDraft, head_description, load_head
from workers.runner import ModelRunner
from workers.state_checkpoints import CheckpointIndex

EMBED_BATCH = 64  # whole inputs an encoder (BERT) runs in one step, at most

Compiler = compiled.CompiledDecode | compiled.NotCompiled | DecodeGraphs


@dataclass
class Plan:
    """What ``plan`` decided before any weight was read."""

    spec: EngineSpec
    cfg: ModelConfig
    devices: list[torch.device]
    kv_types: KvCacheTypes
    cpu: cpu_paths.Choice | None  # a CPU die's path (None elsewhere)
    dtype_name: str  # the dtype the weights load in (the CPU path's, else the spec's)
    dtype: torch.dtype
    draft_cfg: ModelConfig | None  # a draft model's description, or the MTP head's one-layer one
    draft_path: tuple[str | None, str]  # the draft's CPU path and dtype
    block_bytes: int  # one block over every paged pool (the target's and the draft's)
    num_blocks: int
    num_slots: int  # the spec's, or EMBED_BATCH for an encoder
    encoder: bool  # an encoder that only embeds (BERT): no KV rows, nothing kept per slot
    max_model_len: int
    gguf: GGUFFile | None = None  # a GGUF model's parsed header (the load reads its tensors' places)

    @property
    def cpu_path(self) -> str | None:
        return None if self.cpu is None else self.cpu.name

    @property
    def cpu_timings(self) -> dict[str, tuple[float, float]]:
        """Each CPU path's seconds per step at 1 row and at 8 (empty: forced, or not a CPU die)."""
        return {} if self.cpu is None else self.cpu.timings

    @property
    def cpu_note(self) -> str:
        """Why the CPU path is not the timings' verdict (disturbed timings, the static order kept)."""
        return "" if self.cpu is None else self.cpu.note


def spec_of(path: str, fields: Mapping[str, object]) -> EngineSpec:
    """``EngineSpec(path=path, **fields)``, each value checked as a load message's is
    (``LoadError`` naming a field that is not the spec's, or a value of the wrong type)."""
    unknown = sorted(set(fields) - set(EngineSpec.__struct_fields__))
    if unknown:
        raise LoadError("invalid", f"not an engine spec field: {', '.join(unknown)}")
    try:
        return msgspec.convert({"path": path, **fields}, EngineSpec)
    except msgspec.ValidationError as e:
        raise LoadError("invalid", f"engine spec: {e}") from None


def plan(spec: EngineSpec) -> Plan:
    """Decide the engine's layout from ``spec`` and the model's description (``LoadError``
    for a spec or a model this engine cannot serve)."""
    if spec.num_slots < 1 or spec.prefill_chunk < 1 or spec.block_size < 1:
        raise LoadError("invalid", "num_slots, prefill_chunk and block_size must be at least 1")
    devices = [torch.device(d) for d in spec.devices or ["cpu"]]
    cfg, gguf = read_model(spec.path)  # fail fast on config errors before touching weights
    try:  # a KV cache type this model's heads or these devices cannot hold: refused before the weights
        kv_types = spec.kv_types
        check_kv_types(cfg, kv_types, devices)
    except ValueError as e:
        raise LoadError("invalid", str(e)) from None
    draft_cfg = _draft_config(spec, cfg, kv_types, devices[0])
    cpu = _cpu_path(spec, cfg) if devices[0].type == "cpu" else None
    dtype_name = spec.dtype if cpu is None else cpu_paths.DTYPE_NAMES[cpu_paths.PATHS[cpu.name].dtype]
    dtype = resolve_dtype(dtype_name, cfg, devices[0])
    # the bytes the KV rows really take as stored (quantized types: their blocks and scales)
    block_bytes = kv_block_bytes(cfg, spec.block_size, dtype, kv_types)
    draft_path: tuple[str | None, str] = (None, spec.dtype)
    if spec.draft == MTP:
        draft_path = (None if cpu is None else cpu.name, dtype_name)  # the head is laid out as the model
    elif draft_cfg is not None:
        # The draft's pool has as many blocks as the target's (one block table addresses
        # both): the budget (the router booked both pools in it) is shared by their block sizes.
        draft_path = draft_layout(
            draft_cfg, devices[0], spec.dtype, None if cpu is None else cpu.name, spec.quantize
        )
    if draft_cfg is not None:
        block_bytes += draft_block_bytes(draft_cfg, spec.block_size, draft_path[1], devices[0], kv_types)
    # An encoder that only embeds (BERT: no KV rows, nothing kept per slot) runs a batch of up
    # to EMBED_BATCH whole inputs a step, as sentence-transformers' encode does: its slots and
    # block tables are bookkeeping, and 8 inputs a step left most of a batch waiting
    encoder = not cfg.can_generate and not block_bytes
    num_slots = max(spec.num_slots, EMBED_BATCH) if encoder else spec.num_slots
    limit = cfg.context_limit  # dynamic NTK stretches past the trained length
    max_model_len = min(spec.max_model_len or limit, limit)
    return Plan(
        spec, cfg, devices, kv_types, cpu, dtype_name, dtype, draft_cfg, draft_path, block_bytes,
        _num_blocks(spec, block_bytes, num_slots, max_model_len), num_slots, encoder, max_model_len, gguf,
    )  # fmt: skip


def _draft_config(
    spec: EngineSpec, cfg: ModelConfig, kv_types: KvCacheTypes, device: torch.device
) -> ModelConfig | None:
    """A draft model (workers/draft.py) checked before either model's weights are read: its
    tokenizer, its layers, and whether this model can verify drafts at all."""
    if spec.draft is None:
        return None
    if not cfg.can_speculate:
        raise LoadError(
            "invalid",
            f"{spec.path} cannot speculate (sliding-window layers, or dynamic RoPE): it takes no draft model",
        )
    if spec.draft == MTP:  # the model's own head (workers/mtp.py)
        return head_description(spec.path, cfg)
    return load_draft_config(spec.draft, spec.path, kv_types, [device])


def _cpu_path(spec: EngineSpec, cfg: ModelConfig) -> cpu_paths.Choice:
    """On a CPU die the path (kernel layout and compute dtype) is chosen before the weights are
    read: forced by ``cpu_path`` / PANTHEON_CPU_PATH, else timed on this model's shapes (the
    choice's note: disturbed timings discarded, or the static order kept)."""
    forced = spec.cpu_path if spec.cpu_path not in (None, cpu_paths.AUTO) else cpu_paths.forced_path()
    names = cpu_paths.candidates(
        quantize=spec.quantize,
        dtype=spec.dtype,
        forced=forced,
        quantized_source=cfg.quantized_source,
        int4_source=cfg.int4_source,
    )
    return cpu_paths.choose(cfg, names)


def _num_blocks(spec: EngineSpec, block_bytes: int, num_slots: int, max_model_len: int) -> int:
    """The blocks the KV budget holds (``LoadError`` below 2)."""
    if block_bytes:
        num_blocks = spec.kv_budget_bytes // block_bytes
    else:
        # No paged layer (every layer slides, each in its ring): the block tables are only
        # the scheduler's and the prefix cache's bookkeeping, and cost no memory.
        num_blocks = (num_slots + 1) * -(-max_model_len // spec.block_size)
    if num_blocks < 2:
        raise LoadError(
            "out_of_memory",
            f"KV budget of {spec.kv_budget_bytes} bytes holds fewer than 2 blocks "
            f"of {spec.block_size} tokens ({block_bytes} bytes each)",
        )
    return num_blocks


def load_weights(p: Plan, progress: Callable[[int, int], None] | None) -> DecoderLM:
    """The model's weights in the plan's dtype, laid out for its CPU path (int8 elsewhere when
    the spec quantizes)."""
    laid: set[int] = set()  # layers the CPU path laid out while the load went on

    def lay_out(i: int, layer: torch.nn.Module) -> None:
        if p.cpu is not None and all(t.device.type == "cpu" for t in layer.parameters()):
            cpu_paths.lay_out(layer, p.cpu.name, p.cfg)
            laid.add(i)

    on_layer = lay_out if p.cpu is not None else None
    blocks = cpu_paths.lays_out_head(p.cpu_path)  # (workers/layers/block_embedding.py)
    experts = None if p.cpu is None else cpu_paths.quantized_experts(p.cpu.name, p.cfg)
    model, _cfg = load_model(
        p.spec.path,
        p.spec.devices or ["cpu"],
        p.dtype_name,
        progress,
        p.cfg,
        on_layer,
        embed_blocks=blocks,
        experts=experts,
        gguf=p.gguf,
    )
    if p.cpu is not None:
        cpu_paths.apply(model, p.cpu.name, p.cfg, laid)
        if getattr(model, "embed_only", False):
            model.lm_head = None  # a model that only embeds is never asked for logits
    elif p.spec.quantize:
        from workers.quant import quantize_int8

        quantize_int8(model)
    return model


def checkpoint_index(p: Plan) -> CheckpointIndex | None:
    """A recurrent layer's state (or a sliding layer's ring) cannot be rebuilt from cached KV
    blocks: a model with such layers keeps state checkpoints at block boundaries beside them
    (workers/state_checkpoints.py); None without such layers, a prefix cache, or checkpoints."""
    if not (p.cfg.slot_state_layers and p.spec.prefix_cache):
        return None
    n = state_checkpoints(p.num_slots, p.spec.state_checkpoints)
    return CheckpointIndex(n) if n else None


def make_draft(
    p: Plan, model: DecoderLM, blocks: BlockManager, can_verify: bool
) -> tuple[DraftModel | MtpDraft | None, str]:
    """The draft model (or the model's own MTP head) and its name ("" without one), on the
    engine's block tables; ``can_verify``: whether this engine verifies drafts at all."""
    spec, cfg, draft_cfg = p.spec, p.cfg, p.draft_cfg
    if draft_cfg is None or spec.draft is None:
        return None, ""
    if not can_verify:
        raise LoadError("invalid", f"{spec.path} cannot speculate: it takes no draft model")
    if spec.draft == MTP:
        head = load_head(spec.path, cfg, draft_cfg, model, p.devices[0], p.dtype, p.cpu_path, spec.quantize)
        return MtpDraft(head, draft_cfg, blocks, p.dtype, p.num_slots, p.kv_types), MTP
    draft = DraftModel(
        spec.draft,
        draft_cfg,
        blocks,
        p.devices[0],
        layout=p.draft_path,
        quantize=spec.quantize,
        num_slots=p.num_slots,
        target_vocab=cfg.vocab_size,
        catch_up=spec.prefill_chunk,
        kv_types=p.kv_types,
    )
    return draft, spec.draft


def start_compile(p: Plan, runner: ModelRunner) -> Compiler:
    """The decode step compiling in the background while the engine serves eager (on unless
    PANTHEON_COMPILE=0 or the spec says; workers/compiled.py); the runner switches once it is
    checked."""
    layout = {
        "cpu_path": p.cpu_path,
        "dtype": p.dtype,
        "slots": p.num_slots,
        "blocks": p.num_blocks,
        "bs": p.spec.block_size,
    }
    return compiled.start(runner, p.spec.path, layout, p.spec.compile_decode)


def decode_graphs(p: Plan, runner: ModelRunner, compiler: Compiler, has_draft: bool) -> Compiler:
    """A CUDA die replays its pure decode steps as graphs (workers/cuda_graphs.py), captured
    now, replacing ``compiler``: on unless PANTHEON_CUDA_GRAPHS=0 or the spec says; True on a
    CPU die runs the same static-buffer step eagerly (what the tests check). Else ``compiler``."""
    if not _graphs_wanted(p.spec.cuda_graphs, p.devices[0]):
        return compiler
    got = (
        "a draft model reads each step's hidden states"
        if has_draft
        else runner.capture_graphs(p.max_model_len)
    )
    compiler.close()
    return compiled.NotCompiled(f"decode graphs: {got}") if isinstance(got, str) else got


def _graphs_wanted(asked: bool | None, device: torch.device) -> bool:
    """Decode graphs: as ``asked``, else on a CUDA die unless ``PANTHEON_CUDA_GRAPHS`` says 0."""
    if asked is not None:
        return asked
    off = os.environ.get("PANTHEON_CUDA_GRAPHS", "").strip().lower() in ("0", "false", "off", "no")
    return device.type == "cuda" and not off


@dataclass
class Bytes:
    """What the instance holds, and what one decode step streams."""

    weight: int  # the model's weights (and a draft's)
    step_read: int  # the weights one decode step reads
    kv: int  # the paged pools (and a draft's)
    state: int  # the recurrent layers' state pools and rings


def byte_account(model: DecoderLM, runner: ModelRunner, draft: DraftModel | MtpDraft | None) -> Bytes:
    """The bytes the instance books (weights and KV pools, a draft's included) and the bytes one
    decode step streams: everything but the embedding table, of which a step reads only a few
    rows (unless the head is the table itself, untied and unpacked), and of a mixture of
    experts' stacked experts only the top k one sequence's token chose."""
    weights = weight_bytes(model)
    head_is_table = model.lm_head is None
    step_read = weights - (0 if head_is_table else model.embed_bytes())
    step_read -= unread_expert_bytes(model)
    kv = runner.kv_bytes
    if draft is not None:  # booked with the instance: its own weights and its KV pool
        weights += draft.weight_bytes
        kv += draft.kv_bytes
    return Bytes(weights, step_read, kv, runner.state_bytes)
