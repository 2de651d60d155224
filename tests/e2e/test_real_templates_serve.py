"""Real chat templates (llama.cpp's ``models/templates``: Llama 3.3's and Mistral Nemo's) through a
real ``pantheon serve`` and the official client: a chat with tools, a tool call and its result is
answered (200), its prompt is exactly the tokens of what transformers renders from the model
folder, and a conversation the template refuses is a 400 carrying the template's own message.

The ``tiny`` model carries each template (``with_template``); the reference is transformers'
``AutoTokenizer`` of that same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from helpers.chat_template import llama_cpp_templates
from helpers.one_model import served, with_template

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "tiny-llama33": "meta-llama-Llama-3.3-70B-Instruct",
    "tiny-mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407",
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city"],
                },
                "days": {"type": "integer"},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "q": {"type": "string"},
                "filters": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}
ARGS = {"location": {"city": "Zürich", "country": "CH"}, "days": 2}
CALL_ID = "a1B2c3D4e"  # 9 alphanumerics, as Mistral's templates demand


def conversation(args) -> list[dict]:
    """System, user, a tool call (``args``: the client's JSON text, or the object transformers
    documents), its result: the model is to answer."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Zürich for two days?"},
        {
            "role": "assistant",
            "content": None if isinstance(args, str) else "",
            "tool_calls": [
                {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": '{"temp_c": 21}'},
    ]


@pytest.fixture(scope="module")
def folders(model_factory, tmp_path_factory) -> dict[str, Path]:
    """Per served name, a copy of ``tiny`` carrying that real template."""
    templates = llama_cpp_templates()
    base = tmp_path_factory.mktemp("real-templates")
    return {
        name: with_template(
            model_factory("tiny"), base / name, (templates / f"{t}.jinja").read_text(encoding="utf-8")
        )
        for name, t in MODELS.items()
    }


@pytest.fixture(scope="module")
def srv(folders, tmp_path_factory):
    args = [a for name, path in folders.items() for a in ("--model", str(path), "--name", name)]
    log = tmp_path_factory.mktemp("real-templates-log") / "serve.log"
    yield from served([*args, "--cpu-dies", "1"], log, tuple(MODELS))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tools_a_call_and_its_result_are_answered_with_transformers_prompt(srv, folders, name):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folders[name]))
    text = tok.apply_chat_template(
        conversation(ARGS), tools=[WEATHER, SEARCH], tokenize=False, add_generation_prompt=True
    )
    want = tok(text, add_special_tokens=False)["input_ids"]

    messages = conversation(json.dumps(ARGS))  # as an OpenAI client sends it
    r = srv.client().chat.completions.create(
        model=name,
        messages=messages,
        tools=[WEATHER, SEARCH],
        max_tokens=4,
    )
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens == len(want)
    got = httpx.post(
        srv.url + "/tokenize",
        json={"model": name, "messages": messages, "tools": [WEATHER, SEARCH]},
        timeout=30,
    )
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == want


def test_a_conversation_the_template_refuses_is_a_400(srv):
    client = srv.client()
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):
        client.chat.completions.create(model="tiny-mistral-nemo", messages=two_users, max_tokens=2)
    openai_ids = [
        {**m, "tool_call_id": "call_1"}
        if m["role"] == "tool"
        else ({**m, "tool_calls": [{**m["tool_calls"][0], "id": "call_1"}]} if "tool_calls" in m else m)
        for m in conversation(json.dumps(ARGS))
    ]
    # OpenAI-style call ids, which Nemo's template refuses (not 9 letters and digits), are
    # renamed by its tool format (toolformats.mistral), so the conversation is served
    r = client.chat.completions.create(
        model="tiny-mistral-nemo",
        messages=openai_ids,
        tools=[WEATHER],
        max_tokens=2,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    two_calls = conversation(json.dumps(ARGS))[:2] + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
                for i in ("a", "b")
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError, match="single tool-calls") as e:
        client.chat.completions.create(model="tiny-llama33", messages=two_calls, max_tokens=2)
    assert e.value.status_code == 400
    # and the server serves on
    r = client.chat.completions.create(model="tiny-llama33", messages=two_users, max_tokens=2)
    assert r.choices[0].message.role == "assistant"
