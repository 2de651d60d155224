"""How much memory a model will take, from its description alone (no torch, no weights read).

The router admits a load against the dies' budgets *before* any worker touches the weights, so it
needs an estimate: the weights, the KV cache's bytes per token and the recurrent states' bytes per
slot, all from the model's description (``pantheon.core.description``: one ``LayerSpec`` per
layer, with the shapes of its linear matrices as the engine fuses them and its cache spec). After
the load the worker reports the real figures (``Loaded.weight_bytes``/``kv_bytes``) and those are
booked instead.

Two engine details matter for the figure:

- on CPU dies the layout is the CPU path's (``CPU_PATHS``): its dtype, and for packed paths a
  second copy of a tied ``vocab x hidden`` head;
- ``quantize`` turns the decoder's linear layers into int8 plus one scale per output row (the
  embeddings and the head stay): about half the weight memory of a bf16 model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pantheon.core.description import (
    DTYPE_BYTES,
    ExpertSpec,
    ModelDescription,
    ModelError,
    describe,
    read_description,
)
from pantheon.core.kv_types import KvCacheTypes

AUTO_KV = KvCacheTypes()  # the compute dtype's full width: today's cache

BLOCK_TOKENS = 16  # the engine's KV block size: pools are whole blocks

# The router's name for a description it sizes, and for the errors of reading one.
ModelShape = ModelDescription
SizingError = ModelError


def read_shape(path: str | Path) -> ModelDescription:
    """The description of ``path/config.json``, or of a GGUF file's metadata (``path`` itself, or
    the one ``.gguf`` in the folder); raises ``SizingError``."""
    return read_description(path)


def shape_from_config(raw: dict, where: str) -> ModelDescription:
    """The description of a ``config.json`` dict; errors name ``where``."""
    return describe(raw, {}, where)


@dataclass(frozen=True)
class Estimate:
    """Bytes a model takes: ``base`` (embeddings, final norm, heads) lives on the first die, each
    layer's weights (``layer_bytes``) on the die that holds the layer; ``kv_layer_bytes`` is each
    layer's K and V per token (0 for a layer without a KV cache) and ``state_layer_bytes`` each
    layer's recurrent state per slot (0 for an attention layer)."""

    base: int
    layer_bytes: tuple[int, ...]
    kv_layer_bytes: tuple[int, ...]
    state_layer_bytes: tuple[int, ...]
    context_limit: int
    # Parameters in all, and those one token's pass reads (a mixture of experts reads its top-k
    # experts of each layer only; equal for a dense model): the admin view shows both.
    total_params: int = 0
    active_params: int = 0

    @property
    def layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def weights(self) -> int:
        return self.base + sum(self.layer_bytes)

    @property
    def kv_per_token(self) -> int:
        """K and V of one token over the layers that keep them."""
        return sum(self.kv_layer_bytes)

    @property
    def state_per_slot(self) -> int:
        """The recurrent states of one running sequence."""
        return sum(self.state_layer_bytes)

    def kv_pool(self, tokens: int) -> int:
        """The KV pool bytes that hold ``tokens`` tokens (whole blocks, at least two)."""
        blocks = max(2, -(-max(1, tokens) // BLOCK_TOKENS))
        return blocks * BLOCK_TOKENS * self.kv_per_token

    def kv_for(self, *, context: int, floor: int, room_tokens: int) -> int:
        """The KV pool bytes of a load: a full ``context`` when ``room_tokens`` (what the dies
        can give, already times the KV fraction) holds it, else what they hold in whole blocks,
        never less than ``floor`` tokens (a die without that much room then refuses the load).

        So the pool, and with it the per-request limit, is the model's context, unless memory
        says less; the admission floor (``--admit-ctx``) no longer caps a model that fits."""
        least = min(floor, context)
        tokens = max(least, min(context, room_tokens))
        return self.kv_pool(tokens)

    def split(
        self, dies: tuple[str, ...], weights: int | None = None, kv: int = 0, state: int = 0
    ) -> dict[str, tuple[int, int]]:
        """``{die: (weight bytes, cache bytes)}`` for a replica whose layers are split across
        ``dies`` the way the loader splits them (contiguous near-equal runs; the embeddings and
        heads on the first die). ``weights`` (the worker's real figure) scales the estimate;
        ``kv`` (the KV pool) and ``state`` (the state pool) are shared out by the layers that
        keep each, and booked together as the die's cache."""
        n, layers = len(dies), self.layers
        owner = [min(i * n // layers, n - 1) for i in range(layers)]
        est = self.weights or 1
        scale = 1.0 if weights is None else weights / est
        w = [self.base if j == 0 else 0 for j in range(n)]
        kv_w, st_w = [0] * n, [0] * n
        for i, j in enumerate(owner):
            w[j] += self.layer_bytes[i]
            kv_w[j] += self.kv_layer_bytes[i]
            st_w[j] += self.state_layer_bytes[i]
        ws = [int(x * scale) for x in w]
        kvs = [kv * x // (self.kv_per_token or 1) for x in kv_w]
        sts = [state * x // (self.state_per_slot or 1) for x in st_w]
        if weights is not None:  # rounding: the first die takes what is left
            ws[0] = weights - sum(ws[1:])
        if kv:
            kvs[0] = kv - sum(kvs[1:])
        if state:
            sts[0] = state - sum(sts[1:])
        return {die: (ws[j], kvs[j] + sts[j]) for j, die in enumerate(dies)}


# The CPU paths a worker can lay a model out in (``workers/cpu_paths.py`` runs them; this table is
# their torch-free description): name -> (compute dtype, layout, lossy). dense: plain weights;
# packed: oneDNN-prepacked, the same bytes, plus a packed copy of a tied LM head (the table stays
# for lookups); int8: weight-only int8 linears and head with one scale per output row (lossy: for
# loads that ask to quantize, and files stored quantized already); int4: the decoder's linears in
# 4-bit groups of 32 with a 16-bit scale and zero each, the head in int8 rows (only for files whose
# linears are stored in 4-bit groups already: it gives their own levels back), its activations,
# norms and residual stream in fp32 (issue 40: in bf16 their rounding flipped the default model's
# near-tied greedy answers from one host's kernels to another's; llama.cpp keeps fp32 there too).
CPU_PATHS: dict[str, tuple[str, str, bool]] = {
    "bf16-packed": ("bfloat16", "packed", False),
    "bf16": ("bfloat16", "dense", False),
    "fp32-packed": ("float32", "packed", False),
    "fp32": ("float32", "dense", False),
    "int8": ("bfloat16", "int8", True),
    "int4": ("float32", "int4", True),
}
INT4_GROUP = 32  # weights per scale and zero in the int4 layout
MXFP4_BLOCK = 32  # values per e8m0 exponent in MXFP4
INT4_SCALE_BYTES = 2  # each group's scale and zero: fp16 (our kernel) or bf16 (torch's), whatever the dtype


def int4_fits(n: int, k: int) -> bool:
    """Whether torch's int4 CPU kernel takes a [N, K] weight (N in 16s, K in whole groups); the
    int4 path keeps a matrix it does not take in int8 rows."""
    return n % 16 == 0 and k % INT4_GROUP == 0


def experts_layout(layout: str, dtype: str, mxfp4: bool) -> str:
    """How a CPU path of ``layout`` (in ``dtype``) holds the routed experts: as its linears, except
    MXFP4 experts, held as they ship on every path ("mxfp4": the MXFP4 kernel, exact against the
    dequantized weights; workers/mxfp4.py)."""
    return "mxfp4" if mxfp4 else layout


def _experts_bytes(e: ExpertSpec, layout: str, b: int) -> int:
    """Bytes of every routed expert of a layer held in ``layout`` (biases in the dtype)."""
    if layout not in ("int8", "int4", "mxfp4"):
        return e.params * b
    mats = ((2 * e.intermediate, e.hidden), (e.hidden, e.intermediate))
    return e.count * (_linear_bytes(mats, layout, b) + (e.per_expert - 3 * e.intermediate * e.hidden) * b)


def _held(e: ExpertSpec, layout: str, dtype: str, cpu: bool) -> str:
    """The experts' layout on a die: a CPU path's (``experts_layout``); CUDA's int8 keeps them."""
    return experts_layout(layout, dtype, e.mxfp4) if cpu else "dense"


def cpu_path_names(
    quantize: bool,
    dtype: str = "auto",
    works: dict[str, str] | None = None,
    quantized_source: bool = False,
    int4_source: bool = False,
) -> list[str]:
    """The CPU paths a load may end up on: only lossy ones when it asks to quantize, lossy ones
    too when the file is stored quantized already (int8 rows lose less than its 4-bit blocks
    did), int4 only when its linears are 4-bit groups already (``int4_source``), the load's
    ``dtype`` when one is asked for, and only those that probed well (``works``: a worker's
    Hello ``cpu_paths``; None: not known yet, so all of them).

    A 4-bit file loaded as it is (no ``quantize``, no ``dtype``) goes on int4 alone where int4
    works: its own levels, fp32 activations, so its answers are the file's on every host, where
    a choice timed among paths of other numerics would make them depend on the host's speeds
    (issue 40). Likewise a file stored quantized otherwise (Q8_0, Q6_K, Q5_K_M) goes on int8 alone
    (int8 rows of its levels, the bytes a step reads nearest the file's; issue 41: the timed
    choice kept bf16-packed, twice the bytes)."""
    names = [
        n
        for n, (dt, layout, lossy) in CPU_PATHS.items()
        if (lossy if quantize else (not lossy or quantized_source))
        and (layout != "int4" or int4_source)
        and (dtype == "auto" or dt == dtype)
        and (works is None or works.get(n) == "")
    ]
    if int4_source and not quantize and dtype == "auto" and "int4" in names:
        return ["int4"]
    if quantized_source and not quantize and dtype == "auto" and "int8" in names:
        return ["int8"]
    return names


def dtype_bytes(dtype: str, shape: ModelDescription) -> int:
    """Bytes per element of the weights and KV cache for a load's ``dtype`` ("auto": the
    checkpoint's own; float16 becomes bfloat16 on CPUs, the same size)."""
    name = shape.torch_dtype if dtype == "auto" else dtype
    return DTYPE_BYTES.get(name, 2)


def _linear_bytes(mats: tuple[tuple[int, int], ...], layout: str, b: int) -> int:
    """Bytes of ``[N, K]`` matrices laid out so: a byte a weight and a scale a row (int8); half a
    byte a weight and a scale and a zero a group of 32, or int8 rows for a shape the int4 kernel
    does not take (int4); half a byte a weight and an exponent byte a block of 32 (mxfp4); else
    ``b`` bytes a weight."""
    if layout == "int8":
        return sum(n * k + n * b for n, k in mats)
    if layout == "mxfp4":  # a code a half byte, an exponent byte a block of 32
        return sum(n * k // 2 + n * k // MXFP4_BLOCK for n, k in mats)
    if layout == "int4":
        return sum(
            n * k // 2 + n * k // INT4_GROUP * 2 * INT4_SCALE_BYTES if int4_fits(n, k) else n * k + n * b
            for n, k in mats
        )
    return sum(n * k * b for n, k in mats)


def estimate(
    shape: ModelDescription,
    *,
    dtype: str = "auto",
    quantize: bool = False,
    cpu: bool = True,
    cpu_path: str | None = None,
    cpu_works: dict[str, str] | None = None,
    kv_types: KvCacheTypes = AUTO_KV,
) -> Estimate:
    """What the engine allocates for this model. On a CPU die that is the given ``cpu_path``'s
    layout; with none (the worker picks by timing at load) the largest of the paths it may pick
    (``cpu_path_names``), so the booking is an upper bound until ``Loaded`` gives the real one.

    ``kv_types``: the paged K and V rows' types (``--kv-cache-dtype``): a quantized type counts
    its blocks' bytes; ``auto`` the path's dtype. Sliding-window rings stay full width (the engine
    keeps them in the compute dtype: state, not the paged pool)."""
    if cpu and cpu_path is None:
        q, q4 = shape.quantized_source, shape.int4_source
        names = cpu_path_names(quantize, dtype, cpu_works, q, q4) or cpu_path_names(
            quantize, dtype, None, q, q4
        )
        if not names:
            names = list(CPU_PATHS)
        ests = [estimate(shape, quantize=quantize, cpu_path=n, kv_types=kv_types) for n in names]
        return max(ests, key=lambda e: (e.weights, e.kv_per_token))
    layout = "int8" if quantize else "dense"
    if cpu:
        assert cpu_path is not None  # chosen above
        dtype, layout, _ = CPU_PATHS[cpu_path]
    b = dtype_bytes(dtype, shape)
    h = shape.hidden_size
    dense_table = shape.vocab_size * h * b
    # The LM head as the path lays it out (CPU paths only; CUDA's int8 keeps a plain head):
    # int8 rows plus a scale each (the int4 path's head too), else the table's bytes again.
    head_layout = layout if cpu else "dense"
    head = shape.vocab_size * (h + b) if head_layout in ("int8", "int4") else dense_table
    # a GGUF's quantized token table stays its blocks where the head is laid out on its own
    # (workers/layers/block_embedding.py; an embedding model's table is its own module)
    blocks = head_layout != "dense" and shape.table_row_bytes and shape.can_generate
    table = shape.vocab_size * shape.table_row_bytes if blocks else dense_table
    base = table + h * b + shape.extra_params * b  # embeddings, the final norm (Gemma 4's PLE)
    if not shape.tie_word_embeddings:
        base += head  # the LM head (laid out in place of the checkpoint's)
    elif head_layout != "dense":
        base += head  # the tied head's laid-out copy (the table stays for lookups)
    return Estimate(
        base=base,
        # a mixture of experts' stacked experts as the path holds them (workers/layers/moe.py)
        layer_bytes=tuple(
            _linear_bytes(s.linears, layout, b)
            + s.small * b
            + (_experts_bytes(s.experts, _held(s.experts, layout, dtype, cpu), b) if s.experts else 0)
            for s in shape.layers
        ),
        # a sliding-window layer keeps a ring of its window per slot: state, not per-token KV
        kv_layer_bytes=tuple(s.cache.bytes_per_token(b, kv_types) for s in shape.layers),
        state_layer_bytes=tuple(s.cache.bytes_per_slot(b) for s in shape.layers),
        context_limit=shape.context_limit,
        total_params=shape.total_params,
        active_params=shape.active_params,
    )


def draft_head_bytes(shape: ModelDescription) -> int:
    """The 4-bit copy of the LM head a model's own multi-token-prediction head picks its drafts
    with (``workers/mtp.draft_head``: int4 groups, int8 rows for a shape they do not take),
    booked for every path (an upper bound: the fp32 paths and a laid-out untied head use the
    model's own)."""
    return _linear_bytes(((shape.vocab_size, shape.hidden_size),), "int4", 2)


def state_checkpoints(num_slots: int, setting: int | None = None) -> int:
    """How many recurrent-state checkpoints a hybrid model's prefix cache keeps
    (``workers/state_checkpoints.py``): ``--state-checkpoints``, else two per slot. Each takes
    one slot's state (``Estimate.state_per_slot``); 0 turns the prefix cache off for such models
    (their KV blocks alone cannot restore a sequence)."""
    return 2 * num_slots if setting is None else setting


def state_pool_slots(num_slots: int, checkpoints: int) -> int:
    """States a hybrid model's load allocates: one per slot, one scratch (prompt logits computed
    outside the scheduler) and the prefix cache's ``checkpoints``."""
    return num_slots + 1 + checkpoints
