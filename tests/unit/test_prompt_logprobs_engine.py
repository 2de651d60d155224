"""Prompt logprobs (issue 26 §3) from the engine's own prefill against transformers'
log-softmax on the same fp32 random-weight model: chunked, batched beside other requests,
after a prefix-cache hit would have skipped the prompt's first blocks, past the rows
log-softmaxed at once, and through a prefill that was preempted and started again."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams, TokenOut
from workers.engine import Engine

transformers = pytest.importorskip("transformers")

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88, 19, 2]
K = 5


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("tiny", dtype="float32")


@pytest.fixture(scope="module")
def reference(path) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: [T, V]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def run(eng: Engine) -> dict[str, list[TokenOut]]:
    outs: dict[str, list[TokenOut]] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def check(outs: list[TokenOut], ref: torch.Tensor, k: int = K, prompt: list[int] = PROMPT) -> None:
    got = outs[0].prompt_logprobs
    assert got is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert len(got.logprobs) == len(got.ranks) == len(got.top) == len(prompt) - 1
    for i, tok in enumerate(prompt[1:]):
        row = ref[i]  # position i predicts prompt token i + 1
        assert abs(got.logprobs[i] - row[tok].item()) < 1e-3, i
        assert got.ranks[i] == int((row > row[tok]).sum()) + 1, i
        want_v, want_i = torch.topk(row, k)
        assert [t for t, _ in got.top[i]] == want_i.tolist(), i
        assert max(abs(v - w) for (_, v), w in zip(got.top[i], want_v.tolist())) < 1e-3


def test_chunked_prefill_after_a_cache_hit_matches_transformers(path, reference):
    """7-token chunks on 4-token blocks; the same prompt ran first, so its blocks are cached:
    the request that asks still computes (and reports) every position."""
    eng = Engine(str(path), dtype="float32", prefill_chunk=7, block_size=4, num_slots=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.submit("warm", PROMPT, greedy)
    run(eng)
    eng.submit("lp", PROMPT, greedy, prompt_logprobs=K)
    outs = run(eng)["lp"]
    assert outs[0].cached_tokens == 0
    check(outs, reference)
    assert all(v == 0 for v in eng.request_tables().values())


def test_beside_other_requests_and_with_k_zero(path, reference):
    """One step decodes a request, prefills one without and two with prompt logprobs (K 0 and
    5): each gets its own rows."""
    eng = Engine(str(path), dtype="float32", prefill_chunk=64, num_slots=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.submit("decoding", [5, 6, 7], greedy)
    eng.step()
    eng.submit("plain", PROMPT[:9], greedy)
    eng.submit("zero", PROMPT, greedy, prompt_logprobs=0)
    eng.submit("five", PROMPT, greedy, prompt_logprobs=K)
    outs = run(eng)
    check(outs["five"], reference)
    zero = outs["zero"][0].prompt_logprobs
    assert zero is not None and zero.top == [[]] * (len(PROMPT) - 1)
    assert zero.logprobs == pytest.approx(outs["five"][0].prompt_logprobs.logprobs, abs=1e-5)  # pyright: ignore[reportOptionalMemberAccess]
    assert outs["plain"][0].prompt_logprobs is None
    assert [o.token for o in outs["five"]] == [o.token for o in outs["zero"]]


def test_a_long_prompt_and_a_preempted_prefill(path, model_factory):
    """150 positions in 100-token chunks (past the 64 rows log-softmaxed at once); then a
    prefill preempted by a decoding request's growth starts again and still matches."""
    from workers.cache import kv_block_bytes
    from workers.model_config import load_config

    g = torch.Generator().manual_seed(0)
    long = torch.randint(10, 3000, (150,), generator=g).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([long])).logits[0].float(), dim=-1)
    eng = Engine(str(path), dtype="float32", prefill_chunk=100)
    eng.submit("long", long, SamplingParams(max_tokens=1), prompt_logprobs=2)
    got = run(eng)["long"][0].prompt_logprobs
    assert got is not None and len(got.logprobs) == 149
    assert max(abs(x - want[i, t].item()) for i, (x, t) in enumerate(zip(got.logprobs, long[1:]))) < 1e-3

    # 16 blocks of 4: a 40-token decoder holds 10 and grows while a 40-token joiner prefills
    # 7 at a time into the rest; when the pool is full the decoder's growth preempts the joiner
    block = kv_block_bytes(load_config(str(path)), 4, torch.float32)
    eng = Engine(str(path), dtype="float32", prefill_chunk=7, block_size=4, kv_budget_bytes=16 * block)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.submit("decoder", long[50:90], greedy)
    eng.step()
    eng.submit("lp", long[:40], SamplingParams(max_tokens=1), prompt_logprobs=K)
    outs: dict[str, list[TokenOut]] = {}
    preempted = 0
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        seq = eng.scheduler.get("lp")
        preempted = max(preempted, seq.preemptions if seq is not None else 0)
    assert preempted, "the prefill was never preempted: the test no longer tests that"
    check(outs["lp"], want[:39], prompt=long[:40])  # causal: the long prompt's first rows
