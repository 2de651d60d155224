"""Every OpenAI-format error the server can return, defined once.

A client sees an error as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status
(and sometimes headers). ``ApiError`` is that error as a Python exception; the factories below
are the only places one is made, so that each status, ``type``, ``code`` and header is written
once. A raise site says which error it is (``raise errors.queue_full()``), not how it looks.

Groups, with the status, ``type``, ``code`` and headers of each:

========================  ======  =====================  ==========================  ===========
factory                   status  type                   code                        headers
========================  ======  =====================  ==========================  ===========
**access** (``pantheon.api.auth``)
unauthorized              401     invalid_request_error  invalid_api_key             WWW-Authenticate
admin_loopback_only       403     permission_error       forbidden
path_not_allowed          403     permission_error       forbidden (param path)
origin_not_allowed        403     permission_error       origin_not_allowed (browsers: middleware)
unsupported_media_type    415     invalid_request_error  unsupported_media_type
renamed                   as the error it renames, naming another param
**the HTTP layer** (``pantheon.api.app``, the admin test hook)
route_not_found           404     invalid_request_error  not_found
body_too_large            413     invalid_request_error  request_too_large
http_error                any     invalid_request_error  method_not_allowed (405) / http_error
internal_error            500     server_error           internal_error
**request validation** (``pantheon.api.openai.protocol``, the admin routes, the limits)
invalid_param             400     invalid_request_error  (none; param: the field)
invalid_json              400     invalid_request_error
not_an_object             400     invalid_request_error
limit_exceeded            400     invalid_request_error  limit_exceeded
chat_template_refused     400     invalid_request_error  (param messages)
**context** (``pantheon.control.context``, the worker's rejections)
max_tokens_too_large      400     invalid_request_error  context_length_exceeded (param max_tokens or its alias)
context_length_exceeded   400     invalid_request_error  context_length_exceeded (param messages)
request_rejected          400     invalid_request_error  the worker's kind
context_too_long          400     invalid_request_error  context_length_exceeded (param max_tokens or messages)
input_too_long            400     invalid_request_error  context_length_exceeded (param input: embeddings)
**routing** (``pantheon.control.registry``, the OpenAI routes)
model_not_found           404     invalid_request_error  model_not_found (param model)
model_cannot_embed        400     invalid_request_error  model_not_embedding (param model)
model_cannot_generate     400     invalid_request_error  model_not_generative (param model)
no_model_loaded           503     server_error           model_not_ready             Retry-After: 1
model_loading             503     server_error           model_not_ready             Retry-After: 1
model_gone                503     server_error           model_not_ready             Retry-After: 1
no_instance               503     server_error           model_not_ready             Retry-After: 2
model_recovering          503     server_error           model_not_ready             Retry-After: 2
model_failed              503     server_error           model_failed                (none: given up on)
**slots and backpressure** (``pantheon.control.registry``; bodies: ``pantheon.api.middleware``)
server_busy               429     rate_limit_error       server_busy                 Retry-After: 1
queue_full                429     rate_limit_error       queue_full                  Retry-After: 5
queue_timeout             429     rate_limit_error       queue_timeout               Retry-After: 2
memory_pressure           503     server_error           memory_pressure             Retry-After: 1
bodies_in_flight          503     server_error           bodies_in_flight            Retry-After: 1
shutting_down             503     server_error           shutting_down               Retry-After: 5
**a running generation** (``pantheon.api.generation``, unload)
worker_died               503     server_error           worker_died                 Retry-After: 2
model_unloaded            503     server_error           model_unloaded              Retry-After: 2
worker_no_finish          500     server_error           internal_error
worker_aborted            500     server_error           aborted
generation_failed         500     server_error           internal_error
**loads and unloads** (``pantheon.control.lifecycle``, ``dies``, ``registry``; admin API)
not_a_die                 400     invalid_request_error  (param dies)
no_such_die               400     invalid_request_error  no_such_die (param dies)
remote_die_not_joined     400     invalid_request_error  no_such_die (param dies)
unreadable_model          404/400 invalid_request_error  the kind (param path)
no_model_folder           404     invalid_request_error  not_found (param path)
unreadable_assets         400     invalid_request_error  invalid (param path)
load_in_progress          409     invalid_request_error  conflict (param name)
unload_in_progress        409     invalid_request_error  conflict (param name)
duplicate_replica         409     invalid_request_error  duplicate (param dies)
table_full                507     server_error           table_full
insufficient_memory       507     server_error           insufficient_memory
kv_cache_dtype_refused    400     invalid_request_error  invalid (param kv_cache_dtype)
no_die_available          507     server_error           no_die
models_max_reached        507     server_error           models_max
load_queue_full           429     rate_limit_error       queue_full                  Retry-After: 5
load_queue_timeout        429     rate_limit_error       queue_timeout               Retry-After: 2
load_timeout              503     server_error           model_not_ready             Retry-After: 5
model_unavailable         400     invalid_request_error  model_unavailable (param model)
worker_start_failed       500     server_error           worker_start
load_failed               by kind by status              the worker's kind
load_worker_died          500     server_error           worker_died
load_cancelled            500     server_error           cancelled
load_internal_error       500     server_error           internal_error
no_such_instance          404     invalid_request_error  model_not_found (param name)
unload_conflict           409     invalid_request_error  conflict (param name)
no_ready_instance         404     invalid_request_error  model_not_found (param name)
**the Ollama API** (``pantheon.api.ollama``: rendered as Ollama's ``{"error": message}``)
ollama_model_not_found    404     invalid_request_error  model_not_found (param model)
ollama_manage_unsupported 501     invalid_request_error  not_supported
========================  ======  =====================  ==========================  ===========

Every 503 and 429 carries ``Retry-After`` in whole seconds (what vLLM and TGI clients expect):
1 s for a busy slot, memory pressure or bodies in flight, 2 s while a worker or model recovers, 5 s while the
server shuts down (tests/unit/test_errors.py checks each).

Plain Python: no Quart, no torch. ``pantheon.api.responses.error_response`` turns an
``ApiError`` into a response; the ASGI middleware sends ``body()`` itself.

Why one module of ~530 lines: it is a table by design, every error the server can return
in one place, one small documented factory each.
"""

from __future__ import annotations

INVALID = "invalid_request_error"
SERVER = "server_error"
RATE_LIMIT = "rate_limit_error"
PERMISSION = "permission_error"

# The worker's LoadFailed kinds -> HTTP status (the load issue's table; the rest is 500).
LOAD_STATUS = {"not_found": 404, "unsupported": 400, "invalid": 400, "out_of_memory": 507, "cancelled": 409}
# A model folder the router cannot size (GGUFError / SizingError kinds) -> HTTP status.
MODEL_FOLDER_STATUS = {"not_found": 404, "unsupported": 400, "invalid": 400}


class ApiError(Exception):
    """An error the client sees as ``{"error": {...}}`` with an HTTP status. Made only by the
    factories of this module."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type, param, code)
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_body(self.message, self.type, self.param, self.code)

    def ollama_body(self) -> dict[str, str]:
        """Ollama's error object: the message alone (its routes', ``/api/*``)."""
        return {"error": self.message}


def error_body(message: str, type: str = INVALID, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _retry_after(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(seconds)}


# ---------------------------------------------------------------- access


def unauthorized(missing: bool) -> ApiError:
    """401: no API key (``missing``) or a wrong one; names nothing about the server."""
    msg = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        if missing
        else "Incorrect API key provided."
    )
    return ApiError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _forbidden(message: str, param: str | None = None) -> ApiError:
    return ApiError(403, message, type=PERMISSION, param=param, code="forbidden")


def admin_loopback_only() -> ApiError:
    """403: an admin call from a non-loopback client, and the server has no admin key."""
    return _forbidden("the admin API answers only on loopback unless the server has an admin key")


def path_not_allowed(path: str) -> ApiError:
    """403: a load path outside every ``--models-dir`` root."""
    return _forbidden(f"{path!r} is not under an allowed models directory (--models-dir)", param="path")


# ---------------------------------------------------------------- the HTTP layer


def route_not_found(method: str, path: str) -> ApiError:
    """404: no such route (also the admin test hook when test hooks are off)."""
    return ApiError(404, f"no route {method} {path}", code="not_found")


def body_too_large(limit_bytes: int) -> ApiError:
    """413: the body is over ``--max-body``."""
    return ApiError(
        413,
        f"the request body is larger than {limit_bytes} bytes (the --max-body limit)",
        code="request_too_large",
    )


def http_error(status: int, message: str) -> ApiError:
    """Any other HTTP error Quart raises (405 and the rest), with its own message."""
    return ApiError(status, message, code="method_not_allowed" if status == 405 else "http_error")


def internal_error(exc: BaseException) -> ApiError:
    """500: an unhandled exception in a route (its type only: no internals in the message)."""
    return ApiError(500, f"internal error: {type(exc).__name__}", type=SERVER, code="internal_error")


# ---------------------------------------------------------------- request validation


def invalid_param(param: str | None, message: str) -> ApiError:
    """400: the generic validation error; ``param`` names the exact field
    (``messages[2].content``), or None for the body as a whole."""
    return ApiError(400, message, param=param)


def origin_not_allowed(message: str) -> ApiError:
    """403: a browser request from an origin the server does not take (``--cors-origins``, the
    admin API's own-origin rule: ``pantheon/api/middleware.py``)."""
    return ApiError(403, message, type=PERMISSION, code="origin_not_allowed")


def unsupported_media_type(got: str) -> ApiError:
    """415: a JSON route sent another ``Content-Type`` (what a cross-origin "simple" POST uses)."""
    return ApiError(
        415,
        f"this route takes a JSON body sent as 'Content-Type: application/json', not {got}",
        code="unsupported_media_type",
    )


def renamed(e: ApiError, param: str) -> ApiError:
    """The same error naming ``param`` instead (a check shared by two fields)."""
    return ApiError(e.status, e.message, type=e.type, param=param, code=e.code, headers=e.headers)


def invalid_json(detail: str | None = None) -> ApiError:
    """400: the body does not parse as JSON (with the parser's ``detail`` when given)."""
    msg = "the request body is not valid JSON"
    return ApiError(400, msg if detail is None else f"{msg}: {detail}")


def not_an_object() -> ApiError:
    """400: the body is JSON but not an object."""
    return ApiError(400, "the request body must be a JSON object")


def limit_exceeded(param: str, what: str, got: int, limit: int, flag: str) -> ApiError:
    """400: a per-request ceiling (``opsconfig.Limits``), naming the limit and its flag."""
    return ApiError(
        400,
        f"{what}: {got} given, this server's limit is {limit} ({flag})",
        param=param,
        code="limit_exceeded",
    )


def chat_template_refused(detail: str) -> ApiError:
    """400: the model's chat template raised on this conversation."""
    return invalid_param("messages", f"the chat template refused this conversation: {detail}")


# ---------------------------------------------------------------- context


def max_tokens_too_large(limit: int, max_tokens: int, param: str = "max_tokens") -> ApiError:
    """400: a ``max_tokens`` no context of this model can ever hold (``param``: the field it
    came from, ``max_completion_tokens`` on the chat route when that was given)."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. "
        f"However, you requested at least {max_tokens + 1} tokens "
        f"({max_tokens} in the completion).",
        param=param,
        code="context_length_exceeded",
    )


def prompt_too_long(limit: int, prompt_tokens: int, max_tokens: int) -> ApiError:
    """400: a ``/v1/completions`` prompt and ``max_tokens`` past the context (never capped)."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in "
        f"the completion).",
        param="prompt",
        code="context_length_exceeded",
    )


def context_length_exceeded(reason: str) -> ApiError:
    """400: the worker rejected the prompt as longer than its context."""
    return ApiError(400, reason, param="messages", code="context_length_exceeded")


def request_rejected(reason: str, kind: str) -> ApiError:
    """400: another rejection by the worker; ``code`` is the worker's kind."""
    return ApiError(400, reason, code=kind)


def context_too_long(
    limit: int, prompt_tokens: int, completion_tokens: int, kept_tokens: int, param: str
) -> ApiError:
    """400: the conversation cannot fit even capped: with every older turn and message text
    dropped the prompt still takes ``kept_tokens``, leaving less than the completion needs. The
    client's error (the limit is fixed at load: the KV pool is allocated once), so never a 503
    the SDKs would retry; vLLM's wording, with the numbers."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, "
        f"{completion_tokens} in the completion). Even with every older turn and message text "
        f"dropped the prompt takes {kept_tokens} tokens. Please reduce the length of the "
        f"messages or completion.",
        param=param,
        code="context_length_exceeded",
    )


def input_too_long(limit: int, tokens: int, index: int) -> ApiError:
    """400: an embedding input longer than the model takes (never truncated silently); vLLM's
    wording, with the numbers and which input."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{tokens} tokens in input {index} for embedding generation. Please reduce the length "
        f"of the input.",
        param="input",
        code="context_length_exceeded",
    )


# ---------------------------------------------------------------- routing


def model_not_found(name: str | None) -> ApiError:
    """404: no resident model has that name."""
    return ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")


def model_cannot_embed(name: str) -> ApiError:
    """400: ``/v1/embeddings`` (or Ollama's ``/api/embed``) names a model that does not embed."""
    return ApiError(
        400,
        f"The model '{name}' does not serve embeddings: it is not an embedding model (a "
        f"sentence-transformers folder, BERT) and was not loaded with 'embeddings: true'",
        param="model",
        code="model_not_embedding",
    )


def model_cannot_generate(name: str) -> ApiError:
    """400: a generating route names a model that only embeds (BERT)."""
    return ApiError(
        400,
        f"The model '{name}' only serves embeddings (/v1/embeddings): it cannot generate text",
        param="model",
        code="model_not_generative",
    )


def no_model_loaded() -> ApiError:
    """503: no model is ready at all."""
    return ApiError(
        503,
        "no model is loaded yet; retry shortly",
        type=SERVER,
        code="model_not_ready",
        headers=_retry_after(1),
    )


def model_loading(name: str) -> ApiError:
    """503: the named model is only loading or unloading."""
    return ApiError(
        503,
        f"model '{name}' is loading or unloading; retry shortly",
        type=SERVER,
        code="model_not_ready",
        headers=_retry_after(1),
    )


def model_gone(name: str) -> ApiError:
    """503: the last replica of a queued request's model went away."""
    return ApiError(
        503,
        f"model {name!r} was unloaded while the request waited; retry",
        type=SERVER,
        code="model_not_ready",
        headers=_retry_after(1),
    )


def no_instance(reason: str) -> ApiError:
    """503: the worker does not have the instance the request was sent to."""
    return ApiError(503, reason, type=SERVER, code="model_not_ready", headers=_retry_after(2))


def model_recovering(name: str | None, seconds: float) -> ApiError:
    """503: the model's worker died and the model was not back within the queue timeout."""
    return ApiError(
        503,
        f"model {name or ''!r} is restarting after its worker died and was not "
        f"back within {seconds:g} s; retry shortly",
        type=SERVER,
        code="model_not_ready",
        headers=_retry_after(2),
    )


# ---------------------------------------------------------------- slots and backpressure


def model_failed(name: str, reason: str | None) -> ApiError:
    """503 without Retry-After: every instance of the model failed and nothing will bring it
    back by itself (its die's worker was given up on after --worker-restarts deaths, or the
    server restarts no worker): retrying cannot help until an operator acts."""
    return ApiError(
        503,
        f"model '{name}' is unavailable: {reason or 'it failed'}; it will not come back by itself "
        "(load it again through the admin API, or restart the server)",
        type=SERVER,
        code="model_failed",
    )


def server_busy() -> ApiError:
    """429: a single-user instance (one slot) is busy; no queue."""
    return ApiError(
        429,
        "a generation is already in progress on this model; retry shortly",
        type=RATE_LIMIT,
        code="server_busy",
        headers=_retry_after(1),
    )


def queue_full() -> ApiError:
    """429: every slot is busy and the model's queue is full."""
    return ApiError(
        429,
        "all slots are busy and the queue is full; retry shortly",
        type=RATE_LIMIT,
        code="queue_full",
        headers=_retry_after(5),
    )


def queue_timeout(seconds: float) -> ApiError:
    """429: no slot became free within the queue timeout."""
    return ApiError(
        429,
        f"no slot became free within {seconds:g} s; retry",
        type=RATE_LIMIT,
        code="queue_timeout",
        headers=_retry_after(2),
    )


def memory_pressure() -> ApiError:
    """503: memory pressure is CRITICAL and the request cannot queue."""
    return ApiError(
        503,
        "memory pressure is critical and the queue is full; retry later",
        type=SERVER,
        code="memory_pressure",
        headers=_retry_after(1),
    )


def bodies_in_flight(limit_bytes: int) -> ApiError:
    """503: the router already holds ``--max-body-in-flight`` bytes of request bodies; the
    request is refused before its body is read (``pantheon.api.inflight.BodyBudget``)."""
    return ApiError(
        503,
        f"the server is busy reading other request bodies (more than {limit_bytes} bytes in "
        "flight, the --max-body-in-flight limit); retry shortly",
        type=SERVER,
        code="bodies_in_flight",
        headers=_retry_after(1),
    )


def shutting_down() -> ApiError:
    """503: the server is draining (new and queued requests, and generations past the drain
    deadline)."""
    return ApiError(
        503, "the server is shutting down", type=SERVER, code="shutting_down", headers=_retry_after(5)
    )


# ---------------------------------------------------------------- a running generation


def worker_died(request_id: str) -> ApiError:
    """503: the worker serving the request died; the supervisor has it back within seconds.
    The client gets the request id, not the worker's details (those are logged under it)."""
    return ApiError(
        503,
        f"the model's worker stopped while serving this request; retry shortly (request id {request_id})",
        type=SERVER,
        code="worker_died",
        headers=_retry_after(2),
    )


def model_unloaded(name: str) -> ApiError:
    """503: an unload passed its drain deadline while this request ran."""
    return ApiError(
        503,
        f"model {name!r} was unloaded while this request ran",
        type=SERVER,
        code="model_unloaded",
        headers=_retry_after(2),
    )


def worker_no_finish() -> ApiError:
    """500: the worker's stream ended without a finish reason."""
    return ApiError(500, "the worker ended the request without a finish", type=SERVER, code="internal_error")


def worker_aborted() -> ApiError:
    """500: the worker aborted the request."""
    return ApiError(500, "the worker aborted this request", type=SERVER, code="aborted")


def generation_failed(request_id: str) -> ApiError:
    """500: anything else that ended a generation (the traceback is logged under the id)."""
    return ApiError(500, f"internal error (request id {request_id})", type=SERVER, code="internal_error")


# ---------------------------------------------------------------- loads and unloads


def not_a_die(die_id: str) -> ApiError:
    """400: a die id that is not ``N``, ``cuda:N`` or ``cpu:N`` (``@NAME`` on another host)."""
    return ApiError(
        400, f"{die_id!r} is not a die (use N, cuda:N or cpu:N; cpu:N@NAME on another host)", param="dies"
    )


def no_such_die(die_id: str, kind: str, count: int) -> ApiError:
    """400: a well-formed die id this machine (``kind`` cuda) or server (cpu) lacks."""
    if kind == "cpu":
        why = f"the server has {count} CPU dies: --cpu-dies"
    else:
        why = f"this machine has {count} CUDA devices"
    return ApiError(400, f"die {die_id} does not exist ({why})", param="dies", code="no_such_die")


def remote_die_not_joined(die_id: str) -> ApiError:
    """400: a remote die (``cpu:N@NAME``) whose worker has never joined this router."""
    return ApiError(
        400,
        f"die {die_id} does not exist: no worker joined as {die_id} (start 'pantheon worker "
        f"--router tcp://... --die {die_id.partition('@')[0]} --name {die_id.partition('@')[2]}' "
        "on its host; GET /admin/dies lists the dies)",
        param="dies",
        code="no_such_die",
    )


def unreadable_model(kind: str, reason: str) -> ApiError:
    """404/400 (``MODEL_FOLDER_STATUS``): the router cannot size the model folder."""
    return ApiError(MODEL_FOLDER_STATUS.get(kind, 400), reason, param="path", code=kind)


def no_model_folder(path: str, why: str) -> ApiError:
    """404: nothing loadable at ``path``."""
    return ApiError(404, f"no model folder at {path!r} ({why})", param="path", code="not_found")


def unreadable_assets(exc: BaseException) -> ApiError:
    """400: the model's tokenizer or chat template cannot be read."""
    return ApiError(
        400, f"cannot read the model's tokenizer or template: {exc}", param="path", code="invalid"
    )


def load_in_progress(name: str, instance_id: str) -> ApiError:
    """409: a load of that name is already running."""
    return ApiError(
        409, f"model {name!r} is already being loaded ({instance_id})", param="name", code="conflict"
    )


def unload_in_progress(name: str, instance_id: str) -> ApiError:
    """409: that name is being unloaded."""
    return ApiError(
        409,
        f"model {name!r} is being unloaded ({instance_id}); retry when it is gone",
        param="name",
        code="conflict",
    )


def duplicate_replica(instance_id: str, name: str, dies: tuple[str, ...]) -> ApiError:
    """409: a ready replica already serves that name on those dies."""
    return ApiError(
        409, f"{instance_id} already serves {name!r} on {','.join(dies)}", param="dies", code="duplicate"
    )


def table_full(max_instances: int) -> ApiError:
    """507: the instance table is full."""
    return ApiError(
        507,
        f"the model table is full ({max_instances} instances); unload one first",
        type=SERVER,
        code="table_full",
    )


def insufficient_memory(message: str) -> ApiError:
    """507: no die (or not the given ones) has room; ``message`` says which lacks how much."""
    return ApiError(507, message, type=SERVER, code="insufficient_memory")


def kv_cache_dtype_refused(value: str, why: str) -> ApiError:
    """400: a load's KV cache type is not one, or the model's heads cannot be stored in it."""
    return ApiError(400, f"kv_cache_dtype {value!r}: {why}", param="kv_cache_dtype", code="invalid")


def models_max_reached(limit: int, holders: str) -> ApiError:
    """507: ``--models-max`` instances are loaded and none of them can be evicted."""
    return ApiError(
        507,
        f"--models-max {limit} models are loaded and none can be unloaded to make room: {holders}",
        type=SERVER,
        code="models_max",
    )


def load_queue_full(name: str, waiting: int, depth: int) -> ApiError:
    """429: a load of ``name`` found no room and ``depth`` loads already wait for room."""
    return ApiError(
        429,
        f"no room to load model '{name}' and {waiting} loads already wait for room (at most "
        f"{depth} may wait); retry shortly",
        type=RATE_LIMIT,
        code="queue_full",
        headers=_retry_after(5),
    )


def load_queue_timeout(name: str, seconds: float, holders: str) -> ApiError:
    """429: no room for a load of ``name`` freed within the queue timeout."""
    held = f" (held by {holders})" if holders else ""
    return ApiError(
        429,
        f"no room to load model '{name}' freed within {seconds:g} s{held}; retry",
        type=RATE_LIMIT,
        code="queue_timeout",
        headers=_retry_after(2),
    )


def load_timeout(name: str, seconds: float) -> ApiError:
    """503: the request waited ``--load-timeout`` for its model's load, which goes on."""
    return ApiError(
        503,
        f"model '{name}' is still loading after {seconds:g} s (--load-timeout); retry shortly",
        type=SERVER,
        code="model_not_ready",
        headers=_retry_after(5),
    )


def model_unavailable(name: str, reason: str) -> ApiError:
    """400: the catalog lists the model but it cannot be served (``reason`` names the file)."""
    return ApiError(
        400, f"model '{name}' cannot be served: {reason}", param="model", code="model_unavailable"
    )


def no_die_available() -> ApiError:
    """507: there is no die to place a model on."""
    return ApiError(
        507,
        "no die is available to place the model on (start the server with --cpu-dies N, or give 'dies')",
        type=SERVER,
        code="no_die",
    )


def worker_start_failed(detail: object) -> ApiError:
    """500: a die's worker did not start."""
    return ApiError(500, str(detail), type=SERVER, code="worker_start")


def load_failed(kind: str, reason: str) -> ApiError:
    """The worker's ``LoadFailed``: status by kind (``LOAD_STATUS``, else 500)."""
    status = LOAD_STATUS.get(kind, 500)
    return ApiError(status, f"load failed: {reason}", code=kind, type=SERVER if status >= 500 else INVALID)


def load_worker_died(detail: object) -> ApiError:
    """500: the worker died (or the pool failed) during the load."""
    return ApiError(500, f"load failed: {detail}", type=SERVER, code="worker_died")


def load_cancelled() -> ApiError:
    """500: the load was cancelled because the server is stopping."""
    return ApiError(500, "load cancelled (the server is stopping)", type=SERVER, code="cancelled")


def load_internal_error(exc: BaseException) -> ApiError:
    """500: anything else that failed a load."""
    return ApiError(500, f"load failed: {type(exc).__name__}: {exc}", type=SERVER, code="internal_error")


def no_such_instance(target: str) -> ApiError:
    """404: an unload naming no model or instance."""
    return ApiError(404, f"no model or instance named {target!r}", param="name", code="model_not_found")


def unload_conflict(target: str) -> ApiError:
    """409: every instance of ``target`` is loading or already unloading."""
    return ApiError(409, f"{target!r} is loading or already unloading", param="name", code="conflict")


def no_ready_instance(name: str) -> ApiError:
    """404: a cache reset naming no ready model or instance."""
    return ApiError(404, f"no ready model or instance named {name!r}", param="name", code="model_not_found")


# ---------------------------------------------------------------- the Ollama API


def ollama_model_not_found(name: str) -> ApiError:
    """404: an Ollama route names a model this server does not serve (Ollama's "model not found,
    try pulling it first", said of where our models come from instead)."""
    return ApiError(
        404,
        f'model "{name}" not found: this server serves the models it was given (--model, '
        "--models-dir or the config file) and pulls none; GET /api/tags lists them",
        param="model",
        code="model_not_found",
    )


def ollama_manage_unsupported(route: str) -> ApiError:
    """501: Ollama's model management (pull, push, create, copy, delete, blobs): our models come
    from the server's configuration, not from a registry or a Modelfile."""
    return ApiError(
        501,
        f"{route} is not supported: this server's models come from --model, --models-dir or its "
        "config file (and the admin API's /admin/models/load), not from a registry or a Modelfile",
        code="not_supported",
    )
