"""Who may call what, and how big a request may be.

- ``/v1/*``: with API keys configured (``--api-key``, repeatable, or ``PANTHEON_API_KEY=a,b``), an
  ``Authorization: Bearer KEY`` naming one of them; otherwise open.
- ``/admin/*``: with ``--admin-key``, that key as a bearer token (from anywhere, loopback too);
  without one, only clients on a loopback address (127.0.0.0/8, ::1), everyone else 403. A reverse
  proxy on this host makes every client look local: give it an admin key.
- ``/``, ``/health``, ``/metrics`` and the OpenAI routes' CORS preflights are open (probes and
  scrapers); browsers and ``/admin/*`` are ``api/middleware.py``'s (origins, preflights, 403).

A wrong or missing key is a 401 in the OpenAI error format that names nothing about the server (not
the key, not which keys exist, not the models). Keys are compared in constant time.

``--models-dir`` (repeatable): an admin load may only name a folder under one of these roots,
after resolving links; the folder's files are checked too, so a link inside a root that points out
of it is refused. Anything else is 403. (Startup ``--model`` folders are the operator's own and are
not checked.) Only safetensors weights are read: the worker's loader refuses pickle files.

Prefix-cache domains: with API keys configured, each key's requests share cached prompt blocks only
with that key's requests. ``Guard.check`` records the key's domain (a hash of the key) on the
request (``quart.g``), and the chat service sends the worker ``cache_salt(domain, the request's
cache_salt)`` instead of the request's salt, so ``cached_tokens`` never tells one key what another
sent. This is fixed: sharing the cache across keys would need a setting in the settings table
(``pantheon/config/table.py``). Without keys the request's ``cache_salt`` alone decides, as before.

``check_limits`` applies the per-request ceilings (``opsconfig.Limits``); each refusal is a 400 that
names the limit and the flag that sets it. The body size limit (413) is Quart's
``MAX_CONTENT_LENGTH``, set from ``--max-body``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os

from quart import g, has_request_context

from pantheon import errors
from pantheon.config.ops import Limits, OpsConfig
from pantheon.core.request import GenerationRequest

OPEN_PATHS = ("/", "/health", "/metrics")


def is_loopback(addr: str | None) -> bool:
    if not addr:
        return False
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_domain(key: str) -> str:
    """The prefix-cache domain of an API key: a hash that names the key to no one."""
    return hashlib.sha256(b"pantheon cache domain\0" + key.encode()).hexdigest()


def request_domain() -> str | None:
    """The cache domain ``Guard.check`` recorded for the current request (None without keys)."""
    if not has_request_context():
        return None
    return g.get("pantheon_cache_domain")


def cache_salt(domain: str | None, salt: str | None) -> str | None:
    """The salt the worker keys prefix blocks with: the request's own without a domain, else a
    hash of both (a request without a salt still gets its key's)."""
    if domain is None:
        return salt
    return hashlib.sha256(json.dumps([domain, salt]).encode()).hexdigest()


def _matches(token: str, keys: tuple[str, ...]) -> bool:
    ok = False
    for k in keys:  # no early exit: every key is compared, in constant time
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return ok


class Guard:
    """The access rules of one app (see the module doc)."""

    def __init__(self, ops: OpsConfig):
        self.api_keys = ops.api_keys
        self.admin_key = ops.admin_key
        self.roots = ops.models_dirs
        self.limits = ops.limits

    def check(self, method: str, path: str, authorization: str | None, remote: str | None) -> None:
        """Raise ``ApiError`` (401/403) unless this request may go on."""
        if method == "OPTIONS" or path in OPEN_PATHS:
            return
        if path == "/admin" or path.startswith("/admin/"):
            if self.admin_key is None:
                if not is_loopback(remote):
                    raise errors.admin_loopback_only()
                return
            token = _bearer(authorization)
            if token is None or not _matches(token, (self.admin_key,)):
                raise errors.unauthorized(token is None)
            return
        if self.api_keys:
            token = _bearer(authorization)
            if token is None or not _matches(token, self.api_keys):
                raise errors.unauthorized(token is None)
            if has_request_context():
                g.pantheon_cache_domain = key_domain(token)

    # ------------------------------------------------------------ --models-dir

    def _inside(self, real: str) -> bool:
        return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self.roots)

    def check_model_path(self, path: str) -> None:
        """403 unless ``path`` (and every file in it) resolves under a ``--models-dir`` root."""
        if not self.roots:
            return
        refuse = errors.path_not_allowed(path)
        real = os.path.realpath(path)
        if not self._inside(real):
            raise refuse
        try:
            entries = os.listdir(real)
        except OSError:
            return  # missing or unreadable: the load itself says 404
        for name in entries:
            if not self._inside(os.path.realpath(os.path.join(real, name))):
                raise refuse

    def check_admin_body(self, path: str, raw: bytes) -> None:
        """The ``--models-dir`` rule for an admin load's JSON body (bad JSON is the route's 400)."""
        if not self.roots or not path.startswith("/admin/models/load"):
            return
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError):  # the route answers it
            return
        if isinstance(body, dict) and isinstance(body.get("path"), str) and body["path"]:
            self.check_model_path(body["path"])


def check_limits(req: GenerationRequest, limits: Limits) -> None:
    """400 naming the limit, and the client's field, when ``req`` goes over one of ``limits``."""
    too_many = errors.limit_exceeded
    if len(req.messages) > limits.max_messages:
        raise too_many(
            "messages", "too many messages", len(req.messages), limits.max_messages, "--max-messages"
        )
    if req.n > limits.max_n:
        raise too_many("n", "'n' is too large", req.n, limits.max_n, "--max-n")
    if limits.max_tokens is not None and req.max_tokens is not None and req.max_tokens > limits.max_tokens:
        p = req.max_tokens_param  # the client's name for it (options.num_predict on Ollama)
        raise too_many(p, f"'{p}' is too large", req.max_tokens, limits.max_tokens, "--max-tokens-limit")
    if len(req.stop) > limits.max_stop:
        raise too_many(
            req.param("stop"), "too many stop strings", len(req.stop), limits.max_stop, "--max-stop"
        )
    for s in req.stop:
        if len(s) > limits.max_stop_len:
            raise too_many(
                req.param("stop"),
                "a stop string is too long (characters)",
                len(s),
                limits.max_stop_len,
                "--max-stop-len",
            )
