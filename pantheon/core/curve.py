"""CURVE keys for workers on other hosts (``--worker-listen tcp://...``).

Local workers talk to the router over ``ipc://`` inside a private (0700) runtime directory, which
only our user can reach. A TCP endpoint is reachable by anyone on the network, so it is served
only with ZeroMQ's CURVE security: the router has a keypair, every worker has one, and

- the router accepts a worker only when the worker's public key is a file in the router's
  ``authorized/`` folder (read at each handshake: adding or removing a file takes effect for the
  next connection, no restart);
- the worker talks only to the router whose public key it was given (``server.key``), so a
  process that took the router's address cannot pose as it.

``pantheon keys new DIR`` writes one folder that holds all of it (``zmq.auth`` certificate
files): ``server.key`` / ``server.key_secret`` (the router's), ``worker.key`` /
``worker.key_secret`` (a worker's) and ``authorized/worker.key``. Copy the folder to the worker's
host without ``server.key_secret``; ``pantheon keys new DIR --worker NAME`` adds another worker.

Plain TCP is refused, except on a loopback address with ``--worker-insecure`` (tests, one host).
"""

from __future__ import annotations

import glob
import ipaddress
import logging
import os
import re
import shutil
import stat

from pantheon.core.errors import ConfigError

log = logging.getLogger("pantheon.core.curve")

SERVER = "server"
WORKER = "worker"
AUTHORIZED = "authorized"


def _error(msg: str) -> Exception:
    return ConfigError(msg)


def keygen(folder: str, worker: str = WORKER) -> tuple[str, str]:
    """Write the router's keypair (unless ``folder`` has one) and the keypair of worker ``worker``
    into ``folder`` (made 0700), and authorize that worker; the router's (public, secret) paths."""
    import zmq.auth

    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", worker) or worker == SERVER:
        raise _error(f"--worker {worker!r}: a name of letters, digits, '.', '_' or '-' (not 'server')")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    server_pub = os.path.join(folder, f"{SERVER}.key")
    server_sec = os.path.join(folder, f"{SERVER}.key_secret")
    if not os.path.isfile(server_sec):
        server_pub, server_sec = zmq.auth.create_certificates(folder, SERVER)
    worker_pub, worker_sec = zmq.auth.create_certificates(folder, worker)
    auth = os.path.join(folder, AUTHORIZED)
    os.makedirs(auth, mode=0o700, exist_ok=True)
    shutil.copyfile(worker_pub, os.path.join(auth, f"{worker}.key"))
    for path in (server_sec, worker_sec):
        os.chmod(path, 0o600)
    return server_pub, server_sec


def _secret(path: str, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file that only we may read; ConfigError else."""
    import zmq.auth

    if not os.path.isfile(path):
        raise _error(f"{flag}: no {path} (make keys with 'pantheon keys new DIR')")
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise _error(f"{flag}: {path} is readable by others (chmod 600 it)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise _error(f"{flag}: cannot read {path}: {e}") from None
    if not public or not secret:
        raise _error(f"{flag}: {path} holds no secret key")
    return public, secret


def load_server_keys(folder: str) -> tuple[bytes, bytes]:
    """(public, secret) of the router's keypair in ``folder``; ConfigError when unusable."""
    return _secret(os.path.join(folder, f"{SERVER}.key_secret"), f"--curve-dir {folder}")


def load_worker_keys(folder: str, name: str = WORKER) -> tuple[bytes, bytes, bytes]:
    """A worker's (public, secret) and the router's public key, from ``folder``; ConfigError."""
    import zmq.auth

    public, secret = _secret(os.path.join(folder, f"{name}.key_secret"), f"--curve-dir {folder}")
    server = os.path.join(folder, f"{SERVER}.key")
    try:
        server_public, _ = zmq.auth.load_certificate(server)
    except (OSError, ValueError) as e:
        raise _error(f"--curve-dir {folder}: cannot read the router's public key {server}: {e}") from None
    return public, secret, server_public


def authorized_keys(folder: str) -> set[bytes]:
    """The public keys (Z85) of the workers the router accepts: every certificate file in
    ``folder/authorized``."""
    import zmq.auth

    keys = set()
    for path in sorted(glob.glob(os.path.join(folder, AUTHORIZED, "*.key"))):
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            log.warning("skipped %s: not a CURVE public key file (%s)", path, e)
            continue
        if public:
            keys.add(public)
    return keys


class Authorizer:
    """The ZAP credentials provider of the router's worker socket (``zmq.auth``'s
    ``configure_curve_callback``): a worker gets in when its public key is in ``authorized/``,
    read again at each handshake. Every refusal is logged with the key and where to put it."""

    def __init__(self, folder: str):
        self.folder = folder
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in authorized_keys(self.folder):
            log.info("a worker with CURVE key %s connected", key.decode(errors="replace"))
            return True
        self.refused += 1
        log.error(
            "refused a worker: its CURVE public key %s is not in %s (copy its .key file there to let it in)",
            key.decode(errors="replace"),
            os.path.join(self.folder, AUTHORIZED),
        )
        return False


def is_loopback(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(endpoint: str, curve_dir: str | None, insecure: bool = False) -> None:
    """Refuse a worker endpoint we would not serve safely (ConfigError): not tcp://HOST:PORT,
    no usable CURVE keys, or ``insecure`` anywhere but on loopback."""
    if not re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s\[\]]+):\d{1,5}", endpoint):
        raise _error(f"--worker-listen {endpoint!r}: expected tcp://HOST:PORT")
    if insecure:
        if curve_dir:
            raise _error("--worker-insecure and --curve-dir: choose one")
        if not is_loopback(endpoint):
            raise _error(
                f"--worker-insecure: plain TCP only on a loopback address, not {endpoint} (anyone on "
                "the network could drive the workers); give --curve-dir DIR instead"
            )
        return
    if not curve_dir:
        raise _error(
            "--worker-listen needs CURVE keys: workers on other hosts must authenticate; give "
            "--curve-dir DIR (make keys with 'pantheon keys new DIR'), or --worker-insecure on loopback"
        )
    load_server_keys(curve_dir)
    if not authorized_keys(curve_dir):
        log.warning("--curve-dir %s: authorized/ holds no worker key yet: no worker can join", curve_dir)


def cli(argv: list[str] | None = None) -> int:
    """``pantheon keys new DIR [--worker NAME]``: write CURVE keys for remote workers."""
    import argparse

    ap = argparse.ArgumentParser(prog="pantheon keys", description="CURVE keys for workers on other hosts.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    new = sub.add_parser("new", help="write the router's keypair and a worker's, and authorize the worker")
    new.add_argument("dir")
    new.add_argument("--worker", default=WORKER, help="the worker keypair's name (default: worker)")
    args = ap.parse_args(argv)
    try:
        pub, _ = keygen(args.dir, args.worker)
    except ConfigError as e:
        print(f"pantheon keys: error: {e}")
        return 2
    print(
        f"pantheon: wrote {args.dir}: the router's keypair ({os.path.basename(pub)}), worker "
        f"{args.worker!r} ({args.worker}.key, {args.worker}.key_secret), authorized/{args.worker}.key.\n"
        f"  router: pantheon serve --worker-listen tcp://0.0.0.0:PORT --curve-dir {args.dir}\n"
        f"  worker: copy the folder without server.key_secret, then pantheon worker --router "
        f"tcp://ROUTER:PORT --die cpu:0 --curve-dir DIR --key {args.worker}"
    )
    return 0
