"""The model's own multi-token-prediction head as its draft (``draft = "mtp"``, workers/mtp.py):
its drafts are vLLM's (against a reference from transformers' modules and the checkpoint's
``mtp.*``, after the prefill and after speculative steps), greedy output is token for token the
output without it, and a checkpoint without a head is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.cpu_pack import weight_bytes
from workers.engine import Engine
from workers.errors import LoadError
from workers.quant import Int4Linear, Int8Linear

from helpers.decode_rows import drain, greedy, seeded_speculation_repeats

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 140)), [7, 7, 7, 7, 8]]


@pytest.fixture(scope="module")
def path(model_factory) -> Path:
    # untied: the random target's next token is not its last one
    return model_factory("tiny-qwen3.5-text", dtype="float32", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine(path):
    return Engine(str(path), dtype="float32", kv_budget_bytes=8 << 20, block_size=4, draft="mtp")


@pytest.fixture(scope="module")
def plain(path):
    return Engine(str(path), dtype="float32", kv_budget_bytes=8 << 20, block_size=4)


def answers(eng: Engine, spec: int, n: int = 24) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        eng.submit(f"p{i}", p, greedy(spec if i != 1 else min(spec, 2), n=n))
    return drain(eng)


def test_drafts_are_the_reference_heads(engine, path):
    """After the prefill (the head fed the prompt's rows) and after speculative steps (fed the
    kept rows of each verify), the head proposes what the reference computes."""
    mtp_ref = pytest.importorskip("helpers.mtp_ref")
    pytest.importorskip("transformers")
    for prompt in PROMPTS[:2]:
        engine.submit("r", prompt, greedy(3, n=30))
        for steps in (1, 4):
            for _ in range(steps):
                engine.step()
            (s,) = engine.scheduler.running()
            engine.draft.propose([(s, 3)])
            assert s.draft == mtp_ref.mtp_drafts(path, list(s.tokens), 3), (prompt, len(s.tokens))
        engine.abort("r")


def test_greedy_output_is_the_output_without_it(engine, plain):
    want = answers(plain, 0)
    before = engine.spec.drafted
    for i, p in enumerate(PROMPTS):  # alone
        engine.submit("a", p, greedy(4, n=24))
        assert drain(engine)["a"] == want[f"p{i}"]
    assert answers(engine, 4) == want  # batched, drafts of 2 and 4
    assert engine.spec.drafted > before
    assert engine.draft_name == "mtp"
    assert engine.request_tables()["sequences"] == 0 and not engine.draft._hidden  # nothing kept


def test_seeded_sampling_repeats_itself(engine):
    seeded_speculation_repeats(engine, PROMPTS[1], PROMPTS[0], 3)


def test_its_weights_and_pool_are_booked(engine, plain, path):
    own = sum(
        t.numel() for n, t in load_file(str(path / "model.safetensors")).items() if n.startswith("mtp.")
    )
    assert engine.weight_bytes - plain.weight_bytes == own * 4  # fp32; embeddings and head shared
    # one budget for both pools, which have the same block count (one block table addresses both)
    assert engine.kv_bytes == engine.runner.kv_bytes + engine.draft.kv_bytes <= 8 << 20
    assert engine.draft.kv_bytes == engine.runner.kv_bytes  # one attention layer each (the model: 1 of 4)


@pytest.fixture(scope="module")
def echo(model_factory, tmp_path_factory) -> Path:
    """The tied tiny model (its greedy answer repeats its last token) with a head whose fc passes
    the token's embedding through (``[I 0]``): it drafts the token it is fed, so its drafts of
    a repetition are accepted."""
    src = model_factory("tiny-qwen3.5-text", dtype="float32")
    dst = tmp_path_factory.mktemp("echo-mtp")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    tensors = load_file(str(dst / "model.safetensors"))
    h = tensors["mtp.fc.weight"].shape[0]
    tensors["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_accepted_drafts_keep_the_output(echo):
    plain = Engine(str(echo), dtype="float32", kv_budget_bytes=8 << 20, block_size=4)
    want = answers(plain, 0)
    eng = Engine(str(echo), dtype="float32", kv_budget_bytes=8 << 20, block_size=4, draft="mtp")
    assert answers(eng, 4) == want
    assert eng.spec.accepted > 0.8 * eng.spec.drafted > 0
    assert eng.spec.emitted > 2 * eng.spec.verify_steps  # several tokens a step


def test_a_model_without_a_head_is_refused(model_factory):
    for preset, kw in (("tiny-qwen3.5-text", {"mtp_num_hidden_layers": 0}), ("tiny-llama", {})):
        with pytest.raises(LoadError, match="no multi-token-prediction head") as e:
            Engine(str(model_factory(preset, **kw)), kv_budget_bytes=4 << 20, draft="mtp")
        assert e.value.kind == "invalid"


def test_bf16_drafts_pick_with_a_4_bit_head(model_factory):
    """On a bf16 CPU path the head picks its drafts with a 4-bit copy of the LM head (int8 rows
    for the tiny vocabulary, which int4 groups do not take), booked with it; the output is the
    model's own."""
    path = model_factory("tiny-qwen3.5-text", tie_word_embeddings=False)  # bf16 weights
    plain = Engine(str(path), kv_budget_bytes=8 << 20, cpu_path="bf16")
    eng = Engine(str(path), kv_budget_bytes=8 << 20, draft="mtp", cpu_path="bf16")
    copy = eng.draft.model.draft_head
    assert isinstance(copy, (Int4Linear, Int8Linear)) and copy.out_features == eng.cfg.vocab_size
    assert eng.draft.weight_bytes == sum(weight_bytes(m) for m in eng.draft.model.own())
    assert weight_bytes(copy) > 0
    want = answers(plain, 0)
    assert answers(eng, 3) == want
    assert eng.spec.drafted > 0
    fp32 = Engine(str(path), dtype="float32", kv_budget_bytes=8 << 20, draft="mtp")
    assert fp32.draft.model.draft_head is None  # the exact paths draft with the model's head


def test_a_mixture_of_experts_head(model_factory):
    """Qwen3.5-MoE's head: its layer's MLP is the family's mixture of experts (experts fused in
    the checkpoint, split as the model's are); the output is the model's own."""
    from workers.layers.moe import MoE

    path = str(model_factory("tiny-qwen3.5-moe", dtype="float32"))
    plain = Engine(path, dtype="float32", kv_budget_bytes=8 << 20)
    eng = Engine(path, dtype="float32", kv_budget_bytes=8 << 20, draft="mtp")
    assert isinstance(eng.draft.model.layers[0].mlp, MoE)
    assert answers(eng, 3) == answers(plain, 0)
    assert eng.spec.drafted > 0
