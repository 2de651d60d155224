"""Prompt-lookup (n-gram) speculation: the draft tokens a decoding sequence's own context proposes.

The shape is vLLM's ``ngram`` method: take the longest suffix of the sequence's tokens (prompt +
output), ``MAX_N`` tokens down to ``MIN_N``, that also occurs earlier in them, and propose the
(at most ``k``) tokens that followed its most recent earlier occurrence. An answer that copies its
prompt (edit this code, summarize this text, a JSON echo) is then drafted several tokens at a time;
free text rarely matches and costs nothing but the search.

Where the drafts come from: this module (prompt lookup), or, when the load names a draft model
(``draft = PATH``), that model (``workers/draft.py``: its greedy continuation, one token per
position, so everything below holds unchanged). With a draft model loaded every speculating
request drafts with it, never with prompt lookup: one proposer per instance keeps its acceptance
figures (``SpecStats``) about one thing, and a lookup hit would leave the draft's rows behind,
to be caught up by a longer pass later.

How a draft is used (``workers/engine.py``, ``workers/scheduler.py``, ``workers/runner.py``): the
step computes the sequence's pending token and its ``k`` drafts as ``k + 1`` decode rows in one
forward pass (row i sees the context up to its own position; every row's logits kept; decode rows
rather than a prefill chunk, so the linears and their rounding are plain decoding's); the sampler (``sampler.verify``) accepts the longest
prefix of drafts the target agrees with and adds the target's own next token, so a step emits
``1 .. k + 1`` tokens. The rejected rows' K/V stay in the sequence's blocks past its computed
length and are overwritten by the next steps before anything reads them.

Exactness: greedy output is token for token the output without speculation in fp32 (tests, batched
and alone). In bf16 on the CPU, with the paged decode kernel (``workers/kernels``, on where a C
compiler exists), each verify row attends over its own length (``StepBatch.decode_lens``) with the
arithmetic of a one-row step at that length, and the linears were checked row-invariant (M = 1..16
give bit-equal rows on bf16-packed), so greedy with speculation is bit for bit the same in eager
decoding (``tests/unit/test_paged_kernel.py``: verify rows equal plain decode rows; bf16
speculation greedy). On the torch path (``PANTHEON_ATTN_KERNEL=0``, no compiler, CUDA dies) and
when plain steps run the compiled graph, a sequence's verify rows are padded to the longest, and
bf16 ``probs @ v`` over a longer padded row may round differently: at a near-tie (top two logits
within one bf16 step) the argmax can then flip (seen once on SmolLM2 Q4_1 free chat at 128 tokens
before the kernel; a draft model, which makes almost every step a verify, showed it at token 60 on
the int4 path, measured on the torch path).

Which requests speculate (``Engine.submit``): those that ask (``SamplingParams.speculative``: the
request's ``speculative`` extension, else the server's ``--speculative N``; ``true`` takes the
server's N, or ``SPECULATIVE_TOKENS`` = 4 when the server's is 0) on a model whose rows can be
taken back under a fixed RoPE. A hybrid model's recurrent layers (Qwen3.5) run a sequence's
verify rows one after another and keep the state after each (``StateCache.verified``); the
engine then keeps the state after the last accepted row in the slot and checkpoints a block
boundary the accepted rows passed (``Engine._keep_verified``). Excluded, with speculation
silently off:
  * models with sliding-window rings (a verify chunk's rows overwrite ring entries the rejected
    case still needs), and dynamic-NTK RoPE (its tables depend on the chunk's end);
  * requests with a grammar (response_format, forced tools: the mask of row i depends on the
    drafts before it), logprobs, or repetition / presence / frequency penalties (they depend
    on the output so far, row by row).
Handled exactly: greedy and sampled requests (temperature, top_k/top_p/min_p, seed), logit_bias,
min_tokens, stop ids and max_tokens (the accepted tokens are cut where the sequence finishes), and
stop strings (the router cuts the text token by token, as without speculation).
"""

from __future__ import annotations

import numpy as np

MAX_N = 4  # the longest suffix n-gram looked up (vLLM's prompt_lookup_max)
MIN_N = 2  # the shortest (prompt_lookup_min): one token matches too often to be worth a draft


def propose(tokens: list[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> list[int]:
    """At most ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram (``max_n`` down to ``min_n`` tokens) of ``tokens``; [] when none occurs.

    The earlier occurrence may overlap the suffix (``a b a b a b`` drafts ``a b ...``).
    """
    n_tok = len(tokens)
    if k <= 0 or n_tok <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # candidate ends: positions before the last whose token is the last token
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    # length of the match ending at each candidate, grown one token back at a time (at most max_n)
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, n_tok - 1)):
        back = ends - j
        ok = alive & (back >= 0)
        ok[ok] = arr[back[ok]] == arr[n_tok - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return arr[end + 1 : end + 1 + k].tolist()


class SpecStats:
    """Since load: what speculation proposed and what the target kept (``/admin/dies``)."""

    def __init__(self) -> None:
        self.verify_steps = 0  # sequence-steps that verified a draft
        self.drafted = 0  # draft tokens proposed and verified
        self.accepted = 0  # of them, accepted
        self.emitted = 0  # tokens those steps emitted (accepted + the target's own, cut by finishes)

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
