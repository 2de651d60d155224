"""Llama 3.x's and Mistral's own tool-call formats through a real ``pantheon serve`` and the
official client (``pantheon.chat.toolformats``).

The ``tiny`` model with each family's real chat template (from llama.cpp's tree): under
``auto`` its output is forced (``guided_choice``) to a call in the family's format, which comes
back as ``tool_calls`` (Mistral's with the id the model wrote), streamed and not the same; under
``required`` the grammar makes the model write a call in that same format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.llama_convert import converter_dir
from helpers.one_model import ask_both, with_template
from helpers.serve import Server

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# the same function with its arguments bounded (a random model's free strings, and the extra
# keys a schema allows, run to max_tokens)
PICK = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
FAMILIES = {
    # name: (llama.cpp template, the call as the family writes it, the id it wrote)
    "tiny-llama3": (
        "meta-llama-Llama-3.1-8B-Instruct",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
    ),
    "tiny-mistral": (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1B2c3D4e"}]',
        "a1B2c3D4e",
    ),
}


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    base = tmp_path_factory.mktemp("toolformats")
    templates = Path(converter_dir()) / "models" / "templates"
    models = base / "models"
    models.mkdir()
    for name, (template, _, _) in FAMILIES.items():
        src = (templates / f"{template}.jinja").read_text(encoding="utf-8")
        with_template(model_factory("tiny"), models / name, src)
    server = Server(["--models-dir", str(models)], base / "serve.log")
    try:
        server.wait_ready(None)  # a models-dir model loads on its first request
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_call_in_the_familys_format_is_a_tool_call(srv, name):
    _, text, call_id = FAMILIES[name]
    msg, finish, streamed = ask_both(srv, name, MESSAGES, text, tools=[WEATHER])
    assert not msg.content and msg.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    if call_id is not None:
        assert msg.tool_calls[0].id == call_id
    assert finish == "tool_calls" and streamed["finish"] == "tool_calls"
    assert not streamed["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_required_makes_a_call_in_the_familys_format(srv, name):
    client = srv.client()
    out = client.chat.completions.create(
        model=name, messages=MESSAGES, tools=[PICK], tool_choice="required", max_tokens=100
    )
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    if name == "tiny-mistral":
        assert len(call.id) == 9 and call.id.isalnum()
