"""CURVE keys for workers on other hosts (``--worker-listen tcp://...``).

Local workers talk to the router over ``ipc://`` inside a private (0700) runtime directory, which
only our user can reach. A TCP endpoint is reachable by anyone on the network, so the router refuses
to listen on one without a CURVE keypair (``--curve-dir DIR`` holding ``server.key`` and
``server.key_secret``, the files ``zmq.auth.create_certificates`` writes; ``pantheon serve
--curve-keygen DIR`` makes them, plus a ``worker`` keypair and ``authorized/`` with its public key).

This version checks and loads the keys and then refuses ``--worker-listen`` anyway: the pool only
serves the workers it spawns itself. Accepting remote workers (a second, CURVE-server ROUTER socket
with a ZAP handler that admits the public keys in ``authorized/``) is left to do.
"""

from __future__ import annotations

import os
import re
import stat

from pantheon.config.values import ConfigError  # a leaf module: no import cycle


def _error(msg: str) -> Exception:
    return ConfigError(msg)


def keygen(folder: str) -> tuple[str, str]:
    """Write the server and worker keypairs into ``folder`` (made 0700); return their paths."""
    import zmq.auth

    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    server_pub, server_sec = zmq.auth.create_certificates(folder, "server")
    worker_pub, worker_sec = zmq.auth.create_certificates(folder, "worker")
    auth = os.path.join(folder, "authorized")
    os.makedirs(auth, mode=0o700, exist_ok=True)
    with open(worker_pub, "rb") as src, open(os.path.join(auth, "worker.key"), "wb") as dst:
        dst.write(src.read())
    for path in (server_sec, worker_sec):
        os.chmod(path, 0o600)
    return server_pub, server_sec


def load_server_keys(folder: str) -> tuple[bytes, bytes]:
    """(public, secret) of the router's keypair in ``folder``; ConfigError when unusable."""
    import zmq.auth

    path = os.path.join(folder, "server.key_secret")
    if not os.path.isfile(path):
        raise _error(
            f"--curve-dir {folder}: no server.key_secret (make one with "
            f"'pantheon serve --curve-keygen {folder}')"
        )
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise _error(f"--curve-dir {folder}: server.key_secret is readable by others (chmod 600 it)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise _error(f"--curve-dir {folder}: cannot read server.key_secret: {e}") from None
    if not public or not secret:
        raise _error(f"--curve-dir {folder}: server.key_secret holds no secret key")
    return public, secret


def check_listen(endpoint: str, curve_dir: str | None) -> None:
    """Refuse a TCP worker endpoint without CURVE keys (and, in this version, with them)."""
    if not re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", endpoint):
        raise _error(f"--worker-listen {endpoint!r}: expected tcp://HOST:PORT")
    if not curve_dir:
        raise _error(
            "--worker-listen needs CURVE keys: workers on other hosts must "
            "authenticate; give --curve-dir DIR (make keys with "
            "'pantheon serve --curve-keygen DIR')"
        )
    load_server_keys(curve_dir)
    raise _error(
        "--worker-listen: remote workers over TCP are not supported by this version "
        "yet (the CURVE keys were found and are valid); local workers need no flag"
    )
