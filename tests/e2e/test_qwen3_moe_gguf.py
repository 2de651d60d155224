"""Qwen3-MoE GGUF files written by llama.cpp's own converter load as the model of their source folder.

The random-weight ``tiny-qwen3-moe`` folder (Hub layout: per-expert tensors) is converted by the
real ``convert_hf_to_gguf.py`` (``helpers.llama_convert``) to ``qwen3moe`` files: f32 (the
experts merged into ``ffn_{gate,up,down}_exps``) and q8_0 (its ``--fuse-gate-up-exps`` is refused
for ``qwen3moe``). The engine splits the merged tensors back into its stacked experts
(``workers.models.qwen3_moe.unstack``); checked by the description, every tensor and the logits.
Two conversions of ~5 s each, once per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pantheon.core.gguf import read_gguf
from workers import cpu_paths
from workers.engine import Engine
from workers.gguf_blocks import Unpacked, dequantize
from workers.gguf_weights import iter_tensors, open_data, raw_bytes
from workers.layers.block_embedding import BlockEmbedding
from workers.layers.moe import MoE
from workers.loader import load_model
from workers.model_config import load_config
from workers.models import qwen3_moe
from workers.quant import Int8Linear

from helpers.engines import Engines
from helpers.engines import greedy as greedy_logits
from helpers.llama_convert import convert

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88]
F32 = ("f32", ())
Q8_0 = ("q8_0", ())
F32_TOL = 1e-5
Q8_0_LOGIT_TOL = 0.05  # as test_qwen35_gguf: Q8_0 moves the tiny model's logits by ~0.006


@pytest.fixture(scope="module")
def folder(model_factory) -> Path:
    return model_factory("tiny-qwen3-moe", dtype="float32")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3moe-gguf")
    done: dict[tuple, Path] = {}

    def get(case) -> Path:
        if case not in done:
            outtype, extra = case
            done[case] = convert(folder, out / f"{outtype}.gguf", outtype, extra)
        return done[case]

    return get


engine = Engines()
_close_engines = engine.fixture()


def greedy(eng: Engine, n: int) -> tuple[list[int], torch.Tensor]:
    return greedy_logits(eng, PROMPT, n)


@pytest.mark.slow
def test_description_and_tensors_match_the_folder(folder, files):
    path = files(F32)
    g = read_gguf(path)
    assert g.arch == "qwen3moe"
    for merged in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp"):
        assert f"blk.0.{merged}.weight" in g.tensors
    want, got = load_config(folder), load_config(path)
    for field in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "sparse",
        "layers",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "rope",
    ):
        assert getattr(got, field) == getattr(want, field), field
    # every tensor, the merged experts split back per expert, equals the folder's
    hf = {n: w.float() for n, w in load_file(str(folder / "model.safetensors")).items()}
    seen = set()
    wanted = set(hf) | {n for n in (qwen3_moe.gguf_name(t) for t in g.tensors) if n and qwen3_moe.stacked(n)}
    for _file, label, name, w in iter_tensors(g, got, wanted):
        for piece, t in qwen3_moe.unstack(name, w) if qwen3_moe.stacked(name) else [(name, w)]:
            torch.testing.assert_close(t.float(), hf[piece], rtol=1e-6, atol=1e-6, msg=label)
            seen.add(piece)
    assert seen == set(hf)


@pytest.mark.slow
def test_f32_file_gives_the_folders_logits(folder, files):
    path = files(F32)
    want = engine(folder).prompt_logits(PROMPT)
    got = engine(path).prompt_logits(PROMPT)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < F32_TOL
    got_tokens, got_rows = greedy(engine(path), 8)
    want_tokens, want_rows = greedy(engine(folder), 8)
    assert got_tokens == want_tokens
    assert (got_rows - want_rows).abs().max().item() < F32_TOL


@pytest.mark.slow
def test_q8_0_file_stays_close_to_the_folder(folder, files):
    path = files(Q8_0)
    assert read_gguf(path).tensors["blk.0.ffn_down_exps.weight"].type_name == "Q8_0"
    # stored quantized though its router is F32 (as the converter keeps it): the int8 path alone,
    # the experts in int8 rows of their own levels
    assert load_config(str(path)).quantized_source
    default = Engine(str(path), kv_budget_bytes=1 << 20)  # no dtype asked (the suite's ask fp32)
    assert default.cpu_path == "int8"
    default.close()
    want = engine(folder).prompt_logits(PROMPT)
    got = engine(path).prompt_logits(PROMPT)
    assert (got - want).abs().max().item() < Q8_0_LOGIT_TOL


@pytest.mark.slow
def test_qwen35moe_file_gives_the_folders_logits(model_factory, tmp_path):
    """Qwen3.6-35B-A3B's architecture (``qwen35moe``): tiny-qwen3.5-moe (Hub layout: fused experts,
    shared expert, vision tower and MTP head) converted f32 with ``--no-mtp``: the same logits,
    prefill and decode."""
    src = model_factory("tiny-qwen3.5-moe", dtype="float32")
    path = convert(src, tmp_path / "qwen35moe-f32.gguf", "f32", ("--no-mtp",))
    g = read_gguf(path)
    assert g.arch == "qwen35moe"
    for t in ("ffn_gate_exps", "ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_up_shexp"):
        assert f"blk.0.{t}.weight" in g.tensors, t
    want, got = load_config(src), load_config(path)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "layers", "layer_types"):
        assert getattr(got, field) == getattr(want, field), field
    assert (engine(path).prompt_logits(PROMPT) - engine(src).prompt_logits(PROMPT)).abs().max() < F32_TOL
    got_tokens, got_rows = greedy(engine(path), 8)
    want_tokens, want_rows = greedy(engine(src), 8)
    assert got_tokens == want_tokens
    assert (got_rows - want_rows).abs().max().item() < F32_TOL


@pytest.mark.slow
def test_a_quantized_stack_comes_a_piece_at_a_time_with_the_whole_stacks_values(folder, files):
    """A Q8_0 file's expert stacks reach the loader one expert's piece at a time, unpacked straight
    into their parameters (``Unpacked``: no fp32 copy of a whole stack), each piece holding the
    values the whole stack unpacked at once gives it."""
    path = files(Q8_0)
    g = read_gguf(path)
    cfg = load_config(path)
    data = open_data(g)
    want: dict[str, torch.Tensor] = {}
    for t in g.tensors.values():
        name = qwen3_moe.gguf_name(t.name)
        if name and qwen3_moe.stacked(name):
            assert t.type_name == "Q8_0"
            whole = dequantize(raw_bytes(data, t), t.type_name, t.shape)
            want.update(qwen3_moe.unstack(name, whole))
    wanted = {n for n in (qwen3_moe.gguf_name(t) for t in g.tensors) if n}
    got = 0
    for _file, label, name, src in iter_tensors(g, cfg, wanted, lazy=True):
        if name not in want:
            continue
        assert isinstance(src, Unpacked), label
        into = torch.full(src.shape, float("nan"))
        assert src.into(into)  # (the kernel where it builds, else the torch ops: the same values)
        for t in (src.tensor(), into):
            assert torch.equal(t, want[name]), label
        got += 1
    assert got == len(want) == cfg.num_layers * cfg.num_experts * 3


@pytest.mark.slow
def test_an_untied_quantized_head_is_laid_out_from_its_blocks(files):
    """An untied head stored quantized (this Q8_0 file's ``output.weight``) is held as its blocks
    until the CPU path lays it out (int8 rows made from the blocks: never the whole head in
    fp32), and those rows are the ones the dense head gives."""
    path = files(Q8_0)
    g = read_gguf(path)
    assert g.tensors["output.weight"].type_name == "Q8_0"  # untied, quantized
    cfg = load_config(path)
    held, _ = load_model(path, dtype="float32", embed_blocks=True)
    dense, _ = load_model(path, dtype="float32")
    assert isinstance(held.lm_head, BlockEmbedding) and isinstance(dense.lm_head, torch.nn.Linear)
    assert torch.equal(held.head_weight(), dense.head_weight())
    for m in (held, dense):
        cpu_paths.apply(m, "int8", cfg)
    assert isinstance(held.lm_head, Int8Linear) and isinstance(dense.lm_head, Int8Linear)
    assert torch.equal(held.lm_head.weight, dense.lm_head.weight)
    assert torch.equal(held.lm_head.scale, dense.lm_head.scale)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_a_files_experts_are_quantized_as_their_pieces_arrive(files, layout):
    """The Q8_0 file's expert stacks, unpacked a piece at a time into one expert's scratch and
    quantized there (``load_model(experts=)``), give the stacks that quantizing the whole loaded
    stacks gives, to the bit."""
    if why := cpu_paths.probe(layout):
        pytest.skip(why)
    path = files(Q8_0)
    cfg = load_config(path)
    got, _ = load_model(path, dtype="float32", experts=layout)
    want, _ = load_model(path, dtype="float32")
    for m in (got, want):
        cpu_paths.apply(m, layout, cfg)
    moes = [(a, b) for a, b in zip(got.modules(), want.modules()) if isinstance(a, MoE)]
    assert len(moes) == cfg.num_layers
    for a, b in moes:
        assert isinstance(b, MoE) and a.kernel_glu == b.kernel_glu
        for qa, qb in ((a.gate_up_laid_out, b.gate_up_laid_out), (a.down_laid_out, b.down_laid_out)):
            assert torch.equal(qa.weight, qb.weight) and torch.equal(qa.scales, qb.scales)
