"""A model's description: what the router sizes and the worker builds, read once per load.

Parsed from a Hugging Face ``config.json`` (plus ``generation_config.json`` for EOS ids) or from a
GGUF file's metadata (``pantheon.core.gguf.hf_config`` turns it into the same dict), by the
architecture family that claims it (``pantheon.core.archs``, the one list of architectures).
No torch here: the router imports it.

A description is the family's own frozen dataclass (``LlamaDescription``, ``Qwen35Description``)
on top of the fields every decoder has, plus one ``LayerSpec`` per decoder layer: the layer's
kind, the shapes of its linear matrices as the engine fuses them (what a CPU path lays out and
what sizing counts) and its **cache spec**:

- ``FullAttention(kv_heads, head_dim)``: paged K and V rows, bytes per token;
- ``SlidingWindow(kv_heads, head_dim, window)``: each query reads at most ``window`` positions
  (itself and the ``window - 1`` before it), as vLLM's ``SlidingWindowSpec``. Such a layer never
  needs more than its last ``window`` positions, so it keeps them in a ring of ``window`` rows per
  slot instead of the paged pool: a fixed size per running sequence, counted with the recurrent
  states (``state_bytes_per_slot``), not per token of context. The families build either through
  ``AttentionCache(kv_heads, head_dim, window)``;
- ``RecurrentState(tensors)``: a fixed-size state per running sequence (a slot), whatever the
  context length: a linear-attention layer's conv window and its recurrent matrix;
- ``SharedKV(layer)``: an attention layer that reads an earlier layer's K and V instead of its own
  (Gemma 4's KV sharing): it has no cache, so nothing is booked or allocated for it.

Each kind answers for itself (``CacheSpec``: paged or per slot, bytes per token and per slot, the
KV types it can hold, and which ``CacheMaker`` method builds its cache), so no caller asks which
kind a spec is.

A mixture-of-experts layer also names its routed experts (``ExpertSpec``: count, top k, expert
size): all of them are resident (sizing counts them), one token reads only its top k
(``active_params``).

Everything that sizes memory (the router's booking, the worker's pools, ``max_model_len``) works
from these specs, never from a formula for one architecture.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pantheon.core.embedding import (
    BASE_MODEL,
    EmbeddingError,
    EmbeddingSpec,
    gguf_embedding,
    read_sentence_transformers,
)
from pantheon.core.kv_types import KvCacheTypes, width_problem

if TYPE_CHECKING:
    from pantheon.core.gguf import GGUFFile

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ROPE_TYPES = {"default", "linear", "dynamic", "llama3", "yarn"}


class ModelError(Exception):
    """A model folder or file that cannot be described. ``kind``: not_found | unsupported | invalid
    (the router's and the worker's error kinds for a load)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


# ---------------------------------------------------------------- cache specs


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class CacheMaker(Protocol[T_co]):
    """What builds one layer's cache from its spec (``CacheSpec.make`` calls the method of its
    kind): the worker's tensors (``workers/cache.py``), kept out of this torch-free module."""

    def full(self, spec: FullAttention) -> T_co: ...

    def sliding(self, spec: SlidingWindow) -> T_co: ...

    def recurrent(self, spec: RecurrentState) -> T_co: ...

    def shared(self, spec: SharedKV) -> T_co: ...


class CacheSpec:
    """What a layer keeps between steps, and what that costs: the base every kind answers for
    (as vLLM v1's ``KVCacheSpec`` subclasses). Defaults: nothing paged, nothing per slot."""

    paged = False  # K/V rows in the paged pool, one per token of context (bytes_per_token)
    slot_state = False  # a fixed-size state per running sequence (bytes_per_slot), checkpointed
    owns_kv = False  # an attention layer with K and V of its own (not read from another layer)

    @property
    def sliding_window(self) -> int | None:
        """The positions a query reads back when the layer slides (None: all, or no attention)."""
        return None

    def bytes_per_token(self, dtype_bytes: int, kv_types: KvCacheTypes | None = None) -> int:
        """Bytes of the paged pool one token of context takes (0 unless ``paged``)."""
        return 0

    def bytes_per_slot(self, dtype_bytes: int) -> int:
        """Bytes kept per running sequence whatever its length (0 unless ``slot_state``)."""
        return 0

    def kv_types_problem(self, kv_types: KvCacheTypes) -> str | None:
        """Why the paged rows cannot be stored as ``kv_types`` (None: they can, or none are paged)."""
        return None

    def make(self, maker: CacheMaker[T]) -> T:  # pragma: no cover - every kind overrides it
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttention(CacheSpec):
    """Paged K and V: ``kv_heads`` heads of ``head_dim`` values each, per token."""

    kv_heads: int
    head_dim: int

    paged = True
    owns_kv = True

    def bytes_per_token(self, dtype_bytes: int, kv_types: KvCacheTypes | None = None) -> int:
        """K and V of one token: full width (``dtype_bytes`` a value), or stored as ``kv_types``
        (``pantheon.core.kv_types``: blocks along each head's values)."""
        if kv_types is None:
            return 2 * self.kv_heads * self.head_dim * dtype_bytes
        return kv_types.token_bytes(self.kv_heads, self.head_dim, dtype_bytes)

    def kv_types_problem(self, kv_types: KvCacheTypes) -> str | None:
        for kind in dict.fromkeys((kv_types.k, kv_types.v)):
            why = width_problem(kind, self.head_dim)
            if why:
                return why
        return None

    def make(self, maker: CacheMaker[T]) -> T:
        return maker.full(self)


@dataclass(frozen=True)
class SlidingWindow(CacheSpec):
    """Sliding-window attention (Mistral, Gemma 3's local layers): a query at position p reads
    keys p - window + 1 .. p, as transformers' ``sliding_window_overlay``. Its last ``window``
    positions' K and V live in a ring per slot, at the compute dtype: a slot state."""

    kv_heads: int
    head_dim: int
    window: int

    slot_state = True
    owns_kv = True

    @property
    def sliding_window(self) -> int | None:
        return self.window

    def bytes_per_slot(self, dtype_bytes: int) -> int:
        """The ring: its ``window`` positions' K and V, full width."""
        return self.window * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def make(self, maker: CacheMaker[T]) -> T:
        return maker.sliding(self)


def AttentionCache(kv_heads: int, head_dim: int, window: int | None = None) -> FullAttention | SlidingWindow:  # noqa: N802 - the families' spelling of an attention layer's spec
    """An attention layer's spec: sliding when ``window`` is set, else full."""
    return FullAttention(kv_heads, head_dim) if window is None else SlidingWindow(kv_heads, head_dim, window)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent state, per slot: ``shape`` in ``dtype`` ("model": the model's
    compute dtype; "float32": always fp32, as a recurrence accumulating over thousands of tokens
    needs)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # model | float32

    def nbytes(self, model_dtype_bytes: int) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * (4 if self.dtype == "float32" else model_dtype_bytes)


@dataclass(frozen=True)
class RecurrentState(CacheSpec):
    """A fixed-size state per running sequence (slot), whatever its length."""

    tensors: tuple[StateTensor, ...]

    slot_state = True

    def bytes_per_slot(self, dtype_bytes: int) -> int:
        return sum(t.nbytes(dtype_bytes) for t in self.tensors)

    def make(self, maker: CacheMaker[T]) -> T:
        return maker.recurrent(self)


@dataclass(frozen=True)
class SharedKV(CacheSpec):
    """An attention layer that attends to the K and V of ``layer`` (an earlier attention layer of
    the same kind: window, heads and head dim), as Gemma 4's KV-shared layers: no cache of its
    own, so nothing is booked or allocated for it."""

    layer: int

    def make(self, maker: CacheMaker[T]) -> T:
        return maker.shared(self)


@dataclass(frozen=True)
class ExpertSpec:
    """A mixture-of-experts MLP's routed experts: ``count`` SwiGLU experts of ``intermediate``
    rows each (gate, up ``[I, H]`` and down ``[H, I]``, biases when ``bias``), stacked
    ``[count, ...]``; each token
    runs ``top_k`` of them. All are resident; a token reads only its ``top_k``. The router
    (``[count, H]``) and a shared expert, when there is one, are ordinary linears of the layer."""

    count: int
    top_k: int
    intermediate: int
    hidden: int
    bias: bool = False  # each expert's gate, up and down have biases (gpt-oss)
    # stored as MXFP4 blocks (gpt-oss): CPU paths hold them as they are (sizing.experts_layout)
    mxfp4: bool = False

    @property
    def per_expert(self) -> int:
        """Parameters of one expert: gate, up and down (and their biases)."""
        return 3 * self.intermediate * self.hidden + (2 * self.intermediate + self.hidden if self.bias else 0)

    @property
    def params(self) -> int:
        return self.count * self.per_expert

    @property
    def active_params(self) -> int:
        return self.top_k * self.per_expert


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its kind, its linear matrices ``[N, K]`` (as the engine fuses them: the
    CPU paths lay each out, sizing counts them), the count of its other parameters (norms,
    biases, convolution, decay rates), and its cache spec; ``experts``: a mixture-of-experts
    MLP's routed experts (stacked, kept dense in the path's dtype), None for a dense layer."""

    kind: str  # attention | linear_attention
    linears: tuple[tuple[int, int], ...]
    small: int
    cache: CacheSpec
    experts: ExpertSpec | None = None

    @property
    def params(self) -> int:
        """Every parameter of the layer, all experts included."""
        own = sum(n * k for n, k in self.linears) + self.small
        return own + (self.experts.params if self.experts else 0)

    @property
    def active_params(self) -> int:
        """The parameters one token's pass reads: the routed experts' ``top_k`` only."""
        own = sum(n * k for n, k in self.linears) + self.small
        return own + (self.experts.active_params if self.experts else 0)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; ``scaling`` holds the type-specific fields (factor, ...); ``rotary_dim``
    is how many of a head's dimensions rotate (all but for partial rotary embeddings)."""

    theta: float = 10000.0
    type: str = "default"
    scaling: dict = field(default_factory=dict)
    rotary_dim: int = 0  # 0: the whole head


# ---------------------------------------------------------------- the description


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """What every decoder-only model has; families subclass it with their own fields."""

    family: str  # the pantheon.core.archs family that built it (and workers.models.<family>)
    arch: str  # the member of the family: llama | qwen2 | qwen3 | qwen3_5
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # of the attention layers
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    torch_dtype: str  # the checkpoint's dtype name: bfloat16 | float16 | float32
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    quantized_source: bool = False  # a GGUF file whose weights are all stored quantized
    int4_source: bool = False  # ... and its decoder linears in 4-bit groups of 32 (Q4_0/Q4_1/Q4_K)
    # A GGUF whose token table is stored in a block type: the bytes a row takes as its blocks,
    # which a CPU path laying its head out on its own holds (workers/layers/block_embedding.py);
    # 0: a float table
    table_row_bytes: int = 0
    skipped: tuple[str, ...] = ()  # what of the checkpoint the engine leaves out, said in the load log
    # Parameters outside the layers besides the embedding table, final norm and head (Gemma 4's
    # per-layer embeddings and their projection), on the first die with the embeddings.
    extra_params: int = 0
    # how the model embeds when it is an embedding model (a sentence-transformers folder, BERT;
    # pantheon.core.embedding), None for a plain language model
    embedding: EmbeddingSpec | None = None
    can_generate: bool = True  # False: an encoder that only embeds (BERT)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim or self.head_dim

    @property
    def context_limit(self) -> int:
        """The longest context the model takes: its trained length, stretched by dynamic RoPE."""
        if self.rope.type == "dynamic":
            return int(self.max_position_embeddings * float(self.rope.scaling["factor"]))
        return self.max_position_embeddings

    @property
    def attention_layers(self) -> list[int]:
        """Attention layers with K and V of their own (full or sliding)."""
        return [i for i, s in enumerate(self.layers) if s.cache.owns_kv]

    @property
    def recurrent_layers(self) -> list[int]:
        """Layers whose per-slot state is a recurrence (not a sliding ring)."""
        return [i for i, s in enumerate(self.layers) if s.cache.slot_state and not s.cache.owns_kv]

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention scores (folded into q by the rotary tables)."""
        return self.head_dim**-0.5

    @property
    def sliding_rope(self) -> RopeConfig | None:
        """The RoPE of the sliding-window layers when it differs from ``rope`` (Gemma 3's
        local base); None: they rotate as the full layers do."""
        return None

    @property
    def windows(self) -> list[int]:
        """The distinct sliding windows of the attention layers (the runner masks each)."""
        return sorted({w for s in self.layers if (w := s.cache.sliding_window)})

    @property
    def slot_state_layers(self) -> list[int]:
        """Layers that keep a fixed-size state per slot: recurrent ones and sliding-window rings
        (the prefix cache checkpoints them at block boundaries: cached KV blocks cannot rebuild them)."""
        return [i for i, s in enumerate(self.layers) if s.cache.slot_state]

    @property
    def rewindable(self) -> bool:
        """Every layer keeps its K/V paged by position, so rows past a sequence's length can be
        taken back (speculation's rejected drafts): no recurrent state, no sliding ring."""
        return not (self.slot_state_layers or self.windows)

    @property
    def can_speculate(self) -> bool:
        """Drafts can be verified on this model (workers/speculation.py): no sliding ring (a
        verify's rows overwrite entries a rejection still needs), and a RoPE whose tables do not
        depend on the chunk's end (not dynamic NTK). Recurrent layers may: they keep the state
        after each verify row and the engine keeps the accepted one."""
        return not self.windows and self.rope.type != "dynamic"

    def kv_bytes_per_token(self, dtype_bytes: int, kv_types: KvCacheTypes | None = None) -> int:
        """K and V of one token over the attention layers of the paged pool (not the sliding ones,
        whose rings stay full width: ``state_bytes_per_slot``), stored as ``kv_types`` (None:
        full width)."""
        return sum(s.cache.bytes_per_token(dtype_bytes, kv_types) for s in self.layers)

    def kv_types_problem(self, kv_types: KvCacheTypes) -> str | None:
        """Why this model's paged K/V rows cannot be stored as ``kv_types`` (a head width that is
        not whole quantization blocks), or None when they can."""
        return next((why for s in self.layers if (why := s.cache.kv_types_problem(kv_types))), None)

    def state_bytes_per_slot(self, dtype_bytes: int) -> int:
        """The states of one running sequence: recurrent layers' and sliding layers' rings."""
        return sum(s.cache.bytes_per_slot(dtype_bytes) for s in self.layers)

    @property
    def total_params(self) -> int:
        """Every parameter: embeddings, layers (all experts), final norm, an untied head."""
        table = self.vocab_size * self.hidden_size
        top = table * (1 if self.tie_word_embeddings else 2) + self.hidden_size + self.extra_params
        return top + sum(s.params for s in self.layers)

    @property
    def active_params(self) -> int:
        """The parameters one token's pass reads (a mixture of experts' ``top_k`` experts per
        layer; the embedding table counted whole, as the head reads it when tied)."""
        table = self.vocab_size * self.hidden_size
        top = table * (1 if self.tie_word_embeddings else 2) + self.hidden_size + self.extra_params
        return top + sum(s.active_params for s in self.layers)


# ---------------------------------------------------------------- parsing helpers (for families)


MTP = "mtp"  # a load's ``draft`` naming the model's own multi-token-prediction head


def mtp_description(desc: ModelDescription) -> ModelDescription | None:
    """The model's multi-token-prediction head (``mtp.*``: Qwen3.5's, as vLLM's ``mtp`` method
    runs it) as a one-layer description, for its sizing and its runner: the head's full-attention
    layer, whose spec also counts the head's input projection ``fc`` [H, 2H] and its two input
    norms (its final norm is the description's; its embeddings and LM head are the model's).
    None when the checkpoint has no such head."""
    if not getattr(desc, "mtp_layers", 0):
        return None
    i = next(i for i, s in enumerate(desc.layers) if s.cache.paged)
    spec, h = desc.layers[i], desc.hidden_size
    head = dataclasses.replace(spec, linears=(*spec.linears, (h, 2 * h)), small=spec.small + 2 * h)
    fields: dict[str, Any] = {"num_layers": 1, "layers": (head,), "skipped": ()}
    if hasattr(desc, "layer_types"):  # a hybrid family builds its layers by these
        fields["layer_types"] = (desc.layer_types[i],)  # pyright: ignore[reportAttributeAccessIssue]
    return dataclasses.replace(desc, **fields)


def pos_int(raw: dict, key: str, where: str, default: Any = ...) -> int:
    """``raw[key]`` as a positive integer; ``default`` when missing (if given)."""
    if key not in raw or raw[key] is None:
        if default is not ...:
            return default
        raise ModelError("invalid", f"{where}: missing field {key!r}")
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelError("invalid", f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def rope_from(raw: dict, where: str, head_dim: int) -> RopeConfig:
    """RoPE settings in either style: ``rope_theta`` + ``rope_scaling``, or transformers 5's
    ``rope_parameters`` (either may say ``type`` or ``rope_type``); ``partial_rotary_factor`` at
    the top level or inside ``rope_parameters`` rotates only the first dimensions of a head."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    src: dict = {}
    if isinstance(params, dict):
        src = dict(params)
    if isinstance(scaling, dict):
        src.update(scaling)
    theta = raw.get("rope_theta")
    if theta is None:
        theta = src.get("rope_theta", 10000.0)
    partial = raw.get("partial_rotary_factor", src.get("partial_rotary_factor", 1.0))
    rope_type = src.get("rope_type") or src.get("type") or "default"
    # multimodal RoPE sections change nothing for text: every axis then has the same position
    for k in (
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "mrope_section",
        "mrope_interleaved",
    ):
        src.pop(k, None)
    if rope_type not in ROPE_TYPES:
        raise ModelError(
            "unsupported",
            f"{where}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(sorted(ROPE_TYPES))})",
        )
    if rope_type != "default" and "factor" not in src:
        raise ModelError("invalid", f"{where}: rope_scaling type {rope_type!r} needs 'factor'")
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ModelError("invalid", f"{where}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2:
        raise ModelError("invalid", f"{where}: partial_rotary_factor {partial} gives {dim} rotary dimensions")
    return RopeConfig(
        theta=float(theta), type=rope_type, scaling=src, rotary_dim=0 if dim == head_dim else dim
    )


def eos_ids(raw: dict, gen: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen, raw):
        v = src.get("eos_token_id")
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return tuple(ids)


def torch_dtype(raw: dict, where: str) -> str:
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in DTYPE_BYTES:
        raise ModelError("unsupported", f"{where}: field 'torch_dtype' {dtype!r} is not supported")
    return dtype


def decoder_fields(
    raw: dict, gen: dict, where: str, *, head_shape: tuple[int, int, int, int], default_context: int
) -> dict[str, Any]:
    """The ``ModelDescription`` fields every family reads the same way from a ``config.json``
    (``head_shape``: hidden size, heads, KV heads, head dim, already checked by the family)."""
    hidden, heads, kv_heads, head_dim = head_shape
    return dict(
        vocab_size=pos_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=pos_int(raw, "intermediate_size", where),
        num_layers=pos_int(raw, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or default_context),
        rope=rope_from(raw, where, head_dim),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=torch_dtype(raw, where),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw, gen),
        quantized_source=bool(raw.get("quantized_source", False)),
        int4_source=bool(raw.get("int4_source", False)),
        table_row_bytes=int(raw.get("table_row_bytes", 0)),
    )


# ---------------------------------------------------------------- reading


def describe(raw: Any, gen: dict, where: str) -> ModelDescription:
    """The description of a ``config.json`` dict (``gen``: ``generation_config.json``, for EOS
    ids); errors name ``where``."""
    from pantheon.core import archs

    if not isinstance(raw, dict):
        raise ModelError("invalid", f"{where}: not a JSON object")
    family, arch = archs.family_of(raw, where)
    desc = family.describe(raw, gen, where, arch)
    if archs.names_base_model(raw, family):  # no head: it embeds (its own pooling may follow)
        desc = dataclasses.replace(desc, embedding=BASE_MODEL, can_generate=False)
    return desc


def gguf_description(g: GGUFFile) -> ModelDescription:
    """``read_description`` of a parsed GGUF file (its metadata as a ``config.json``, and the
    embedding spec its pooling keys give). Raises ``ModelError`` (or ``GGUFError``)."""
    from pantheon.core.gguf import hf_config

    desc = describe(hf_config(g), {}, f"{g.path} (GGUF metadata)")
    spec = gguf_embedding(g.meta)
    return dataclasses.replace(desc, embedding=spec) if spec is not None else desc


def read_description(path: str | Path) -> ModelDescription:
    """Read and check a model's description: a Hugging Face folder's ``config.json`` (and
    ``generation_config.json`` for EOS ids), or a GGUF file's metadata (the file, or the one
    ``.gguf`` in a folder). Raises ``ModelError``."""
    from pantheon.core.gguf import GGUFError, find_gguf, read_gguf

    try:
        found = find_gguf(path)
        if found is not None:
            return gguf_description(read_gguf(found))
    except GGUFError as e:
        raise ModelError(e.kind, e.reason) from None
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError("not_found", f"{folder}: no such model folder or .gguf file")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError("not_found", f"{cfg_path}: missing config.json (and no .gguf file)")
    raw = _read_json(cfg_path)
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    desc = describe(raw, gen if isinstance(gen, dict) else {}, str(cfg_path))
    try:
        spec = read_sentence_transformers(folder, raw)
    except EmbeddingError as e:
        raise ModelError(e.kind, e.reason) from None
    return dataclasses.replace(desc, embedding=spec) if spec is not None else desc


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError("invalid", f"{path}: not valid JSON ({e})") from None


def shape_digest(desc: ModelDescription) -> str:
    """A digest of what makes two checkpoints the same model to the engine: the architecture,
    the vocabulary, and every layer's kind, shapes and cache (not the dtype or the format, so a
    GGUF and its Hugging Face folder agree). The router compares the worker's with its own for a
    ``worker_path`` (a fine-tune of the same shape is not told apart: that needs the weights)."""
    import hashlib

    key = repr((desc.family, desc.arch, desc.vocab_size, desc.hidden_size, desc.layers))
    return hashlib.sha256(key.encode()).hexdigest()[:16]
