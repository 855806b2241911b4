"""Fixtures for tests against real vLLM (CPU build) replicas.

`vllm_replicas` starts 2 replicas of the tiny model once per pytest session (concurrently,
about 1.5 min on 2 cores) and stops them at the end. Tests that use it live in this folder (so they
share the one session fixture), are marked `@pytest.mark.vllm`, and raise their pytest-timeout
(the project default of 300 s covers fixture set-up too). Nothing is skipped: a missing vLLM venv,
or an engine that fails to start, fails the test with the reason (and the engine's log tail).
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

import pytest

from .launch import DEFAULT_MODEL_DIR, Replica, ReplicaStartError, VllmVenvMissing, ensure_model, start_replicas, stop_replicas, vllm_python

N_REPLICAS = int(os.environ.get("WARMROUTE_VLLM_REPLICAS", "2"))
SERVED_MODEL = "tiny"


@pytest.fixture(scope="session")
def vllm_python_path() -> Path:
    """The vLLM venv's python; fails (never skips) when setup_vllm.sh has not been run."""
    try:
        return vllm_python()
    except VllmVenvMissing as exc:
        msg = str(exc)
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python_path) -> Path:
    """The tiny random-weight Llama with the project's tokenizer (built once per machine)."""
    from gateway.default_tokenizer import default_tokenizer_dir

    return ensure_model(os.environ.get("WARMROUTE_VLLM_MODEL") or DEFAULT_MODEL_DIR, default_tokenizer_dir())


@pytest.fixture(scope="session")
def vllm_replicas(vllm_python_path, tiny_model_dir, tmp_path_factory) -> list[Replica]:
    """N_REPLICAS real vLLM replicas, started once per session; stopped at session end.

    A test may kill() and restart() one; it must leave it running (restart) when done."""
    log_dir = Path(os.environ.get("WARMROUTE_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm-logs"))
    reps, error = [], ""
    try:
        reps = start_replicas(N_REPLICAS, tiny_model_dir, served_model_name=SERVED_MODEL, log_dir=log_dir)
    except ReplicaStartError as exc:
        error = str(exc)
    if error:
        pytest.fail(error, pytrace=False)
    atexit.register(stop_replicas, reps)  # if the session dies before teardown
    for r in reps:
        print(
            f"vLLM replica {r.name}: {r.url} pid {r.pid} started in {r.last_startup_s:.0f} s, "
            f"PSS {r.pss_bytes() / 2**20:.0f} MiB, log {r.log_path}"
        )
    try:
        yield reps
    finally:
        stop_replicas(reps)
