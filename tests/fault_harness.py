"""Real processes for the fault, load and tenancy tests: simulated replicas, agents and gateways
started as `warmroute` subprocesses on free loopback ports, killed with SIGKILL or stopped with
SIGTERM, and read from /proc (resident memory, open file descriptors). Every process a `Procs`
starts is stopped when its `with` block ends, whatever happened; none outlives a test.

Also a streaming client that says, per request, what the client saw: the status, the replica
that answered (X-Warmroute-Replica), whether the stream ended whole ([DONE] without an error
event) or with an OpenAI-style error event, and its time to first byte.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.processes import stop_processes
from loadtests.runner import wait_http
from tests.conftest import free_port

MODEL = "warmroute-sim"


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d.name))
    return sorted(out)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    ports: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> "Proc":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        return stop_processes([self.popen], timeout_s, group=True)[0]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


_WR = [sys.executable, "-m", "gateway.cli"]


class Procs:
    """Starts warmroute processes and stops every one of them at the end of its `with` block."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.all: list[Proc] = []

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.all):
            p.stop(5.0)

    def _start(self, name: str, argv: list[str], **ports) -> Proc:
        p = Proc(name, argv, self.workdir / f"{name}.log", ports=ports)
        self.all.append(p)
        return p.start()

    def sim(self, name: str, *extra: str, port: int | None = None, events: bool = False) -> Proc:
        """A `warmroute sim` (KV events on a PUB socket it binds, and a replay socket, if `events`)."""
        port = port or free_port()
        argv = _WR + ["sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, *extra]
        ports = {"http": port}
        if events:
            ports["pub"], ports["replay"] = free_port(), free_port()
            argv += ["--kv-events-endpoint", f"tcp://*:{ports['pub']}",
                     "--replay-endpoint", f"tcp://127.0.0.1:{ports['replay']}"]
        p = self._start(name, argv, **ports)
        p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        return p

    def agent(self, replica_id: str, engine_url: str, pub_port: int, replay_port: int, feed_url: str, *extra: str) -> Proc:
        """A `warmroute agent` connecting to an engine whose PUB binds `pub_port` (replay on `replay_port`)."""
        argv = _WR + ["agent", "--replica-id", replica_id, "--engine-url", engine_url,
                      "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
                      "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                      "--feed", feed_url, "--model", MODEL, "--load-interval", "0.2", *extra]
        return self._start(f"agent-{replica_id}", argv)

    def gateway(self, name: str, config: dict, *extra: str) -> Proc:
        """`warmroute gateway --config` with `config` (YAML is JSON); ports free unless given."""
        srv = config.setdefault("server", {})
        srv.setdefault("host", "127.0.0.1")
        srv.setdefault("port", free_port())
        srv.setdefault("admin_port", free_port())
        path = self.workdir / f"{name}.yaml"
        path.write_text(json.dumps(config))
        p = self._start(name, _WR + ["gateway", "--config", str(path), *extra], http=srv["port"], admin=srv["admin_port"])
        p.url = f"http://127.0.0.1:{srv['port']}"  # type: ignore[attr-defined]
        p.admin_url = f"http://127.0.0.1:{srv['admin_port']}"  # type: ignore[attr-defined]
        return p

    def wait(self, proc: Proc, path: str = "/health", timeout_s: float = 60.0, base: str | None = None) -> Proc:
        wait_http((base or proc.url) + path, timeout_s, proc.popen, proc.log)  # type: ignore[attr-defined]
        return proc


# ----------------------------------------------------------------------------- the client side
@dataclass
class Seen:
    """What one client saw of one request."""

    status: int = 0  # HTTP status (0: no response at all)
    replica: str = ""  # X-Warmroute-Replica
    whole: bool = False  # a stream that ended with [DONE] and no error event (or a whole 200 body)
    error_event: dict | None = None  # the OpenAI-style error event that ended a stream
    ttfb_s: float | None = None  # request -> first body bytes
    exc: str = ""  # a client-side exception (connection reset before any answer, ...)
    t_start: float = 0.0
    t_end: float = 0.0
    body: bytes = b""


async def stream_chat(session, url: str, content: str, *, max_tokens: int = 16, headers: dict | None = None,
                      timeout_s: float = 60.0, model: str = MODEL, extra: dict | None = None) -> Seen:
    """One streamed chat request; what the client saw (never raises for a failed request)."""
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, **(extra or {})}
    seen = Seen(t_start=time.monotonic())
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers or {},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            seen.status = r.status
            seen.replica = r.headers.get("X-Warmroute-Replica", "")
            buf = bytearray()
            async for chunk in r.content.iter_any():
                if seen.ttfb_s is None:
                    seen.ttfb_s = time.monotonic() - seen.t_start
                buf += chunk
            seen.body = bytes(buf)
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        seen.exc = f"{type(exc).__name__}: {exc}"
    seen.t_end = time.monotonic()
    _classify(seen)
    return seen


def _classify(seen: Seen) -> None:
    if seen.status != 200:
        return
    events = [e for e in seen.body.split(b"\n\n") if e.strip()]
    for ev in events:
        if ev.startswith(b"data: {") and b'"error"' in ev:
            try:
                obj = json.loads(ev[6:])
            except ValueError:
                continue
            if isinstance(obj, dict) and "error" in obj:
                seen.error_event = obj["error"]
    seen.whole = bool(events) and events[-1] == b"data: [DONE]" and seen.error_event is None and not seen.exc


async def metrics_text(session, admin_url: str) -> str:
    async with session.get(admin_url + "/metrics") as r:
        return await r.text()


def metric_sum(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples (counters: the _total samples) whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    name = name[: -len("_total")] if name.endswith("_total") else name  # the parser names counter families without it
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if fam.type == "counter" and not s.name.endswith("_total"):
                continue
            if all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


class LoopThread:
    """An asyncio event loop in a daemon thread, for services under a synchronous test (hypothesis
    drives plain functions): `run(coro)` waits for its result."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="warmroute-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tasks(self) -> int:
        return len(self.task_names())

    def task_names(self) -> list[str]:
        async def names():
            me = asyncio.current_task()
            return sorted(f"{t.get_name()} {t.get_coro().__qualname__}" for t in asyncio.all_tasks() if t is not me)
        return self.run(names())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


def raw_http(port: int, data: bytes, *, timeout_s: float = 10.0, chunk_delay_s: float = 0.0,
             chunk: int = 0) -> tuple[int | None, bytes]:
    """Send raw bytes to 127.0.0.1:`port` (optionally trickled `chunk` bytes every `chunk_delay_s`),
    then read until the server closes or the first response is whole. (status or None, raw answer)."""
    import re
    import socket as _socket

    s = _socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        if chunk:
            for i in range(0, len(data), chunk):
                s.sendall(data[i:i + chunk])
                time.sleep(chunk_delay_s)
        else:
            s.sendall(data)
        buf = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                part = s.recv(65536)
            except (ConnectionResetError, TimeoutError, _socket.timeout):
                break
            if not part:
                break
            buf += part
            while buf.startswith(b"HTTP/1.1 100 "):  # an interim 100 Continue: the answer follows
                interim, sep, buf = buf.partition(b"\r\n\r\n")
                if not sep:
                    buf = interim
                    break
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep and data.startswith(b"HEAD "):
                break  # no body follows an answer to HEAD
            if sep:
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if m and len(rest) >= int(m.group(1)):
                    break
                if rest.endswith(b"0\r\n\r\n"):
                    break
        m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
        return (int(m.group(1)) if m else None), buf
    finally:
        s.close()
