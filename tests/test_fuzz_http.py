"""The HTTP API under hostile input (hypothesis): malformed and truncated JSON, wrong types, huge
and deeply nested bodies, invalid UTF-8, header abuse, slow clients trickling bytes, clients that
vanish mid-stream. What must hold: never a 5xx from the gateway's own code (a 5xx may only be an
upstream verdict: `upstream_unavailable` / `no_replica_available`), every error in OpenAI's shape,
no crash (a valid request afterwards is served), and no file descriptor or task leak (counted
before and after, once the upstream pool is warm)."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import config_from_dict
from gateway.server import start_gateway
from loadtests.sim.scheduler import TimeModel
from loadtests.sim.server import SimConfig, start_sim_server
from tests.fault_harness import LoopThread, fd_count, raw_http

MODEL = "warmroute-sim"
KEY = "sk-fuzz-key"
UPSTREAM_CODES = {"upstream_unavailable", "no_replica_available"}


class Service:
    def __init__(self, tok, tmp) -> None:
        self.lt = LoopThread()
        (tmp / "keys.yaml").write_text(f"fuzzer: [{KEY}]\n")
        (tmp / "salt.secret").write_text("fuzz-salt-secret")
        fast = TimeModel(step_overhead_s=0.001, prefill_s_per_token=1e-6, decode_s_per_seq=1e-5)
        self.sim = self.lt.run(start_sim_server(SimConfig(model=MODEL, time=fast, default_max_tokens=4)))
        cfg = config_from_dict({"server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "max_body_bytes": 1 << 20},
                                "membership": {"replicas": [f"r={self.sim.url}"]},
                                "auth": {"enabled": True, "api_keys_file": str(tmp / "keys.yaml")},
                                "salt": {"secret_file": str(tmp / "salt.secret")},
                                "model": {"name": MODEL, "max_model_len": 4096}, "feed": {"load_only": True}}, env={})
        self.g = self.lt.run(start_gateway(cfg, tokenizer=tok))
        self.g.gateway._front.request_timeout_s = 1.5  # noqa: SLF001 - the slow-request timeout, shortened for the test
        self.port = int(self.g.url.rsplit(":", 1)[1])

    def close(self) -> None:
        self.lt.run(self.g.close())
        self.lt.run(self.sim.close())
        self.lt.stop()


@pytest.fixture(scope="module")
def svc(tok, tmp_path_factory):
    s = Service(tok, tmp_path_factory.mktemp("fuzz"))
    yield s
    s.close()


def _request(path: str, body: bytes, *, method: str = "POST", headers: dict | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
         "Content-Length": str(len(body)), **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode("latin-1") + body


def _check(status: int | None, raw: bytes, what) -> None:
    """The gateway's answer is a non-5xx (or an upstream 5xx) and, when an error, OpenAI-shaped."""
    assert status is not None or raw == b"", (what, raw[:300])  # a closed connection is fine (bad framing)
    if status is None:
        return
    head, _, body = raw.partition(b"\r\n\r\n")
    if status >= 400 and body and b"content-type: application/json" in head.lower():
        if b"transfer-encoding: chunked" in head.lower():
            return
        err = json.loads(body)["error"]
        assert set(err) >= {"message", "type", "param", "code"}, (what, err)
        if status >= 500:
            assert err["code"] in UPSTREAM_CODES, (what, status, err)
    else:
        assert status < 500, (what, status, raw[:300])


def _alive(svc) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    status, raw = raw_http(svc.port, _request("/v1/chat/completions", body.encode()))
    assert status == 200, raw[:500]


# ----------------------------------------------------------------------------- strategies
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                      st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=12), ch, max_size=4),
                          max_leaves=25)
message = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), json_value),
                                              "content": st.one_of(st.text(max_size=200), json_value,
                                                                   st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_value}), max_size=3)),
                                              "name": json_value, "tool_calls": json_value})
chat_body = st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), json_value)},
                                  optional={"messages": st.one_of(st.lists(message, max_size=4), json_value),
                                            "max_tokens": st.one_of(st.integers(-5, 10), json_value),
                                            "max_completion_tokens": json_value, "stream": st.one_of(st.booleans(), json_value),
                                            "stream_options": json_value, "tools": json_value, "tool_choice": json_value,
                                            "chat_template_kwargs": json_value, "add_generation_prompt": json_value,
                                            "continue_final_message": json_value, "cache_salt": json_value,
                                            "n": json_value, "temperature": json_value, "logprobs": json_value})
completion_body = st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), json_value)},
                                        optional={"prompt": st.one_of(st.text(max_size=200), st.lists(st.integers(-10, 200_000), max_size=20),
                                                                      st.lists(st.text(max_size=20), max_size=3), json_value),
                                                  "max_tokens": st.one_of(st.integers(-5, 10), json_value),
                                                  "stream": st.one_of(st.booleans(), json_value), "echo": json_value,
                                                  "stream_options": json_value, "suffix": json_value})

SETTINGS = settings(max_examples=int(os.environ.get("WARMROUTE_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                             HealthCheck.too_slow])


@SETTINGS
@given(body=chat_body)
def test_fuzz_chat_bodies(svc, body):
    data = json.dumps(body).encode()
    _check(*raw_http(svc.port, _request("/v1/chat/completions", data)), body)


@SETTINGS
@given(body=completion_body)
def test_fuzz_completion_bodies(svc, body):
    data = json.dumps(body).encode()
    _check(*raw_http(svc.port, _request("/v1/completions", data)), body)


@SETTINGS
@given(base=chat_body, cut=st.floats(0, 1), mutation=st.sampled_from(["truncate", "bad_utf8", "flip", "garbage"]),
       garbage=st.binary(max_size=300), pos=st.floats(0, 1))
def test_fuzz_broken_bytes(svc, base, cut, mutation, garbage, pos):
    data = json.dumps(base, ensure_ascii=False).encode()
    if mutation == "truncate":
        data = data[: int(len(data) * cut)]
    elif mutation == "bad_utf8":
        i = int(len(data) * pos)
        data = data[:i] + b"\xff\xfe\xc3" + data[i:]
    elif mutation == "flip" and data:
        i = min(len(data) - 1, int(len(data) * pos))
        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
    else:
        data = garbage
    _check(*raw_http(svc.port, _request("/v1/chat/completions", data)), (mutation, data[:200]))


@SETTINGS
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"]),
       path=st.one_of(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/", "/v1", "/%00"]),
                      st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=50).map(lambda p: "/" + p)),
       headers=st.dictionaries(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
                                       min_size=1, max_size=20),
                               st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=100), max_size=6))
def test_fuzz_methods_paths_headers(svc, method, path, headers):
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "transfer-encoding", "host")}
    _check(*raw_http(svc.port, _request(path, b'{"model": "x"}', method=method, headers=headers)), (method, path, headers))


# ----------------------------------------------------------------------------- crafted abuse
def _nested(depth: int) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}"


CRAFTED = {
    "nested 100k arrays": _request("/v1/chat/completions", _nested(100_000)),
    "nested 900 arrays": _request("/v1/chat/completions", _nested(900)),
    "nested content 900": _request("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": '
                                   + b"[" * 900 + b"]" * 900 + b"}]}"),
    "nested kwargs 900": _request("/v1/chat/completions", b'{"model": "' + MODEL.encode()
                                  + b'", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
                                  + b"[" * 900 + b"]" * 900 + b"}}"),
    "nested extra field 900": _request("/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "x": '
                                       + b"[" * 900 + b"]" * 900 + b"}"),
    "body over the limit": _request("/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}'),
    "10k messages": _request("/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}).encode()),
    "prompt over the context": _request("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 20_000}).encode()),
    "token ids out of range": _request("/v1/completions", json.dumps({"model": MODEL, "prompt": [2**40, -1]}).encode()),
    "huge header": _request("/v1/models", b"", method="GET", headers={"X-Big": "v" * 100_000}),
    "many headers": _request("/v1/models", b"", method="GET", headers={f"X-H{i}": "v" for i in range(3000)}),
    "header without colon": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nbroken header line\r\n\r\n",
    "two content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    "cl and te": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "negative content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "content-length beyond int64": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    "http/0.9": b"GET /v1/models\r\n\r\n",
    "http/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "upgrade": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    "absolute uri": b"GET http://evil.example/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "long url": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "nul in path": b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\n\r\n",
    "non-ascii header": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: \xff\xfe\x00\r\n\r\n",
    "bad authorization": _request("/v1/chat/completions", b"{}", headers={"Authorization": "Bearer \x7f" + "k" * 5000}),
    "basic auth": _request("/v1/chat/completions", b"{}", headers={"Authorization": "Basic dXNlcjpwYXNz"}),
    "x-request-id abuse": _request("/v1/chat/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(),
                                   headers={"X-Request-Id": "\t" * 300}),
    "expect continue": _request("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode(),
                                headers={"Expect": "100-continue"}),
    "pipelined garbage": _request("/v1/models", b"", method="GET") + b"\x00\x01\x02 garbage\r\n\r\n",
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_abuse(svc, name):
    status, raw = raw_http(svc.port, CRAFTED[name], timeout_s=20)
    _check(status, raw, name)
    _alive(svc)


# ----------------------------------------------------------------------------- slow and vanishing
def test_slow_trickling_clients(svc):
    body = json.dumps({"model": MODEL, "prompt": "slowly", "max_tokens": 2}).encode()
    t0 = time.monotonic()
    status, raw = raw_http(svc.port, _request("/v1/completions", body), chunk=8, chunk_delay_s=0.01)
    assert status == 200, raw[:300]  # slow but within the request timeout: served
    # A slowloris (never finishes its headers) is cut off by the request timeout with 408.
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        got = b""
        while time.monotonic() - t0 < 8:
            try:
                s.sendall(b"X")
            except OSError:
                break
            try:
                s.settimeout(0.2)
                part = s.recv(4096)
                if not part:
                    break
                got += part
            except socket.timeout:
                pass
            except ConnectionResetError:
                # The gateway closed with our unread bytes in its buffer: the kernel resets the
                # connection, which can discard the 408 before we read it. Cut off all the same.
                break
        assert b" 408 " in got.split(b"\r\n", 1)[0] or got == b"", got[:200]
        assert time.monotonic() - t0 < 5.0
    finally:
        s.close()
    _alive(svc)


def _vanish_mid_stream(port: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(_request("/v1/completions", body))
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    s.close()


def test_no_fd_or_task_leak(svc):
    """Runs last in this module: after everything above, and after a burst of clients that vanish
    mid-stream, the gateway holds no more file descriptors or tasks than after a warm-up."""
    import concurrent.futures

    def burst(n):
        with concurrent.futures.ThreadPoolExecutor(n) as ex:
            list(ex.map(lambda _: _vanish_mid_stream(svc.port), range(n)))

    burst(20)  # warm-up: the upstream pool and the tokenizer reach their working size
    time.sleep(1.0)
    pool = svc.g.gateway.pool

    def upstream_conns():  # keep-alive connections to the replica: 2 fds each here (both ends in this process)
        return sum(len(v) for v in pool._idle.values()) + len(pool._busy)  # noqa: SLF001

    def own_tasks():  # the replica's per-connection handler tasks follow upstream_conns(); the rest must not grow
        return [t for t in svc.lt.task_names() if "RequestHandler.start" not in t]

    fds0, tasks0, conns0 = fd_count(), own_tasks(), upstream_conns()
    for _ in range(3):
        burst(20)
    for _ in range(40):
        _alive(svc)
    gw = svc.g.gateway
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (gw.load.get("r").active_reqs or gw.load.get("r").inflight_reqs
                                           or svc.sim.engine.num_running):
        time.sleep(0.1)
    time.sleep(0.5)
    fds1, tasks1, conns1 = fd_count(), own_tasks(), upstream_conns()
    assert gw.load.get("r").active_reqs == 0 and gw.load.get("r").inflight_reqs == 0
    assert svc.sim.engine.num_running == 0, "vanished clients' engine requests were aborted"
    assert conns1 <= conns0 + 4, (conns0, conns1)  # the pool stays at its working size
    assert fds1 - 2 * conns1 <= fds0 - 2 * conns0, (fds0, conns0, fds1, conns1, sorted(os.listdir("/proc/self/fd")))
    assert len(tasks1) <= len(tasks0), (tasks0, tasks1)
