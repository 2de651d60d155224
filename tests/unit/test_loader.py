"""Every loader error names the file and the field or tensor at fault."""

from __future__ import annotations

import json
import shutil
import struct
import weakref

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine
from workers.errors import LoadError
from workers.loader import load_model


@pytest.fixture
def folder(model_factory, tmp_path):
    """A private copy of tiny-llama that a test may damage."""
    dst = tmp_path / "m"
    shutil.copytree(model_factory("tiny-llama"), dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def load_error(folder) -> LoadError:
    with pytest.raises(LoadError) as e:
        load_model(folder)
    return e.value


def test_missing_folder(tmp_path):
    err = load_error(tmp_path / "nope")
    assert err.kind == "not_found" and "nope" in err.reason


def test_missing_config(folder):
    (folder / "config.json").unlink()
    err = load_error(folder)
    assert err.kind == "not_found" and "config.json" in err.reason


def test_config_not_json(folder):
    (folder / "config.json").write_text("{not json")
    err = load_error(folder)
    assert err.kind == "invalid" and "config.json" in err.reason


def test_unsupported_architecture(folder):
    edit_config(folder, architectures=["MambaForCausalLM"])
    err = load_error(folder)
    assert err.kind == "unsupported" and "architectures" in err.reason and "MambaForCausalLM" in err.reason


def test_missing_field(folder):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    err = load_error(folder)
    assert err.kind == "invalid" and "hidden_size" in err.reason


def test_unknown_rope_type(folder):
    edit_config(folder, rope_scaling={"rope_type": "wobbly", "factor": 2.0})
    err = load_error(folder)
    assert err.kind == "unsupported" and "wobbly" in err.reason


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    err = load_error(folder)
    assert err.kind == "not_found" and "safetensors" in err.reason


def test_pickle_weights_are_never_loaded(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    err = load_error(folder)
    assert err.kind == "not_found" and "pytorch_model.bin" in err.reason and "pickle" in err.reason


def test_wrong_shape(folder):
    edit_config(folder, intermediate_size=96)  # the checkpoint has another size
    err = load_error(folder)
    assert err.kind == "invalid" and "model.safetensors" in err.reason and "mlp." in err.reason
    assert "shape" in err.reason


def test_truncated_file(folder):
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    err = load_error(folder)
    assert err.kind == "invalid" and "model.safetensors" in err.reason and "truncated" in err.reason


def test_tiny_file(folder):
    (folder / "model.safetensors").write_bytes(b"\x01\x02")
    err = load_error(folder)
    assert err.kind == "invalid" and "truncated" in err.reason


def test_corrupt_header(folder):
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + n] = b"\xff" * n
    f.write_bytes(bytes(data))
    err = load_error(folder)
    assert err.kind == "invalid" and "model.safetensors" in err.reason and "header" in err.reason


def test_missing_tensor(folder):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    err = load_error(folder)
    assert err.kind == "invalid" and "model.layers.1.mlp.down_proj.weight" in err.reason


def test_missing_lm_head_is_tied(folder):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["lm_head.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    model, _ = load_model(folder)
    assert model.lm_head is None and model.head_weight() is model.embed_tokens.weight


def test_sharded_checkpoint_loads_the_same(model_factory):
    one = model_factory("tiny-llama", dtype="float32")
    sharded = model_factory("tiny-llama", dtype="float32", shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, _ = load_model(one)
    b, _ = load_model(sharded)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_missing_shard(model_factory, tmp_path):
    dst = tmp_path / "s"
    shutil.copytree(model_factory("tiny-llama", dtype="float32", shard_bytes=200_000), dst)
    next(dst.glob("model-00002-*.safetensors")).unlink()
    err = load_error(dst)
    assert err.kind == "not_found" and "model-00002" in err.reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtypes(model_factory, dtype):
    eng = Engine(str(model_factory("tiny-llama")), dtype=dtype, kv_budget_bytes=1 << 20)
    # CPU paths have no fp16 kernels (fp16 matmuls are slow on CPUs): float16 runs as bf16
    want = "bfloat16" if dtype == "float16" else dtype
    assert eng.model.embed_tokens.weight.dtype == getattr(torch, want)
    eng.submit("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    n = 0
    while eng.has_work():
        n += len(eng.step())
    assert n == 3


def test_weights_fill_without_a_second_copy(model_factory):
    """Parameters are filled in place: no parameter is left on the meta device or uninitialised."""
    model, cfg = load_model(model_factory("tiny"))
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-moe"])
def test_each_layer_is_handed_over_once_when_whole(model_factory, preset):
    """``on_layer`` gets each decoder layer once, when every tensor of it is in (a mixture of
    experts' experts included: each fills a view of its stack), in file order: what it sees is
    what the finished load holds."""
    path = model_factory(preset, dtype="float32")
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(i: int, layer: torch.nn.Module) -> None:
        assert i not in seen
        seen[i] = {n: t.clone() for n, t in layer.state_dict().items()}

    _model, cfg = load_model(path, on_layer=on_layer)
    ref, _ = load_model(path)
    assert list(seen) == list(range(cfg.num_layers))
    for i, layer in enumerate(ref.layers):
        want = layer.state_dict()
        assert seen[i].keys() == want.keys()
        for n, t in want.items():
            assert torch.equal(seen[i][n], t), (i, n)


def test_a_layer_laid_out_during_the_load_frees_its_weights_at_once(model_factory):
    """The loader keeps no reference to a layer's parameters once ``on_layer`` has had it: a CPU
    path laying the layer out there frees its weights in the load's dtype before the next layer
    is read (a load's peak is then one layer's weights in that dtype, not the model's)."""
    from workers import cpu_paths

    path = model_factory("tiny", dtype="float32")
    old: list[weakref.ref[torch.Tensor]] = []

    def on_layer(i: int, layer: torch.nn.Module) -> None:
        if old:
            assert old[-1]() is None, f"layer {i - 1}'s weight outlived its layout"
        lin = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))
        old.append(weakref.ref(lin.weight))
        cpu_paths.lay_out(layer, "int8")

    model, cfg = load_model(path, on_layer=on_layer)
    assert len(old) == cfg.num_layers and old[-1]() is None
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.layers for m in layer.modules())


def _quantized_experts(model: torch.nn.Module) -> list[torch.Tensor]:
    from workers.layers.moe import MoE

    out = []
    for m in model.modules():
        if isinstance(m, MoE):
            for q in (m.gate_up_laid_out, m.down_laid_out):
                out += [q.weight, q.scales]
    return out


@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_experts_are_quantized_as_their_pieces_arrive(model_factory, layout):
    """``experts``: a CPU layer's routed experts go into their int8 / int4 stacks a piece at a
    time as the checkpoint's per-expert tensors arrive, the stacked weights in the load's dtype
    never made (each layer handed over with its stacks empty and already filled); the stacks hold
    the very levels and scales that quantizing the loaded stacks gives."""
    from workers import cpu_paths
    from workers.layers.moe import MoE

    if why := cpu_paths.probe(layout):
        pytest.skip(why)
    path = model_factory("tiny-qwen3-moe", dtype="float32")
    handed: list[int] = []

    def on_layer(i: int, layer: torch.nn.Module) -> None:
        for m in layer.modules():
            if isinstance(m, MoE):
                assert m.receiving == layout and m.gate_up.numel() == 0 and m.down.numel() == 0
                handed.append(i)
        cpu_paths.lay_out(layer, layout)

    model, cfg = load_model(path, dtype="float32", on_layer=on_layer, experts=layout)
    ref, _ = load_model(path, dtype="float32")
    cpu_paths.apply(ref, layout)
    assert handed == list(range(cfg.num_layers))
    got, want = _quantized_experts(model), _quantized_experts(ref)
    assert len(got) == len(want) == 4 * cfg.num_layers
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_experts_filled_as_whole_stacks_are_quantized_once_loaded(model_factory):
    """A checkpoint that stores a layer's experts as one stacked tensor (Gemma 4's) cannot be taken
    a piece at a time: those stacks are loaded as before and quantized once loaded."""
    from workers import cpu_paths
    from workers.layers.moe import MoE

    path = model_factory("tiny-gemma4-moe", dtype="float32")
    model, cfg = load_model(path, dtype="float32", experts="int8")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.receiving is None and m.gate_up.numel() for m in moes)
    ref, _ = load_model(path, dtype="float32")
    for m in (model, ref):
        cpu_paths.apply(m, "int8", None)
    for a, b in zip(_quantized_experts(model), _quantized_experts(ref), strict=True):
        assert torch.equal(a, b)


def test_parameters_get_storage_on_their_die_and_shared_ones_stay_shared():
    """``_allocate``: every meta parameter and buffer gets uninitialised storage of its shape,
    strides and dtype on the die, a parameter keeps ``requires_grad``, and one held by two
    modules (a tied head) is still one tensor."""
    from workers.loader import _allocate

    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
        m[1].weight = m[0].weight  # tied
        m.register_buffer("steps", torch.empty(3, 2).t())  # a strided buffer
        m[1].bias.requires_grad_(False)
    _allocate(m, torch.device("cpu"))
    assert m[1].weight is m[0].weight and isinstance(m[0].weight, torch.nn.Parameter)
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        assert t.device.type == "cpu", name
    assert m[0].weight.shape == (10, 4) and m[0].weight.requires_grad and not m[1].bias.requires_grad
    assert m.steps.shape == (2, 3) and m.steps.stride() == (1, 2)
