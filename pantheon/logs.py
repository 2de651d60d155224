"""Logging: the text or JSON format (``--log-format``), one line per request, one per admin action.

``setup(level, fmt)`` configures the root logger once for ``pantheon serve``. ``fmt="json"`` writes
one JSON object per line (``ts``, ``level``, ``logger``, ``message`` and the record's fields), for
log shippers; ``"text"`` keeps the readable ``pantheon: LEVEL name: message key=value ...`` lines.

``RequestTrace`` is what one HTTP request did; the ops middleware makes one per request, the chat
route and ``Generation`` fill it in (model, instance, tokens, first-token time, error), and at the
end the middleware logs it with ``log_request`` (logger ``pantheon.access``) and hands it to the
metrics. Admin actions go to ``pantheon.audit`` with what they named (path, name, dies).

Worker output lines are forwarded by the pool as they are (prefixed ``[worker DIE]``), not
re-encoded.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from pantheon.core.names import escaped, has_control

ACCESS = logging.getLogger("pantheon.access")
AUDIT = logging.getLogger("pantheon.audit")

TEXT_FORMAT = "pantheon: %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        return line


def _text(v: Any) -> str:
    """A field's value in a text line: quoted when it holds a space, ``"`` or ``=``, and its
    control characters escaped (a request's ``model`` may hold a NUL), so a record is one line."""
    s = str(v)
    if not s or has_control(s) or any(c.isspace() or c in '"=' for c in s):
        return escaped(json.dumps(s))
    return s


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            out.update({k: v for k, v in fields.items() if v is not None})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup(level: str = "info", fmt: str = "text") -> None:
    """Point the root logger at stderr in ``fmt`` (text | json); replaces earlier handlers."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())


def _ms(t: float | None) -> float | None:
    return None if t is None else round(t * 1000.0, 1)


class RequestTrace:
    """What one HTTP request did, filled in as it goes (see the module doc)."""

    def __init__(self, method: str, path: str, client: str | None):
        self.t0 = time.monotonic()
        self.method, self.path, self.client = method, path, client
        self.status: int | None = None
        self.request_id: str | None = None  # the completion id, for chat requests
        self.model: str | None = None  # the name asked for, then the instance's name
        self.instance: str | None = None
        self.prompt_tokens = 0
        self.t_admitted: float | None = None  # when the request got its slot
        self.t_first: float | None = None  # first token, any choice
        self.gen: Any = None  # the Generation, read at the end for usage and finish reasons
        self.error: Any = None  # an ApiError that ended a stream after its 200
        self.admin: dict | None = None  # what an admin action named
        self.on_gap: Any = None  # metrics hook: called with each inter-token gap (seconds)
        self._last: dict[int, float] = {}

    # ---- fed by the chat route and Generation

    def started(self, gen: Any, inst: Any, prompt_tokens: int) -> None:
        self.gen, self.request_id = gen, gen.id
        self.model, self.instance = inst.name, inst.instance_id
        self.prompt_tokens = prompt_tokens
        self.t_admitted = time.monotonic()

    def tokens(self, index: int, toks: list) -> None:
        """A batch of tokens of choice ``index`` arrived now."""
        real = sum(1 for t in toks if t.token >= 0)
        if not real:
            return
        now = time.monotonic()
        last = self._last.get(index)
        self._last[index] = now
        if self.t_first is None:
            self.t_first = now
        if last is not None and self.on_gap is not None:
            gap = (now - last) / real  # tokens that came together share the wait
            for _ in range(real):
                self.on_gap(gap)
        elif last is None and real > 1 and self.on_gap is not None:
            for _ in range(real - 1):
                self.on_gap(0.0)

    def failed(self, err: Any) -> None:
        if self.error is None:
            self.error = err

    # ---- read at the end

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t0

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.t_admitted is None else self.t_admitted - self.t0

    def completion_tokens(self) -> int:
        if self.gen is None:
            return 0
        return sum(r.completion_tokens for r in self.gen.runs)

    def finish_reasons(self) -> list[str]:
        if self.gen is None:
            return []
        return [r.finish_reason for r in self.gen.runs if r.finish_reason]

    def outcome(self) -> str:
        """ok, or the error code that ended the request (a status code when none is known)."""
        if self.error is not None:
            return getattr(self.error, "code", None) or "error"
        if self.status is not None and self.status >= 400:
            return str(self.status)
        return "ok"


def log_request(trace: RequestTrace, duration_s: float) -> None:
    """One line per request: chat and /v1 at INFO, cheap reads (health, metrics) at DEBUG."""
    chat = trace.path.startswith("/v1/")
    failed = trace.status is not None and trace.status >= 400
    level = logging.INFO if chat or failed else logging.DEBUG
    if not ACCESS.isEnabledFor(level):
        return
    fields = {
        "method": trace.method,
        "path": trace.path,
        "status": trace.status,
        "duration_ms": _ms(duration_s),
        "client": trace.client,
    }
    if trace.gen is not None or trace.model is not None:
        fields.update(
            {
                "id": trace.request_id,
                "model": trace.model,
                "instance": trace.instance,
                "prompt_tokens": trace.prompt_tokens,
                "completion_tokens": trace.completion_tokens(),
                "ttft_ms": _ms(trace.ttft_s),
                "queue_ms": _ms(trace.queue_wait_s),
                "finish": ",".join(trace.finish_reasons()) or None,
            }
        )
    if trace.error is not None:
        fields["error"] = getattr(trace.error, "code", None) or type(trace.error).__name__
    ACCESS.log(level, "request", extra={"fields": fields})


def log_admin(trace: RequestTrace, duration_s: float) -> None:
    """One line per admin action (a POST under /admin/)."""
    fields = {
        "action": trace.path.removeprefix("/admin/"),
        "status": trace.status,
        "duration_ms": _ms(duration_s),
        "client": trace.client,
    }
    for k, v in (trace.admin or {}).items():
        if k in ("path", "name", "instance", "dies", "quantize") and v is not None:
            fields[k] = v if isinstance(v, (str, int, float, bool)) else json.dumps(v)
    AUDIT.info("admin", extra={"fields": fields})
