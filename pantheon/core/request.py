"""One generation request below HTTP: what every front end maps its body to.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/api/chat`` and
``/api/generate`` each check their own body and build a ``GenerationRequest``; from there the
router's path is one: the request limits (``pantheon.api.auth.check_limits``), placement, the
model's generation defaults and the context rule (``pantheon.control.context.fit``, once), the
constraint check and the worker's ``SamplingParams`` (``GenerationRequest.sampling``).

Each value remembers the client field it came from (``names``: ours -> the caller's), so an error
raised after mapping names the caller's own field: ``options.num_predict`` on Ollama,
``max_output_tokens`` on Responses, ``max_completion_tokens`` on chat when that was given.

Messages and tools are the chat template's dicts (``Message``, ``Tool``): the Jinja templates read
them as mappings, and every front end builds them in that form once, checked.

Like ``pantheon.core.protocol``, this module imports neither torch nor quart, nor any HTTP layer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pantheon.core.protocol import SPECULATIVE_ON, SamplingParams

# A chat message as the template renders it: role, content (text), and per role
# tool_calls / reasoning_content / tool_call_id / name. Values are JSON (a tool call's arguments
# text or object), hence Any: the Jinja templates read them as they are.
Message = dict[str, Any]
# An OpenAI function tool, ``{"type": "function", "function": {name, description, parameters}}``,
# checked (``parameters`` a JSON schema).
Tool = dict[str, Any]
# Switches passed to the chat template (``enable_thinking``, ``reasoning_effort``, ...).
TemplateKwargs = dict[str, Any]


class GenerationRequest(msgspec.Struct, kw_only=True):
    """A checked generation request: messages (or a raw prompt), tools, sampling, output
    constraint and limits, whichever front end it came from."""

    model: str | None = None
    messages: list[Message]  # normalised for the chat template (unused with ``prompt``)
    # a prompt sent without the chat template (``/v1/completions``, Ollama's ``raw``): text,
    # tokenized with the tokenizer's special tokens, or token ids. None: ``messages`` rendered.
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    # ---- sampling
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's prompt_logprobs: each prompt position's logprob and its top K (None: not asked)
    prompt_logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    # ---- tools
    tools: list[Tool] | None = None
    tool_choice: str = "auto"  # none | auto | required | function
    tool_choice_name: str | None = None
    # False: at most one call per answer (enforced only where the answer form is the router's:
    # pantheon.chat.answer_form; other formats parse however many calls come)
    parallel_tool_calls: bool = True
    # ---- the output constraint
    response_format: str = "text"  # the constraint's kind: text | json_object | json_schema | regex | ...
    grammar: str | None = None  # its llguidance grammar (pantheon.api.structured), checked
    # under tool_choice auto without a grammar of its own: the call-or-reply grammar a model whose
    # template takes no tools answers in (pantheon.chat.answer_form); None when the tools'
    # schemas cannot be compiled into one (such a model then answers free text, as before)
    answer_grammar: str | None = None
    user: str | None = None
    # ---- extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # the tokens the repetition penalty looks at: the last N of prompt and output (llama.cpp's
    # repeat_last_n, same default), -1 all of them, 0 none
    repetition_window: int = 64
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI's, [-100, 100])
    min_tokens: int = 0
    ignore_eos: bool = False
    session_id: str | None = None
    cache_salt: str | None = None  # requests share cached prefixes only under the same salt
    # prompt-lookup speculative decoding (workers/speculation.py): True on (SPECULATIVE_TOKENS
    # drafts per step, or the server's --speculative count), False off, None the server's default
    speculative: bool | None = None
    chat_template_kwargs: TemplateKwargs = {}
    # seconds the model stays loaded when idle after this request (Ollama's keep_alive; None:
    # the model's default, residency.FOREVER, 0: unload once idle)
    keep_alive: float | None = None
    # ---- limits
    # the context the client asks for (Ollama's num_ctx), at most the instance's own; None: the
    # instance's (pantheon.control.context.limit_of)
    num_ctx: int | None = None
    # the completion's length when neither the client nor the model's defaults give one: None,
    # the rest of the context (chat, Ollama); 16 on /v1/completions (OpenAI's), as if given
    fallback_max_tokens: int | None = None
    # echo with max_tokens 0 (/v1/completions): score the prompt, generate nothing (run as one
    # token, which is dropped)
    score_only: bool = False
    # the defaultable sampling fields (generation_defaults.FIELDS) the client left out: the
    # router fills them from the model's defaults once it is routed (generation_defaults.apply).
    # Empty for a request built in code: every field is then as given.
    unset: frozenset[str] = frozenset()
    # ours -> the client's field each value came from, where it is not the same name
    # (``max_tokens`` -> ``options.num_predict``): what an error after mapping names
    names: dict[str, str] = {}

    def param(self, field: str) -> str:
        """The client's name of ``field`` (ours), for an error naming it."""
        return self.names.get(field, field)

    @property
    def max_tokens_param(self) -> str:
        """The field ``max_tokens`` came from (``max_completion_tokens`` on chat when given)."""
        return self.param("max_tokens")

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def sampling(
        self,
        *,
        max_tokens: int,
        stop_token_ids: list[int],
        seed: int | None = None,
        grammar: str | None = None,
        grammar_after: list[int] | None = None,
        grammar_opening: int = -1,
    ) -> SamplingParams:
        """The worker's parameters; ``grammar`` (else the request's own) constrains the output,
        from when the output ends with ``grammar_after`` (see ``SamplingParams``)."""
        greedy = self.temperature == 0.0 or self.top_p == 0.0
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_window=self.repetition_window,
            logit_bias=dict(self.logit_bias),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed if seed is None else seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else 0,
            grammar=grammar or self.grammar,
            grammar_after=list(grammar_after or []),
            grammar_opening=grammar_opening,
            speculative=None if self.speculative is None else SPECULATIVE_ON if self.speculative else 0,
        )
