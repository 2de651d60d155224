"""The same engine on ``cuda:N``: skipped without a CUDA device (``just gpu-check`` runs them)."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 300, 41], list(range(100, 160)), [64], [3, 1, 4, 1, 5, 9, 2, 6]]


def run(eng: Engine, params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, params)
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out


def test_cuda_logits_match_cpu(model_factory):
    path = str(model_factory("tiny-llama", dtype="float32"))
    rows = {}
    for dev in ("cpu", "cuda:0"):
        eng = Engine(path, devices=[dev], dtype="float32", kv_budget_bytes=4 << 20)
        eng.on_logits = lambda seqs, logits, dev=dev: rows.setdefault(dev, logits.cpu().clone())
        run(eng, SamplingParams(temperature=0.0, max_tokens=1))
    assert (rows["cpu"] - rows["cuda:0"]).abs().max() < 1e-3


def test_cuda_batch_equals_alone_and_seeded_sampling(model_factory):
    path = str(model_factory("tiny-llama", dtype="float32"))
    eng = Engine(path, devices=["cuda:0"], dtype="float32", kv_budget_bytes=4 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = run(eng, greedy)
    for i, p in enumerate(PROMPTS):
        eng.submit("solo", p, greedy)
        solo = []
        while eng.has_work():
            solo += [o.token for o in eng.step()]
        assert solo == together[f"p{i}"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    assert run(eng, seeded) == run(eng, seeded)


def greedy_rows(eng: Engine, steps: int) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """``run``'s greedy tokens, and per request the logits row each of them was picked from."""
    rows: dict[str, list[torch.Tensor]] = {}

    def keep(seqs, logits):
        for s, row in zip(seqs, logits):
            rows.setdefault(s.request_id, []).append(row.float().cpu())

    eng.on_logits = keep
    return run(eng, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)), rows


def test_bf16_and_int8_on_cuda_track_the_fp32_model(model_factory):
    """bf16 and int8 on cuda:0 (prefill, then decode on the device's cache) give the float32
    model's logits up to their rounding: each row's cosine with the CPU fp32 row is above 0.99
    (a wrong kernel, scale or layout gives ~0). Rows are compared while the greedy tokens before
    them agree; int8 rows differ from bf16's (the layers were quantized)."""
    path = str(model_factory("tiny-llama"))
    ref_tokens, ref_rows = greedy_rows(
        Engine(path, devices=["cpu"], dtype="float32", kv_budget_bytes=4 << 20), 8
    )
    got = {}
    for quant in (False, True):
        eng = Engine(path, devices=["cuda:0"], dtype="bfloat16", kv_budget_bytes=4 << 20, quantize=quant)
        tokens, rows = got[quant] = greedy_rows(eng, 8)
        for rid, want in ref_tokens.items():
            assert len(tokens[rid]) == len(rows[rid]) == 8
            same = next((k for k, (a, b) in enumerate(zip(want, tokens[rid])) if a != b), len(want) - 1)
            for k in range(same + 1):  # row k saw the same tokens before it as the reference's
                cos = float(torch.nn.functional.cosine_similarity(rows[rid][k], ref_rows[rid][k], dim=0))
                assert cos > 0.99, (quant, rid, k, cos)
    assert any(not torch.equal(a, b) for a, b in zip(got[False][1]["p0"], got[True][1]["p0"]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_layers_split_across_two_dies(model_factory):
    path = str(model_factory("tiny-llama", dtype="float32"))
    one = Engine(path, devices=["cuda:0"], dtype="float32", kv_budget_bytes=4 << 20)
    two = Engine(path, devices=["cuda:0", "cuda:1"], dtype="float32", kv_budget_bytes=4 << 20)
    assert {d.index for d in two.model.layer_devices} == {0, 1}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert run(one, greedy) == run(two, greedy)


def test_grammar_masks_on_cuda_match_cpu(model_factory):
    """The bitmask is computed on the host and applied on the device: constrained greedy tokens
    on cuda:0 match the regex, as they do on the CPU."""
    import re

    from tokenizers import Tokenizer

    from pantheon.api import structured

    path = str(model_factory("tiny-llama", dtype="float32"))
    grammar = structured.regex_grammar("[0-9]{3}-[a-z]{2,4}", "r")
    params = SamplingParams(temperature=0.0, max_tokens=30, grammar=grammar)
    got = {}
    for dev in ("cpu", "cuda:0"):
        got[dev] = run(Engine(path, devices=[dev], dtype="float32", kv_budget_bytes=4 << 20), params)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    for dev in got:
        for ids in got[dev].values():
            assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", tok.decode(ids, skip_special_tokens=True)), dev
