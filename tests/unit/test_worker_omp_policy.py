"""The OpenMP wait policy a spawned worker gets (pantheon/workerlink/process.py): passive waits when
its torch threads cover every CPU (the router and the client share them), nothing otherwise, and
never over the operator's own setting."""

from __future__ import annotations

import pytest

from pantheon.workerlink.process import omp_wait, threads_of, worker_argv, worker_env

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    ("threads", "cpus", "want"),
    [
        (None, 2, PASSIVE),  # torch's default: one thread per CPU
        (2, 2, PASSIVE),
        (4, 2, PASSIVE),  # oversubscribed
        (1, 2, {}),  # a CPU left for the router and the client: spinning costs no one
        (8, 16, {}),
        (16, 16, PASSIVE),
        (None, 1, PASSIVE),
    ],
)
def test_policy_by_threads_and_cpus(threads, cpus, want):
    assert omp_wait(threads, cpus, {}) == want


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_operator_setting_wins(env):
    assert omp_wait(2, 2, env) == {}


def test_empty_setting_is_unset_and_omp_num_threads_counts():
    assert omp_wait(2, 2, {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""}) == PASSIVE
    assert omp_wait(None, 2, {"OMP_NUM_THREADS": "1"}) == {}  # torch takes its count from it
    assert omp_wait(None, 2, {"OMP_NUM_THREADS": "2"}) == PASSIVE
    assert omp_wait(2, 2, {"OMP_NUM_THREADS": "1"}) == PASSIVE  # --threads overrides it


def test_threads_of_the_argv_the_pool_builds():
    argv = worker_argv(
        ["py", "-m", "workers.worker"], "cpu:0", endpoint="ipc:///x", router_timeout=0, threads=3
    )
    assert threads_of(argv) == 3
    assert threads_of(worker_argv(["py"], "cpu:0", endpoint="ipc:///x", router_timeout=0)) is None


def test_worker_env_applies_it(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr("pantheon.workerlink.process.usable_cpus", lambda: 2)
    assert worker_env(2)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in worker_env(1)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(2)["OMP_WAIT_POLICY"] == "ACTIVE"
