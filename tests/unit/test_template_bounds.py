"""Chat template renders run under bounds (time, size, range, nesting, output): a pathological
template is refused quickly with a message naming it and the bound, and real templates render
exactly as they did in the unbounded sandbox."""

from __future__ import annotations

import sys
import threading
import time
import tracemalloc

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pantheon.chat import template as T
from pantheon.chat.template import ChatTemplate, TemplateBoundError, TemplateError, normalize_messages

from helpers.paths import SPECS, need_specs

MSGS = [{"role": "user", "content": "hi"}]

BAD = {
    "nested range": (
        "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        "time",
    ),
    "loop over a string, no calls": (
        "{% set s = 'x' * 5000 %}{% for a in s %}{% for b in s %}{% for c in s %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "time",
    ),
    "huge range": ("{% for i in range(100000) %}{% endfor %}", "range"),
    "string repetition": ("{{ 'x' * 200000000 }}", "size"),
    "list repetition": ("{{ ([1] * 300000000) | length }}", "size"),
    "concatenation doubling": (
        "{% set s = 'x' * 100000 %}{% set s = s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s %}{{ s }}",
        "size",
    ),
    "plus doubling": (
        "{% set ns = namespace(s='x' * 1000) %}{% for i in range(30) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
        "size",
    ),
    "huge output via loops": ("{% for i in range(10000) %}{{ 'y' * 1000 }}{% endfor %}", "output"),
    "macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nesting"),
    "center filter": ("{{ 'x' | center(200000000) }}", "size"),
    "percent width": ("{{ '%200000000s' % 'x' }}", "size"),
    "format width": ("{{ '{:200000000}'.format('x') }}", "size"),
    "replace blowup": ("{% set s = 'x' * 10000 %}{{ s.replace('', s) | length }}", "size"),
    "huge power": ("{{ (7 ** 100000000) | string | length }}", "size"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_pathological_template_is_refused_quickly(name):
    source, bound = BAD[name]
    t = ChatTemplate(source, name="the chat template of bad-model")
    start, cpu = time.monotonic(), time.thread_time()
    with pytest.raises(TemplateBoundError) as info:
        t.render(MSGS)
    took, cpu = time.monotonic() - start, time.thread_time() - cpu
    assert info.value.bound == bound, info.value.message
    assert info.value.message.startswith(f"the chat template of bad-model exceeded its {bound} bound"), (
        info.value.message
    )
    if bound == "time":
        assert took < T.RENDER_TIMEOUT_S + 0.5, took  # the watchdog's deadline, on the wall clock
    else:
        # refused by a check, not by waiting for the deadline: the render's own CPU time (the
        # rendering thread's; in a full CI run the wall clock once read 1.1 s for a 0.15 s render)
        assert cpu < 0.3, cpu


def test_a_huge_literal_is_refused_without_allocating_it():
    tracemalloc.start()
    try:
        t = ChatTemplate("{{ 'x' * 200000000 }}")  # compiles: the repetition is not folded
        with pytest.raises(TemplateBoundError):
            t.render(MSGS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak


def test_a_filter_is_not_folded_at_compile_time():
    start = time.monotonic()
    t = ChatTemplate("{{ 'x' | center(200000000) }}")
    assert time.monotonic() - start < 0.2
    with pytest.raises(TemplateBoundError):
        t.render(MSGS)


def test_the_load_check_refuses_a_costly_template_and_passes_a_refusing_one():
    with pytest.raises(TemplateBoundError) as info:
        ChatTemplate(BAD["nested range"][0], name="the chat template of m").check_cost()
    assert "the chat template of m exceeded its time bound" in info.value.message
    # under the load bound the output limit is tighter than a request's
    big = "{% for i in range(400) %}{{ 'y' * 1000 }}{% endfor %}"
    assert len(ChatTemplate(big).render(MSGS)) == 400_000
    with pytest.raises(TemplateBoundError):
        ChatTemplate(big).check_cost()
    # a template that refuses the sample conversation is not a costly one
    ChatTemplate("{{ raise_exception('no system role') }}").check_cost()


def test_a_long_conversation_is_not_refused_by_the_size_bounds():
    long = "z" * (3 * T.MAX_OUTPUT_CHARS)
    t = ChatTemplate("{% for m in messages %}{{ m.role + ':' + m.content ~ '\n' }}{% endfor %}")
    assert t.render([{"role": "user", "content": long}]) == f"user:{long}\n"


def test_the_render_budget_is_shared():
    t = ChatTemplate(BAD["nested range"][0])
    start = time.monotonic()
    with T.render_budget(0.2), pytest.raises(TemplateBoundError):
        t.render(MSGS)
    assert time.monotonic() - start < 0.45
    with T.render_budget(0.0), pytest.raises(TemplateBoundError):  # spent: refused at once
        ChatTemplate("ok").render(MSGS)


def test_no_interruption_leaks_after_a_render():
    # renders that end just before their deadline, then plain Python for longer than it: the
    # watchdog must not raise in this thread afterwards
    slow = ChatTemplate("{% for i in range(10000) %}{% for j in range(300) %}{% endfor %}{% endfor %}")
    for _ in range(3):
        try:
            slow.render(MSGS)
        except TemplateBoundError:
            pass
    end = time.monotonic() + T.RENDER_TIMEOUT_S + 0.3
    n = 0
    while time.monotonic() < end:
        n += 1
    assert n > 0


def test_the_watchdog_does_not_fire_while_jinja_handles_a_bound_error(monkeypatch):
    # A hook ends the usual stall with a bound error; Jinja then rewrites the traceback (library
    # code that imports and takes locks). An interruption landing there once left importlib's
    # module lock held and froze the router's shutdown: the hook's error disarms the watchdog.
    fired: list[int] = []
    real = T._interrupt
    monkeypatch.setattr(T, "_interrupt", lambda ident, exc: (exc and fired.append(ident), real(ident, exc)))
    handle = jinja2.Environment.handle_exception

    def slow_handle(self, source=None):
        time.sleep(3 * T.WATCHDOG_GRACE_S)  # a loaded machine: handling outlasts the grace
        return handle(self, source)

    monkeypatch.setattr(jinja2.Environment, "handle_exception", slow_handle)
    with pytest.raises(TemplateBoundError) as info:
        ChatTemplate(BAD["nested range"][0]).render(MSGS)
    assert info.value.bound == "time"
    assert fired == []
    assert "jinja2.debug" in sys.modules  # what handle_exception imports is imported already


def test_a_render_in_a_thread_leaves_the_main_thread_live():
    t = ChatTemplate(BAD["loop over a string, no calls"][0])
    errors: list[BaseException] = []

    def run():
        try:
            t.render(MSGS)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    ticks, start = 0, time.monotonic()
    while th.is_alive() and time.monotonic() - start < 5:
        time.sleep(0.01)
        ticks += 1
    th.join(5)
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], TemplateBoundError), errors
    assert ticks >= 10  # the main thread kept running while it rendered


# ------------------------------------------------------------------ real templates, unchanged


def _old_env():
    """The sandbox as it was before the bounds (transformers' own)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[T._GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = T._tojson
    env.globals["raise_exception"] = T._raise_exception
    env.globals["strftime_now"] = T._strftime_now
    env.globals["dict"] = T._TemplateDict()
    env.globals["namespace"] = T._TemplateNamespace
    return env


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said sunny."},
        {"role": "user", "content": "x" * 5000},
    ],
]


@pytest.mark.parametrize(
    "path", sorted(SPECS.glob("*.jinja")) if SPECS.is_dir() else [], ids=lambda p: p.name
)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_real_templates_render_exactly_as_before(path, tools, conv):
    need_specs()
    source = path.read_text(encoding="utf-8")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    msgs = CONVERSATIONS[conv]
    try:
        expected = (
            _old_env()
            .from_string(source)
            .render(
                messages=normalize_messages(msgs),
                tools=tools,
                documents=None,
                add_generation_prompt=True,
                **tokens,
            )
        )
    except Exception as exc:  # noqa: BLE001
        with pytest.raises(TemplateError):
            ChatTemplate(source, special_tokens=tokens).render(msgs, tools=tools)
        pytest.skip(f"the template refuses this conversation: {exc}")
    got = ChatTemplate(source, special_tokens=tokens).render(msgs, tools=tools)
    assert got == expected
    ChatTemplate(source, special_tokens=tokens).check_cost()


def test_the_specs_are_there():
    assert len(list(need_specs().glob("*.jinja"))) >= 5


def test_a_folder_template_is_named_by_its_folder_and_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "' + BAD["huge range"][0] + '", "eos_token": "</s>", "pad_token": "<pad>"}'
    )
    t = ChatTemplate.from_model_dir(tmp_path)
    assert t.name == f"the chat template of {tmp_path.name} (tokenizer_config.json)"
    with pytest.raises(TemplateBoundError) as info:
        t.render(MSGS)
    assert info.value.message.startswith(
        f"the chat template of {tmp_path.name} (tokenizer_config.json) exceeded"
    )
