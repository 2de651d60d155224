"""Typed messages between the router and its workers.

Both sides import this module, so it imports neither torch nor quart: only msgspec (and
``typing``). Every message is a tagged ``msgspec.Struct`` encoded as msgpack; ``decode`` turns bytes
back into the right class from the tag. The router sends ``RouterMsg`` and the worker
sends ``WorkerMsg``; a worker never receives anything before it has sent ``Hello``.

Beside the messages, this module holds what both sides must agree on and may import: the kinds
a message's code fields take (``Literal`` types, checked when a message is decoded; on the wire
they stay plain strings), the worker's exit codes and what they mean, and how a die id is parsed.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pantheon.core.engine_spec import EngineSpec

# 4: EmbedRequest / EmbedOut, Submit.prompt_logprobs and TokenOut.prompt_logprobs;
# 5: LoadModel.kv_cache_k / kv_cache_v (the KV cache's types), SamplingParams.speculative,
# LoadModel.speculative, InstanceStats.spec_*; 6: LoadModel.draft (a draft model for speculation),
# InstanceStats.spec_draft, Hello.attention (the decode-attention kernel's state); 7: Hello.linear
# (the quantized linear kernel's state)
PROTOCOL_VERSION = 7

# ---------------------------------------------------------------- codes
# A value outside its Literal makes the whole message fail to decode, so a new code must be added
# here, on both sides at once (PROTOCOL_VERSION guards a mismatch).

LoadFailKind = Literal["not_found", "unsupported", "invalid", "out_of_memory", "internal", "cancelled"]
"""Why a ``LoadModel`` failed (``LoadFailed.kind``)."""

RejectKind = Literal["context_length", "no_instance", "invalid", "duplicate", "internal"]
"""Why a ``Submit`` was not run (``Rejected.kind``)."""

FinishReason = Literal["stop", "length", "abort"]
"""Why a request ended (``TokenOut.finish``): EOS or a stop id | max_tokens or the context | aborted."""

SlotState = Literal["idle", "prefill", "decode"]
"""What one engine slot is doing (``SlotInfo.state``)."""

DieKind = Literal["cpu", "cuda"]

Pooling = Literal["last", "mean", "cls"]
"""How an embedding is pooled from the final hidden states (``EmbedRequest.pooling``): the last
token's row (decoder embedding models: Qwen3-Embedding), the mean of every row, or the first row
(BERT's [CLS])."""


# ---------------------------------------------------------------- worker exit codes
# The worker exits with these (workers/worker.py); the router words them in its errors.

EXIT_OK = 0
EXIT_BAD_ARGS = 2
EXIT_ROUTER_SILENT = 3
EXIT_PARENT_GONE = 4
EXIT_REFUSED = 5

EXIT_MEANINGS: dict[int, str] = {
    EXIT_BAD_ARGS: "bad arguments or a die this machine does not have",
    EXIT_ROUTER_SILENT: "it heard nothing from the router for too long",
    EXIT_PARENT_GONE: "its parent process went away",
    EXIT_REFUSED: "the router refused its CURVE key",
}
"""What a worker's exit code means, for the codes that say more than "it exited"."""


# ---------------------------------------------------------------- die ids


def parse_die(die: str) -> tuple[DieKind, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``, ``"cpu:0"`` -> ``("cpu", 0)``; a bare integer means a CUDA
    die (``"2"`` -> ``("cuda", 2)``). A die of a worker on another host carries that worker's
    name after an ``@`` (``"cuda:0@gpu-box-2"`` -> ``("cuda", 0)``: on its own host it is cuda:0).
    Raises ``ValueError`` for anything else.

    The one parser of die ids: the router (pool, die manager) and the worker use it.
    """
    # Written without re so that this module keeps to msgspec; isdecimal is what \d matches.
    local, _, host = die.partition("@")
    if _ and not _good_host(host):
        raise ValueError(
            f"bad die {die!r}: the worker name after '@' must be letters, digits, '.', '_' or '-'"
        )
    if local.isdecimal():
        return "cuda", int(local)
    kind, sep, index = local.partition(":")
    if not sep or kind not in ("cpu", "cuda") or not index.isdecimal():
        raise ValueError(f"bad die {die!r}: expected cpu:N or cuda:N (cpu:N@WORKER on another host)")
    return kind, int(index)  # type: ignore[return-value]  # kind is one of DieKind here


def _good_host(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)


def die_host(die: str) -> str:
    """The worker name of a die on another host (``"cpu:0@w1"`` -> ``"w1"``); ``""`` for a die
    of a worker the router spawned itself."""
    return die.partition("@")[2]


def normalize_die(die: str) -> str:
    """The canonical spelling of a die id (``"3"`` -> ``"cuda:3"``, ``"cpu:01@w1"`` -> ``"cpu:1@w1"``).
    Raises ``ValueError`` like ``parse_die``."""
    kind, index = parse_die(die)
    host = die_host(die)
    return f"{kind}:{index}" + (f"@{host}" if host else "")


def die_kind(die: str) -> DieKind:
    """``"cpu"`` or ``"cuda"``; raises ``ValueError`` like ``parse_die``."""
    return parse_die(die)[0]


SPECULATIVE_TOKENS = 4
"""Drafts per step a request's ``speculative: true`` asks for when the server's ``--speculative``
is 0 (vLLM's usual ``num_speculative_tokens`` for prompt lookup)."""
SPECULATIVE_ON = -1
"""``SamplingParams.speculative``: on, at the instance's count (``SPECULATIVE_TOKENS`` if 0)."""


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How one request picks its next token. Checked by the router before it is sent."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = (
        64  # the penalty looks at this many recent tokens (prompt included); -1 all, 0 none
    )
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, before any penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # a seeded request draws the same tokens whatever shares its batch
    max_tokens: int = 16
    min_tokens: int = 0  # stop ids are masked until this many tokens came out
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    # an llguidance grammar (its JSON form) the output must match; the router compiled it once
    grammar: str | None = None
    grammar_after: list[int] = []  # the grammar starts once the output ends with these ids
    grammar_opening: int = -1  # >= 0: the output may open its reasoning with this id first
    # prompt-lookup drafts per step (workers/speculation.py): k > 0 that many; 0 none; None the
    # instance's default (LoadModel.speculative); SPECULATIVE_ON the instance's count, or
    # SPECULATIVE_TOKENS where that is 0. The worker ignores it where it cannot be exact (a
    # grammar, logprobs, penalties; recurrent or sliding-window models)
    speculative: int | None = None


# ---------------------------------------------------------------- router -> worker


class LoadModel(EngineSpec, tag=True, kw_only=True):
    """Build an engine: the ``EngineSpec`` (``pantheon/core/engine_spec.py``: its fields and
    defaults) under the instance id the router gave it, unique in the router."""

    instance: str


class UnloadModel(msgspec.Struct, tag=True, kw_only=True):
    instance: str


class Submit(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    instance: str
    prompt: list[int]
    params: SamplingParams
    session_id: str | None = None
    cache_salt: str | None = None  # requests share cached prefixes only under the same salt
    use_cache: bool = True  # False for a capped context: no prefix reuse for this turn
    # K >= 0: the prompt's own logprobs (each position's token and the top K), computed in this
    # request's prefill and carried on its first TokenOut (``PromptLogprobs``); None: not asked
    prompt_logprobs: int | None = None


class EmbedRequest(msgspec.Struct, tag=True, kw_only=True):
    """Embed one input: a prefill of ``prompt`` with no decode, nothing kept in the prefix cache,
    scheduled beside generation (the same slots, steps and FIFO). The worker answers with one
    ``EmbedOut`` (or ``Rejected``); ``Abort`` takes its request id like a ``Submit``'s.

    A message of its own rather than a flag on ``Submit``: none of ``Submit``'s sampling,
    session or cache fields applies, and its answer is a vector, not tokens."""

    request_id: str
    instance: str
    prompt: list[int]
    pooling: Pooling
    normalize: bool = True  # L2-normalise the pooled vector in the worker
    # more inputs of the same request follow at once: the worker waits for them (briefly) before
    # its next step, so a batch is one step, not a few inputs that happened to arrive first
    more: bool = False


class ResetCache(msgspec.Struct, tag=True, kw_only=True):
    """Forget the cached prefixes of one instance, or of all when ``instance`` is None."""

    instance: str | None = None


class Abort(msgspec.Struct, tag=True, kw_only=True):
    request_ids: list[str]


class Ping(msgspec.Struct, tag=True, kw_only=True):
    seq: int
    sent_at: float


class Shutdown(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---------------------------------------------------------------- worker -> router


class Hello(msgspec.Struct, tag=True, kw_only=True):
    die: str
    device_name: str
    total_bytes: int
    free_bytes: int
    pid: int
    version: int = PROTOCOL_VERSION
    # CPU dies: torch's vector ISA here (avx512 | avx2 | ...) and each CPU path's probe result,
    # run at worker start (path name -> "" when it works, else why not; workers/cpu_paths.py).
    cpu_isa: str = ""
    cpu_paths: dict[str, str] = {}
    hostname: str = ""  # the worker's machine (a remote worker's die id carries its own name)
    # CPU dies: how decode attention runs (workers/kernels/paged.py): "kernel: built|cached PATH"
    # (the paged C kernel) or "torch: why not the kernel"; CUDA dies: "triton: VERSION"
    # (workers/kernels/paged_triton.py, plain KV pools) or "torch: why not"
    attention: str = ""
    # CPU dies: how int4 / int8 linears run (workers/kernels/qlinear.py): "kernel ISA: built|cached
    # PATH" (the quantized linear kernel) or "torch: why not the kernel"; "" on other dies
    linear: str = ""


class Beat(msgspec.Struct, tag=True, kw_only=True):
    """The worker's heartbeat. A thread of its own sends it every ``BEAT_INTERVAL_S`` on a
    second socket (identity ``<die>/hb``), so it keeps coming while a step computes: the router
    tells a long step from a hung one by ``turn_s``, not by silence."""

    turns: int  # main-loop turns since start
    turn_s: float  # how long the current turn has run; 0 while the loop waits for work
    steps: int  # engine steps since start


BEAT_INTERVAL_S = 0.5


class LoadProgress(msgspec.Struct, tag=True, kw_only=True):
    instance: str
    done: int  # tensors filled so far
    total: int


class Loaded(msgspec.Struct, tag=True, kw_only=True):
    instance: str
    weight_bytes: int
    kv_bytes: int
    max_model_len: int
    num_slots: int
    vocab_size: int
    eos_token_ids: list[int]
    cpu_path: str = ""  # the CPU path the engine chose (or was forced to); "" on CUDA
    # the recurrent layers' state pools ((num_slots + 1) states); 0 for a model without such
    # layers, and from a worker that predates them
    state_bytes: int = 0
    # models.description.shape_digest of the model it loaded ("" from an older worker)
    shape_digest: str = ""


class LoadFailed(msgspec.Struct, tag=True, kw_only=True):
    instance: str
    kind: LoadFailKind
    reason: str


class Unloaded(msgspec.Struct, tag=True, kw_only=True):
    instance: str


class PromptLogprobs(msgspec.Struct, array_like=True):
    """The prompt's own logprobs (``Submit.prompt_logprobs``): entry ``i`` is prompt position
    ``i + 1`` (position 0 has none: nothing predicts it), from the log-softmax (fp32) of the
    logits at position ``i``. ``top``: the K most likely (token id, logprob) pairs, best first."""

    logprobs: list[float]  # of the prompt's own token at each position
    ranks: list[int]  # its rank there: 1 + the tokens more likely than it
    top: list[list[tuple[int, float]]]


class TokenOut(msgspec.Struct, array_like=True):
    """One new token of one request. ``top`` holds (token id, logprob) pairs when asked for."""

    request_id: str
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish: FinishReason | None = None  # None while running
    cached_tokens: int | None = None  # on a request's first token: prompt tokens the prefix cache gave
    prompt_logprobs: PromptLogprobs | None = None  # on its first token, when the Submit asked


class EmbedOut(msgspec.Struct, tag=True, kw_only=True):
    """An ``EmbedRequest``'s vector: float32 little-endian bytes (``hidden_size`` of them), pooled
    from the final hidden states (after the model's final norm), normalised when asked."""

    request_id: str
    vector: bytes
    prompt_tokens: int


class Rejected(msgspec.Struct, tag=True, kw_only=True):
    """A Submit the engine could not take (prompt too long for the pool, unknown instance)."""

    request_id: str
    kind: RejectKind
    reason: str


class StepOutput(msgspec.Struct, tag=True, kw_only=True):
    instance: str
    tokens: list[TokenOut]
    step_ms: float = 0.0


class SlotInfo(msgspec.Struct, array_like=True):
    state: SlotState
    request_id: str | None = None
    prompt_tokens: int = 0
    prefilled: int = 0
    generated: int = 0
    session_id: str | None = None


class InstanceStats(msgspec.Struct, kw_only=True):
    instance: str
    slots: list[SlotInfo]
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    weight_bytes: int
    kv_bytes: int
    kv_blocks_cached: int = 0  # held only by the prefix cache (evictable)
    cache_hit_blocks: int = 0  # since load: prefix blocks reused ...
    cache_query_blocks: int = 0  # ... of those looked up
    prefill_budget: int = 0  # prompt tokens the next step may prefill (the step budget)
    block_size: int = 16  # token positions per KV block
    state_bytes: int = 0  # the recurrent layers' state pools (0: none, or an older worker)
    # speculation since load (workers/speculation.py): sequence-steps that verified a draft, the
    # draft tokens verified, of them accepted, and the tokens those steps emitted
    spec_verify_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0
    spec_draft: str = ""  # the draft model's path; "" when drafts come from prompt lookup
    # the decode step's compile (workers/compiled.py): off[: why] | compiling | checking |
    # compiled | failed: why ("" from an older worker); seconds to built; its cache: hit | miss | off
    compile_state: str = ""
    compile_s: float = 0.0
    compile_cache: str = ""


class Stats(msgspec.Struct, tag=True, kw_only=True):
    free_bytes: int
    total_bytes: int
    instances: list[InstanceStats] = []
    steps: int = 0
    step_ms_avg: float = 0.0


class Pong(msgspec.Struct, tag=True, kw_only=True):
    seq: int
    sent_at: float


RouterMsg = LoadModel | UnloadModel | Submit | EmbedRequest | Abort | ResetCache | Ping | Shutdown
WorkerMsg = (
    Hello
    | Beat
    | LoadProgress
    | Loaded
    | LoadFailed
    | Unloaded
    | Rejected
    | StepOutput
    | EmbedOut
    | Stats
    | Pong
)

_encoder = msgspec.msgpack.Encoder()
_router_decoder = msgspec.msgpack.Decoder(RouterMsg)
_worker_decoder = msgspec.msgpack.Decoder(WorkerMsg)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_router_msg(data: bytes) -> RouterMsg:
    """Decode what the router sent (called in the worker)."""
    return _router_decoder.decode(data)


def decode_worker_msg(data: bytes) -> WorkerMsg:
    """Decode what a worker sent (called in the router)."""
    return _worker_decoder.decode(data)
