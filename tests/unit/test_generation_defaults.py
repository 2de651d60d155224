"""Generation defaults (``pantheon.models.generation_defaults``): a request's unset sampling
fields come from the catalog entry's params, then the model's own (``generation_config.json``,
GGUF ``general.sampling.*``), then OpenAI's; a field the client gave always wins."""

from __future__ import annotations

import json
import logging
import shutil

import msgspec
import pytest

from pantheon import serve as server_cli
from pantheon.api.openai.completions import parse_completion_request
from pantheon.api.openai.protocol import parse_chat_request
from pantheon.config.settings import ConfigError, build_config
from pantheon.control.registry import Instance, Slots
from pantheon.core.gguf import read_gguf
from pantheon.core.request import GenerationRequest
from pantheon.models import generation_defaults as gd
from pantheon.models.assets import ModelAssets

MSG = [{"role": "user", "content": "hi"}]
QWEN3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}


def chat(**fields) -> GenerationRequest:
    return parse_chat_request({"messages": MSG, **fields})


def test_the_openai_layer_is_chat_requests_own_defaults():
    defaults = {f.name: f.default for f in msgspec.structs.fields(GenerationRequest)}
    assert {k: defaults[k] for k in gd.FIELDS} == gd.OPENAI
    assert set(gd.FIELDS) == set(gd.OPENAI)


def test_the_parser_records_which_fields_were_left_out():
    assert chat().unset == frozenset(gd.FIELDS)
    given = chat(temperature=1.0, top_p=1, top_k=-1, repeat_last_n=64, max_completion_tokens=5)
    assert given.unset == {"min_p", "repetition_penalty"}
    assert (given.temperature, given.top_k, given.repetition_window, given.max_tokens) == (1.0, 0, 64, 5)
    # a request built in code has every field as given
    assert GenerationRequest(messages=MSG).unset == frozenset()


def test_entry_params_over_the_model_over_openai():
    req = chat(top_p=0.5)
    defaults = gd.merged({"temperature": 0.2, "min_p": 0.1}, {"temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert defaults == {"temperature": 0.2, "top_k": 20, "top_p": 0.95, "min_p": 0.1}
    gd.apply(req, defaults)
    assert (req.temperature, req.top_k, req.min_p) == (0.2, 20, 0.1)  # layer 1, 2, 1
    assert (req.repetition_penalty, req.repetition_window) == (1.0, 64)  # layer 3
    assert req.top_p == 0.5  # the client's
    p = req.sampling(max_tokens=4, stop_token_ids=[])
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.2, 0.5, 20, 0.1)


def test_an_explicit_openai_value_is_never_replaced():
    req = chat(temperature=1.0, top_k=0, repetition_penalty=1.0)
    gd.apply(req, {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.3, "min_p": 0.05})
    assert (req.temperature, req.top_k, req.repetition_penalty, req.min_p) == (1.0, 0, 1.0, 0.05)


def test_apply_again_for_another_instance_is_exact():
    req = chat(temperature=0.9)
    gd.apply(req, {"temperature": 0.1, "top_k": 20, "min_p": 0.2})
    gd.apply(req, {"top_p": 0.8})  # another replica: what the first set goes back to OpenAI's
    assert (req.temperature, req.top_k, req.min_p, req.top_p) == (0.9, 0, 0.0, 0.8)
    gd.apply(req, {})
    assert req.top_p == 1.0


def test_a_default_max_tokens_is_a_ceiling():
    assert gd.capped(chat(), {"max_tokens": 100}, 40) == 40  # the context leaves 40
    assert gd.capped(chat(), {"max_tokens": 100}, 500) == 100
    assert gd.capped(chat(), {}, 500) == 500
    assert gd.capped(chat(max_tokens=300), {"max_tokens": 100}, 300) == 300  # the client's
    assert gd.ceiling(chat(max_tokens=300), {"max_tokens": 100}) is None
    req = chat()
    gd.apply(req, {"max_tokens": 100})
    assert req.max_tokens is None  # never a reservation: fit_context sees none


def test_completions_leave_max_tokens_unset_for_the_defaults():
    creq = parse_completion_request(json.dumps({"prompt": "a"}))
    assert creq.chat.max_tokens is None and "max_tokens" in creq.chat.unset
    creq = parse_completion_request(json.dumps({"prompt": "a", "max_tokens": 16, "temperature": 1}))
    assert creq.chat.max_tokens == 16 and not {"max_tokens", "temperature"} & creq.chat.unset


def test_generation_config_as_vllm_reads_it(tmp_path):
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({**QWEN3, "do_sample": False, "max_new_tokens": 256, "max_length": 20}))
    # do_sample: false is ignored (as vLLM does); max_new_tokens is max_tokens; max_length is not
    got = gd.from_generation_config(f)
    assert got == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 256}
    assert type(got["top_k"]) is int and type(got["temperature"]) is float
    f.write_text(json.dumps({"top_k": -1, "min_p": None, "repetition_penalty": 1.05, "temperature": 1}))
    assert gd.from_generation_config(f) == {"top_k": 0, "repetition_penalty": 1.05, "temperature": 1.0}


def test_a_broken_or_absent_generation_config_is_no_error(tmp_path, caplog):
    f = tmp_path / "generation_config.json"
    assert gd.from_generation_config(f) == {}
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        for text in ("{not json", "[1, 2]", b"\xff\xfe"):
            caplog.clear()
            f.write_bytes(text if isinstance(text, bytes) else text.encode())
            assert gd.from_generation_config(f) == {}
            assert str(f) in caplog.text, text


def test_values_out_of_range_are_ignored_and_logged(tmp_path, caplog):
    f = tmp_path / "generation_config.json"
    bad = {"temperature": 3.0, "top_p": "0.9", "top_k": 2.5, "min_p": -0.1, "repetition_penalty": 0}
    f.write_text(json.dumps({**bad, "max_new_tokens": 0}))
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        assert gd.from_generation_config(f) == {}
    for key in (*bad, "max_new_tokens"):
        assert f"{key} ignored" in caplog.text
    f.write_text(json.dumps({"temperature": 3.0, "top_p": 0.8}))  # the good ones stay
    assert gd.from_generation_config(f) == {"top_p": 0.8}


def test_gguf_sampling_keys_as_llama_cpp_writes_them(tmp_path, caplog):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_sampling_temp(0.6)
    w.add_sampling_top_p(0.95)
    w.add_sampling_top_k(20)
    w.add_sampling_min_p(0.05)
    w.add_sampling_penalty_repeat(1.1)
    w.add_sampling_penalty_last_n(128)
    w.add_sampling_mirostat(2)  # a sampler this server does not have: not read
    w.add_sampling_sequence("penalties;top_k;top_p;temp")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = read_gguf(path).meta
    assert meta["general.sampling.top_p"] != 0.95  # stored as float32
    assert gd.from_gguf(meta) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "repetition_window": 128,
    }
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        assert gd.from_gguf({"general.sampling.temp": 9.0, "general.sampling.top_k": 40}) == {"top_k": 40}
    assert "general.sampling.temp ignored" in caplog.text


def test_catalog_params_are_checked():
    assert gd.check_params(None) == {}
    assert gd.check_params({"temperature": 1, "top_k": -1, "max_tokens": 64.0}) == {
        "temperature": 1.0,
        "top_k": 0,
        "max_tokens": 64,
    }
    for bad, word in (
        ({"temp": 0.5}, "'temp' is not a sampling default"),
        ({"top_p": 1.5}, "top_p must be >= 0 and <= 1, got 1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"top_k": True}, "top_k must be a number"),
        ({"temperature": float("nan")}, "finite"),
    ):
        with pytest.raises(ValueError, match=word):
            gd.check_params(bad)


def test_start_models_carry_params_and_the_default_model_its_authors_settings():
    cfg = build_config({"models": [{"path": "/m", "params": {"temperature": 0.3, "top_k": 5}}]}, {})
    assert cfg.models[0].params == {"temperature": 0.3, "top_k": 5}
    assert build_config({"models": [{"path": "/m"}]}, {}).models[0].params == {}
    with pytest.raises(ConfigError, match="model m: params: top_p must be"):
        build_config({"models": [{"path": "/m", "params": {"top_p": 2}}]}, {})
    args: dict = {"cpu_dies": 1}
    cfg = server_cli.finalize(build_config(args, {}), args)
    if cfg.models[0].name == server_cli.DEFAULT_MODEL_NAME:
        assert cfg.models[0].params == {"temperature": 0.2, "top_p": 0.9}
    assert server_cli.DEFAULT_MODEL_PARAMS == {"temperature": 0.2, "top_p": 0.9}


def test_an_instance_shows_its_entry_params_over_its_model_files(tiny_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    assets = ModelAssets(folder)
    assert assets.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    inst = Instance(name="m", instance_id="m#1", path=str(folder), dies=("cpu:0",), gate=Slots(1))
    inst.assets, inst.params = assets, {"temperature": 0.2}
    assert gd.in_force(inst) == {"temperature": 0.2, "top_k": 20, "top_p": 0.95}
    (folder / "generation_config.json").unlink()
    assert ModelAssets(folder).generation_defaults == {}
