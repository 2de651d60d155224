"""Chat prompt rendering, exactly as ``transformers`` renders it.

A model folder's Jinja chat template is rendered in the same sandbox, with the same globals and
filters, as ``PreTrainedTokenizerBase.apply_chat_template(tokenize=False)`` (transformers 5.x,
``transformers/utils/chat_template_utils.py``), so the prompt a model sees here is byte for byte the
prompt it was trained and evaluated with. Before rendering, OpenAI-style messages are normalised into
the shape Hugging Face templates expect (see :func:`normalize_messages`).

A folder without a template falls back to the spec's ChatML prompt (:func:`render_chatml`).

This module is pure Python (jinja2 only): the router imports it, and the router never imports torch.

Why one module of ~500 lines: it mirrors one thing, transformers' template environment (the
sandbox, its globals and filters, the ``{% generation %}`` tag, the message normalisation and the
ChatML fallback), and those parts change together when transformers changes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tools import tool_call_format

__all__ = [
    "ChatTemplate",
    "TemplateError",
    "normalize_messages",
    "render_chatml",
    "think_open",
]

THINK_OPEN = "<think>"

# Names transformers passes to every template from ``tokenizer.special_tokens_map``
# (``SPECIAL_TOKENS_ATTRIBUTES``), when the tokenizer has them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Variables the renderer sets itself; a client's chat_template_kwargs may not replace them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# The names a message's reasoning may come under. transformers copies the first one found into
# ``reasoning_content`` (what most templates read) and ``thinking`` (what gpt-oss templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The conversation cannot be rendered (``raise_exception`` in the template, an undefined value,
    a malformed message, a broken template). The HTTP layer answers it with a 400."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# ------------------------------------------------------------------ the Jinja environment
#
# Everything below mirrors ``_cached_compile_jinja_template`` in transformers.


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes and sorts keys; transformers' does neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without attribute access that could lead out of the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant tokens for
    training masks. Serving only needs the text, so the block renders its body unchanged; without
    the tag such templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_environment()


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


# ------------------------------------------------------------------ OpenAI -> Hugging Face messages


def _text_of(content: Any, where: str) -> Any:
    """OpenAI allows ``content`` as a list of parts; templates want one string.

    Text parts are joined with a newline (as vLLM does). Any other part type (images, audio) is
    refused: no model served here takes them.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, Mapping)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"{where}: content part of type {kind!r} is not supported, only text")
    return "\n".join(texts)


def _normalize_tool_call(call: Any, where: str) -> Any:
    if not isinstance(call, Mapping):
        raise TemplateError(f"{where}: a tool call must be an object")
    call = {k: v for k, v in call.items() if v is not None}
    fn = call.get("function")
    if isinstance(fn, Mapping):
        fn = {k: v for k, v in fn.items() if v is not None}
        args = fn.get("arguments")
        if isinstance(args, str):
            # Qwen-style templates render ``arguments | tojson`` and expect a dict; OpenAI clients send
            # the JSON text. Text that is not JSON is left alone (templates then print it verbatim).
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        call["function"] = fn
    return call


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Turn OpenAI chat messages into the dicts Hugging Face chat templates expect.

    - keys whose value is ``None`` are dropped (as transformers does: templates test for a missing
      key, not for None), except ``content``, which becomes ``""`` (the Qwen3 template crashes on an
      assistant message without content, which OpenAI clients send on tool-call turns);
    - ``content`` given as a list of text parts is joined into one string;
    - an empty ``tool_calls`` list is dropped (Llama 3 templates test ``'tool_calls' in message``);
    - ``tool_calls[].function.arguments`` JSON strings are parsed into dicts;
    - reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is offered to the
      template under the first two names (as transformers does);
    - tool messages keep ``tool_call_id`` and ``name``.

    The input is not modified.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TemplateError("messages must be a list")
    if not messages:
        raise TemplateError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TemplateError(f"{where} must be an object")
        if not isinstance(message.get("role"), str):
            raise TemplateError(f"{where}: missing 'role'")
        msg = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        msg["content"] = _text_of(msg.get("content", ""), where)
        for field in _REASONING_FIELDS:
            if field in msg:
                msg[field] = _text_of(msg[field], where)
        calls = msg.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise TemplateError(f"{where}: tool_calls must be a list")
            if calls:
                msg["tool_calls"] = [
                    _normalize_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
                ]
            else:
                del msg["tool_calls"]
        reasoning = next((msg[f] for f in _REASONING_FIELDS if msg.get(f) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# ------------------------------------------------------------------ the ChatML fallback

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def render_chatml(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning: bool = False,
    enable_thinking: bool | None = None,
) -> str:
    """The spec's built-in prompt for models without a chat template.

    Each turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``. Tool results are wrapped in
    ``<tool_response>`` inside a user turn (consecutive ones share that turn); an assistant's tool
    calls are written as ``<tool_call>`` blocks; tools, when given, are listed in the system turn in
    the Qwen/Hermes form that the emitter's ``<tool_call>`` parser reads back. With
    ``add_generation_prompt`` the assistant turn is opened, and for a reasoning model a ``<think>``
    is opened after it (an empty ``<think>`` block instead when ``enable_thinking`` is False).

    ``messages`` must already be normalised (:func:`normalize_messages`).
    """
    parts: list[str] = []
    rest = list(messages)
    if tools:
        system = ""
        if rest and rest[0].get("role") == "system":
            system = str(rest.pop(0).get("content", "")) + "\n\n"
        listing = "".join("\n" + _tojson(t) for t in tools)
        parts.append(f"<|im_start|>system\n{system}{_TOOLS_PREAMBLE}{listing}{_TOOLS_POSTAMBLE}<|im_end|>\n")
    for i, msg in enumerate(rest):
        role = msg.get("role")
        content = msg.get("content", "")
        content = "" if content is None else str(content)
        if role == "tool":
            if i == 0 or rest[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == len(rest) - 1 or rest[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
            continue
        if role == "assistant" and msg.get("tool_calls"):
            blocks = []
            for call in msg["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = args if isinstance(args, str) else _tojson(args)
                blocks.append(
                    f'<tool_call>\n{{"name": "{fn.get("name", "")}", "arguments": {args}}}\n</tool_call>'
                )
            content = "\n".join([content] + blocks) if content else "\n".join(blocks)
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if reasoning:
            parts.append("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    return "".join(parts)


def think_open(prompt: str) -> bool:
    """True when the prompt ends inside an opened ``<think>`` (the template pre-filled it), so the
    model's first tokens are reasoning. Feed this to ``Emitter(think_open=...)``."""
    return prompt.rstrip().endswith(THINK_OPEN)


# ------------------------------------------------------------------ ChatTemplate


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise TemplateError(f"{path.name} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


class ChatTemplate:
    """A model's chat prompt format.

    ``template`` is the Jinja source (None: the ChatML fallback); ``tool_use_template`` is used
    instead when tools are passed (transformers' ``"tool_use"`` named template). The special tokens
    are offered to the template as ``bos_token``, ``eos_token`` and, through ``special_tokens``,
    any other of transformers' named ones (``pad_token``, ``unk_token``, ...). ``reasoning`` says
    the model thinks in ``<think>`` blocks: it only changes the ChatML fallback, since a real template
    encodes this itself.

    Raises :class:`TemplateError` when a template does not compile.
    """

    def __init__(
        self,
        template: str | None = None,
        *,
        tool_use_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        reasoning: bool = False,
    ):
        self.source = template
        self.tool_use_source = tool_use_template
        self.reasoning = bool(reasoning)
        tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if bos_token is not None:
            tokens["bos_token"] = bos_token
        if eos_token is not None:
            tokens["eos_token"] = eos_token
        self.special_tokens: dict[str, str] = tokens
        self._compiled = _compile(template) if template is not None else None
        self._compiled_tool_use = _compile(tool_use_template) if tool_use_template is not None else None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def tool_format(self) -> str:
        """The format the model writes tool calls in (``"json"`` or ``"xml"``), as the template
        that renders the tools teaches it (see :func:`pantheon.chat.tools.tool_call_format`)."""
        return tool_call_format(self.tool_use_source or self.source)

    @property
    def is_fallback(self) -> bool:
        """True when the model has no template and the ChatML fallback is used."""
        return self._compiled is None and self._compiled_tool_use is None

    @classmethod
    def from_model_dir(cls, path: str | Path, *, reasoning: bool | None = None) -> ChatTemplate:
        """Load the template of a Hugging Face model folder, as transformers finds it.

        Sources, the later winning as in transformers: ``chat_template`` in tokenizer_config.json
        (a string, or a list of ``{name, template}`` of which "default" and "tool_use" are kept),
        ``chat_template.json`` (older processor format), ``chat_template.jinja``, and named templates
        in ``additional_chat_templates/*.jinja``. Special tokens come from tokenizer_config.json.
        ``reasoning`` None means: the tokenizer has a ``<think>`` token.
        """
        folder = Path(path)
        config = _read_json(folder / "tokenizer_config.json")
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = entry["template"]
        legacy = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(legacy, str):
            templates["default"] = legacy
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            for file in sorted(extra.glob("*.jinja")):
                templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")

        # transformers refuses a set of named templates without a "default"; a server should still
        # serve it, so the first one stands in.
        default = templates.get("default")
        if default is None and templates:
            default = next(iter(v for k, v in templates.items() if k != "tool_use"), None)
        tool_use = templates.get("tool_use")

        tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                tokens[name] = text
        if reasoning is None:
            reasoning = _has_think_token(folder, config)
        return cls(default, tool_use_template=tool_use, special_tokens=tokens, reasoning=reasoning)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style ``messages`` into the prompt text.

        ``tools`` are the OpenAI tool definitions, passed to the template unchanged (None: no
        tools). ``template_kwargs`` are the request's ``chat_template_kwargs`` (``enable_thinking``
        and the like); they may override the special tokens but not the four names the renderer
        sets itself. The result is meant to be tokenized without adding special tokens.

        Raises :class:`TemplateError` for anything that stops the template (a 400 for the client).
        """
        msgs = normalize_messages(messages)
        tools = list(tools) if tools is not None else None
        clash = _RESERVED_KWARGS.intersection(template_kwargs)
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TemplateError("documents must be a list of objects")

        compiled = (
            self._compiled_tool_use if (tools is not None and self._compiled_tool_use) else self._compiled
        )
        if compiled is None:
            compiled = self._compiled_tool_use
        if compiled is None:
            enable = template_kwargs.get("enable_thinking")
            return render_chatml(
                msgs,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                reasoning=self.reasoning,
                enable_thinking=enable if isinstance(enable, bool) else None,
            )
        context = {**self.special_tokens, **copy.deepcopy(template_kwargs)}
        try:
            return compiled.render(
                messages=msgs,
                tools=copy.deepcopy(tools),
                documents=copy.deepcopy(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            # raise_exception(), undefined values, sandbox refusals.
            raise TemplateError(str(exc) or type(exc).__name__) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # A template doing arithmetic on what the client sent (``'a' + none``, ``[0]`` on an
            # empty list): still the request's fault, not the server's.
            raise TemplateError(f"chat template failed on this conversation: {exc}") from exc


def _has_think_token(folder: Path, config: Mapping[str, Any]) -> bool:
    """Whether the tokenizer knows ``<think>`` as an added token: the sign of a reasoning model."""
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        if any(_token_text(v) == THINK_OPEN for v in decoder.values()):
            return True
    tok = _read_json(folder / "tokenizer.json")
    added = tok.get("added_tokens")
    if isinstance(added, list):
        return any(isinstance(t, Mapping) and t.get("content") == THINK_OPEN for t in added)
    return False
