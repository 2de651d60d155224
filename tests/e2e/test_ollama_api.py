"""End to end: Ollama's API (``/api/*``) on a real ``pantheon serve``, through the official
``ollama`` client (its pydantic types read every answer), with raw httpx where the client cannot
say it (``tool_choice``, an unknown route). One module-scoped server, the ``tiny`` preset (a
Qwen3-shaped reasoning model with tools in its template) on one CPU die; the ``openai`` client
works on the same server.

A random-weight model says nothing useful, so answers are checked for their shape, counts and
constraints: a JSON schema's output validates, a forced tool call (``tool_choice``, our
extension) has object arguments from an ``enum``. Unloading with ``keep_alive: 0`` needs the
residency (issue 24) and is expected to fail until it lands; it runs last, since it unloads the
module's model.
"""

from __future__ import annotations

import time

import httpx
import ollama
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers.serve import MSG, Server

pytestmark = pytest.mark.timeout(120)

FEW = {"num_predict": 6, "seed": 1}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,  # else the grammar lets a random model add keys
        },
    },
}


@pytest.fixture(scope="module")
def srv(model_factory, tmp_path_factory):
    tiny = model_factory("tiny")
    log = tmp_path_factory.mktemp("ollama-logs") / "serve.log"
    server = Server(["--model", str(tiny), "--name", "tiny", "--dies", "cpu:0", "--cpu-dies", "1"], log)
    try:
        server.wait_ready(("tiny",))
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60)


def test_version_tags_ps_and_show(client, srv):
    assert httpx.get(srv.url + "/api/version").json()["version"].count(".") == 2
    (m,) = client.list().models
    assert m.model == "tiny" and m.size and m.size > 0 and m.digest and len(m.digest) == 64
    assert m.details and m.details.family == "qwen3" and m.details.format == "safetensors"
    assert m.details.quantization_level == "BF16" and m.details.parameter_size == "332K"
    (p,) = client.ps().models
    assert p.model == "tiny" and p.size and p.size > 0 and p.size_vram == 0  # a CPU die
    assert p.context_length == 4096 and p.expires_at is not None and p.digest == m.digest
    s = client.show("tiny")
    assert s.capabilities == ["completion", "tools", "thinking"]
    assert s.modelinfo and s.modelinfo["general.architecture"] == "qwen3"
    assert s.modelinfo["qwen3.context_length"] == 4096 and s.modelinfo["general.parameter_count"] == 332160
    assert s.template and "<|im_start|>" in s.template and s.details and s.details.family == "qwen3"
    assert client.show("tiny:latest").modelinfo == s.modelinfo  # Ollama's default tag


def test_chat_streamed_and_not(client):
    parts = list(client.chat(model="tiny", messages=MSG, stream=True, options=FEW))
    *middle, last = parts
    assert middle and all(not p.done and p.message.role == "assistant" for p in middle)
    assert last.done and last.done_reason == "length" and last.eval_count == 6
    assert last.prompt_eval_count and last.prompt_eval_count > 5
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[k], int) and last[k] > 0, k
    assert last.total_duration >= last.eval_duration + last.prompt_eval_duration
    r = client.chat(model="tiny", messages=MSG, think=False, options={**FEW, "temperature": 0})
    assert r.done and r.done_reason == "length" and r.eval_count == 6 and r.message.content is not None
    assert r.prompt_eval_count > last.prompt_eval_count  # think=False: an empty <think></think> block


def test_generate_templated_and_raw(client):
    g = client.generate(model="tiny", prompt="Say something.", system="Be brief.", options=FEW)
    assert g.done and g.done_reason == "length" and g.eval_count == 6 and g.response is not None
    parts = list(
        client.generate(model="tiny", prompt="<|im_start|>user\nhi", raw=True, stream=True, options=FEW)
    )
    assert parts[-1].done and parts[-1].eval_count == 6 and parts[-1].context is None
    assert "".join(p.response or "" for p in parts)
    lp = client.generate(model="tiny", prompt="x", raw=True, logprobs=True, top_logprobs=2, options=FEW)
    assert lp.logprobs and len(lp.logprobs) == 6 and len(lp.logprobs[0].top_logprobs or []) == 2


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, or a random model adds keys

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def test_structured_output_follows_the_schema(client):
    r = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "A pet, as JSON."}],
        format=Pet.model_json_schema(),
        think=False,
        options={"num_predict": 64, "seed": 2},
    )
    assert r.done_reason == "stop", r.message.content
    Pet.model_validate_json(r.message.content or "")


def test_tools_forced_auto_and_a_round_trip(client, srv):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",  # our extension: a random model calls only when made to
        "stream": False,
        "options": {"num_predict": 40},
    }
    r = ollama.ChatResponse(**httpx.post(srv.url + "/api/chat", json=body, timeout=60).json())
    (call,) = r.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments["city"] in ("Paris", "Rome")
    lines = httpx.post(srv.url + "/api/chat", json={**body, "stream": True}, timeout=60).text.splitlines()
    chunks = [ollama.ChatResponse.model_validate_json(x) for x in lines]
    calls = [c for ch in chunks for c in ch.message.tool_calls or []]
    assert len(calls) == 1 and dict(calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert chunks[-1].done and chunks[-1].done_reason == "stop"

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
          city: the city's name
        """
        return "sunny"

    auto = client.chat(model="tiny", messages=body["messages"], tools=[get_weather], options=FEW)
    for c in auto.message.tool_calls or []:  # a random model may or may not call
        assert isinstance(c.function.arguments, dict)
    convo = [
        *body["messages"],
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]  # fmt: skip
    done = client.chat(model="tiny", messages=convo, tools=[get_weather], think=False, options=FEW)
    assert done.done and done.prompt_eval_count and done.prompt_eval_count > r.prompt_eval_count


def test_errors_in_ollamas_shape(client, srv):
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404 and 'model "no-such-model" not found' in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 501 and "--models-dir" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("tiny")
    assert e.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as e:  # a streamed request refused before it starts
        list(client.chat(model="tiny", messages=MSG, stream=True, options={"temperature": 9}))
    assert e.value.status_code == 400 and "'options.temperature'" in e.value.error
    r = httpx.get(srv.url + "/api/embed")
    assert r.status_code == 404 and list(r.json()) == ["error"]
    r = httpx.post(srv.url + "/api/chat", content=b"{nope")
    assert r.status_code == 400 and list(r.json()) == ["error"]


def test_an_empty_conversation_loads_and_openai_still_works(client, srv):
    r = client.chat(model="tiny", messages=[], keep_alive="10m")
    assert r.done and r.done_reason == "load" and r.message.content == ""
    g = client.generate(model="tiny", prompt="")
    assert g.done and g.done_reason == "load"
    oa = srv.client()
    c = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
    assert c.choices[0].finish_reason == "length" and c.usage and c.usage.completion_tokens == 3
    assert [m.id for m in oa.models.list().data] == ["tiny"]


def test_keep_alive_zero_unloads(client):  # last: it unloads the module's model
    r = client.chat(model="tiny", messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"
    deadline = time.monotonic() + 3
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.ps().models == []
