"""Mistakes a user makes get one line naming what to fix, not a traceback: a port or ZMQ endpoint
already in use (sim, agent), a misspelt or mistyped policy parameter (named, with the valid ones),
and a bad value from an environment variable (blamed on the variable, not the config file)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from gateway.config import ConfigError, config_from_dict, load_config
from policies.registry import POLICY_NAMES, PolicyParamError, get_policy, policy_params
from tests.conftest import REPO, free_port

EXE = [sys.executable, "-m", "gateway.cli"]


def _one_line(r: subprocess.CompletedProcess, *must: str) -> str:
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    last = err.splitlines()[-1]
    for m in must:
        assert m in last, (m, err)
    return last


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_sim_port_in_use(taken_port):
    r = subprocess.run(EXE + ["sim", "--port", str(taken_port), "--kv-events-endpoint", f"tcp://*:{free_port()}",
                              "--replay-endpoint", f"tcp://127.0.0.1:{free_port()}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    _one_line(r, f"cannot listen on 127.0.0.1:{taken_port}", "--port", "address already in use")


def test_sim_replay_endpoint_in_use(taken_port):
    r = subprocess.run(EXE + ["sim", "--port", str(free_port()), "--kv-events-endpoint", f"tcp://*:{free_port()}",
                              "--replay-endpoint", f"tcp://127.0.0.1:{taken_port}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    _one_line(r, "--replay-endpoint", "in use")


def _agent(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(EXE + ["agent", "--replica-id", "r", "--engine-url", f"http://127.0.0.1:{free_port()}",
                                 "--feed", "memory://", "--model", "m", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_agent_admin_port_in_use(taken_port):
    r = _agent("--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--admin-port", str(taken_port))
    assert r.returncode == 2
    _one_line(r, f"127.0.0.1:{taken_port}", "--admin-port", "address already in use")


def test_agent_bind_endpoint_in_use(taken_port):
    r = _agent("--kv-events-endpoint", f"tcp://127.0.0.1:{taken_port}", "--bind")
    assert r.returncode == 2
    _one_line(r, f"tcp://127.0.0.1:{taken_port}", "--kv-events-endpoint", "in use")


# -- policy parameters ----------------------------------------------------------------------------

def test_unknown_policy_parameter_is_named_with_the_valid_ones():
    with pytest.raises(PolicyParamError) as e:
        get_policy("cache_aware", w_cahce=1.0)
    msg = str(e.value)
    assert msg.startswith("unknown parameter 'w_cahce' for policy cache_aware (valid: w_cache, w_queue,")
    assert e.value.param == "w_cahce" and "__init__" not in msg and "keyword" not in msg
    for p in policy_params("cache_aware"):
        assert p in msg
    with pytest.raises(PolicyParamError, match=r"unknown parameter 'x' for policy round_robin \(valid: none"):
        get_policy("round_robin", x=1)


@pytest.mark.parametrize("value, expected", [
    ("abc", "'w_cache' of policy cache_aware must be a number, got 'abc'"),
    (True, "'w_cache' of policy cache_aware must be a number, got True"),
    ([1], "'w_cache' of policy cache_aware must be a number, got [1]"),
])
def test_mistyped_policy_parameter_is_named(value, expected):
    with pytest.raises(PolicyParamError) as e:
        get_policy("cache_aware", w_cache=value)
    assert str(e.value) == expected and "not supported between" not in str(e.value)


def test_policy_parameters_convert_numeric_strings_and_keep_range_checks():
    assert get_policy("cache_aware", w_cache="1.5").params()["w_cache"] == 1.5  # as an env variable arrives
    with pytest.raises(PolicyParamError, match="'prefix_blocks' of policy prefix_hash must be a whole number, got 2.5"):
        get_policy("prefix_hash", prefix_blocks=2.5)
    with pytest.raises(ValueError, match="cpu_weight"):
        get_policy("cache_aware", cpu_weight=2.0)  # the policy's own range check still speaks
    for name in POLICY_NAMES:  # every policy builds from its own defaults, through the checks
        get_policy(name, **{k: d for k, (_, d) in policy_params(name).items()})


def test_config_names_the_policy_parameter_field():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"auth": {"enabled": False}, "policy": {"params": {"w_cahce": 1.0}}}, {})
    assert str(e.value).startswith("policy.params.w_cahce: unknown parameter 'w_cahce' for policy cache_aware (valid: ")
    assert e.value.env_var is None and "environment" not in str(e.value)


def test_config_refuses_the_virtual_time_copy_probe():
    """cache_plan's copy_in_background leaves every copy to a warm only the simulator sends: in a
    gateway the hot document would never get a second holder, so the config names it."""
    for value in (True, "true", 1):
        with pytest.raises(ConfigError) as e:
            config_from_dict({"auth": {"enabled": False},
                              "policy": {"name": "cache_plan", "params": {"copy_in_background": value}}}, {})
        assert str(e.value).startswith("policy.params.copy_in_background: is a virtual-time design probe")


# -- environment variables ------------------------------------------------------------------------

@pytest.mark.parametrize("var, value, starts", [
    ("WARMROUTE_PROXY__MAX_ATTEMPTS", "abc", "proxy.max_attempts: expected an integer, got 'abc'"),
    ("WARMROUTE_POLICY__PARAMS__W_CACHE", "abc", "policy.params.w_cache: 'w_cache' of policy cache_aware must be a number"),
    ("WARMROUTE_POLICY__PARAMS__W_CAHCE", "1", "policy.params.w_cahce: unknown parameter 'w_cahce'"),
    ("WARMROUTE_SERVER__PORT", "70000", "server.port: must be 0..65535, got 70000"),
    ("WARMROUTE_PROXYY__MAX_ATTEMPTS", "2", "proxyy: unknown field"),
])
def test_an_error_from_an_environment_variable_is_blamed_on_it(tmp_path, var, value, starts):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("auth: {enabled: false}\nproxy: {max_attempts: 2}\npolicy: {params: {w_cache: 2.0}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg), env={var: value})
    msg = str(e.value)
    assert msg.startswith(starts), msg
    assert msg.endswith(f"(set by the environment variable {var}, not the config file)") and e.value.env_var == var


def test_an_error_in_the_file_is_not_blamed_on_an_unrelated_variable(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("auth: {enabled: false}\nproxy: {max_attempts: 0}\npolicy: {params: {cpu_weight: 5}}\n")
    env = {"WARMROUTE_PROXY__CONNECT_TIMEOUT_S": "1.5", "WARMROUTE_POLICY__PARAMS__W_CACHE": "1.0"}
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg), env=env)
    assert e.value.env_var is None and "environment" not in str(e.value), str(e.value)
    cfg.write_text("auth: {enabled: false}\npolicy: {params: {cpu_weight: 5}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg), env=env)  # a range error in the policy section: the file's cpu_weight, not W_CACHE
    assert "cpu_weight" in str(e.value) and e.value.env_var is None
