"""The e2e modules that serve one model and look at what one format or one kind of layer does
with it: a module fixture's server (``served``), a copy of a model with another chat template
(``with_template``), the same request whole and streamed (``ask_both``, ``streamed_call``), and
the sliding-window models' checks (``LONG``, ``stream_past_the_window``, ``reuses_its_prefix``,
``booking``): tests/e2e/test_families_serve.py, test_gemma4_chat.py, test_harmony_serve.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pantheon.core.sizing import Estimate, estimate, read_shape

from helpers.serve import Server


def served(args: list[str], log: Path, names: tuple[str, ...]) -> Iterator[Server]:
    """A module fixture's body: ``pantheon serve ARGS`` until every one of ``names`` is ready,
    yielded, then stopped."""
    s = Server(args, log)
    try:
        s.wait_ready(names)
        yield s
    finally:
        s.stop()


def with_template(model: Path, folder: Path, template: str, ordinary: tuple[str, ...] = ()) -> Path:
    """A copy of ``model`` at ``folder`` whose chat template is ``template`` (the tokenizer
    config's own removed), with the added tokens ``ordinary`` made not special (so a byte-level
    grammar can spell them and the detokenizer keeps them)."""
    shutil.copytree(model, folder)
    for name, key in (("tokenizer_config.json", None), ("tokenizer.json", "added_tokens")):
        if key is not None and not ordinary:
            continue  # nothing to change in it
        raw = json.loads((folder / name).read_text())
        if key is None:
            raw.pop("chat_template", None)
            tokens = raw.get("added_tokens_decoder", {}).values()
        else:
            tokens = raw[key]
        for t in tokens:
            t["special"] = t["special"] and t["content"] not in ordinary
        (folder / name).write_text(json.dumps(raw))
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


def ask_both(srv: Server, model: str, messages: list[dict], text: str, **kw: Any):
    """The same request, its output forced (``guided_choice``) to ``text``, whole and streamed:
    (message, finish_reason, the stream joined: reasoning_content, content, calls, finish)."""
    client = srv.client()
    body = dict(
        model=model, messages=messages, extra_body={"guided_choice": [text]}, **{"max_tokens": 200, **kw}
    )
    whole = client.chat.completions.create(**body)
    (choice,) = whole.choices
    streamed: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": {}, "finish": None}
    for chunk in client.chat.completions.create(stream=True, **body):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = streamed["calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function and tc.function.name) or ""
                call["arguments"] += (tc.function and tc.function.arguments) or ""
            streamed["finish"] = ch.finish_reason or streamed["finish"]
    return choice.message, choice.finish_reason, streamed


def streamed_call(srv: Server, body: dict) -> dict[str, str]:
    """The streamed answer of ``body`` as one call: its name and its arguments, joined."""
    streamed = {"name": "", "arguments": ""}
    for chunk in srv.client().chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                streamed["name"] += (tc.function and tc.function.name) or ""
                streamed["arguments"] += (tc.function and tc.function.arguments) or ""
    return streamed


# ---------------------------------------------------------------- sliding-window models

# ~60 tokens of text: with the template's markers, well past a 16-token window
LONG = [
    {
        "role": "system",
        "content": "You answer in one short sentence about the weather in the city you are asked about.",
    },
    {
        "role": "user",
        "content": "What is the weather like in Paris today, and should I take an umbrella "
        "when I walk along the river to the museum this afternoon?",
    },
]


def booking(
    srv: Server, path: Path, die: str = "cpu:0", name: str | None = None
) -> tuple[dict, dict, Estimate]:
    """The served instance on ``die`` (from /admin/dies; the one named ``name`` where the die
    holds several), what it booked there, and the router's estimate of the model at ``path``
    with the CPU path the worker chose."""
    d = {x["die"]: x for x in httpx.get(srv.url + "/admin/dies", timeout=10).json()["data"]}[die]
    (inst,) = [i for i in d["instances"] if name is None or i["name"] == name]
    est = estimate(read_shape(path), cpu_path=inst.get("cpu_path") or "fp32")
    return inst, d["bookings"][inst["instance"]], est


def stream_past_the_window(srv: Server, model: str) -> None:
    """A chat past the window: its stream says what the whole answer says, with the same usage."""
    c = srv.client()
    kw = dict(model=model, messages=LONG, max_tokens=10, seed=3, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    ch = whole.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    assert whole.usage.prompt_tokens > 3 * 16  # the window is passed in prefill and decode
    chunks = list(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})  # pyright: ignore[reportCallIssue, reportArgumentType]
    )
    content = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    finishes = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert finishes == ["length"] and content == (ch.message.content or "")
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    # the stream came second: it went through the prefix the whole answer cached
    assert usage.prompt_tokens_details is not None and (usage.prompt_tokens_details.cached_tokens or 0) > 16


def reuses_its_prefix(srv: Server, model: str) -> None:
    """A repeated conversation reuses its cached blocks (past the window: the rings'
    checkpoint too) and writes the same seeded answer."""
    c = srv.client()
    kw = dict(model=model, messages=LONG, max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    first = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    again = c.chat.completions.create(**kw)  # pyright: ignore[reportCallIssue, reportArgumentType]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 16
    assert again.choices[0].message.content == first.choices[0].message.content
