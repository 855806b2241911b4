"""Start, stop, kill and restart real vLLM (CPU build) replicas for end-to-end tests.

Runs in the project venv (stdlib, and loadtests.ports for free ports); each replica runs in the
separate vLLM venv made by setup_vllm.sh, and tests talk to it over HTTP and ZMQ only.

    from real_vllm.launch import start_replicas       # under pytest (tests/ is on sys.path)
    reps = start_replicas(2, model_dir)                # concurrent start, waits for /health
    reps[0].url, reps[0].kv_events_endpoint, reps[0].replay_endpoint
    reps[0].kill(); reps[0].restart()                  # same ports, fresh engine (KV event seq 0)
    stop_replicas(reps)

    python tests/real_vllm/launch.py -n 2 [--model DIR] [--check]   # CLI (see --help)

Rules of this module:
- Everything listens on 127.0.0.1 except the KV-event PUB socket. vLLM's publisher binds only
  when the endpoint has `*` (or `::`); with `tcp://127.0.0.1:P` it *connects* and the subscriber
  would have to bind, which makes one subscriber per publisher and restarts awkward. So the PUB
  endpoint is `tcp://*:P` (the engine binds all interfaces; subscribers connect to
  `tcp://127.0.0.1:P`). The replay ROUTER always binds, so it gets `tcp://127.0.0.1:R`.
- Each replica is its own process group (API server + EngineCore); stop/kill signal the group,
  so no engine process outlives its replica.
- Hash seed: PYTHONHASHSEED is removed from the engine's environment unless `hash_seed` is
  given, so with the default algorithm (sha256) the engine's NONE_HASH seed is
  "vllm-none-hash" (vllm/v1/core/kv_cache_utils.py: PYTHONHASHSEED if set, else that constant).
  `Replica.hash_seed` is the seed in effect; pass it to hashing.vllm_hash.block_hashes(seed=...).
- Threads: two replicas share 2 cores with the tests. Each engine gets OMP_NUM_THREADS=1 and
  VLLM_CPU_OMP_THREADS_BIND=nobind (the default "auto" pins every replica's worker to the same
  core); `cpu_bind="spread"` pins replica i to core i mod ncpu instead.
- A replica that exits or does not become healthy in time raises ReplicaStartError carrying the
  tail of its log. Nothing is ever skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.ports import free_port

__all__ = [
    "DEFAULT_VENV",
    "DEFAULT_MODEL_DIR",
    "VLLM_DEFAULT_SEED",
    "Replica",
    "ReplicaStartError",
    "VllmVenvMissing",
    "vllm_python",
    "ensure_model",
    "start_replicas",
    "stop_replicas",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_VENV = Path(os.environ.get("WARMROUTE_VLLM_VENV") or Path.home() / ".cache" / "warmroute" / "vllm-venv")
DEFAULT_MODEL_DIR = Path(
    os.environ.get("WARMROUTE_VLLM_MODEL") or Path.home() / ".cache" / "warmroute" / "tiny-llama-qwen-v1"
)
VLLM_DEFAULT_SEED = "vllm-none-hash"  # NONE_HASH seed of sha256 variants when PYTHONHASHSEED is unset
MARKER = ".warmroute-vllm-complete"
KV_TOPIC = "kv-events"


class ReplicaStartError(RuntimeError):
    """A replica exited or did not become healthy; the message ends with its log's tail."""


class VllmVenvMissing(RuntimeError):
    """The vLLM venv is absent or incomplete: run tests/real_vllm/setup_vllm.sh."""


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's python, or VllmVenvMissing with the command that makes it."""
    venv = Path(venv) if venv else DEFAULT_VENV
    py = venv / "bin" / "python"
    if not (venv / MARKER).exists() or not py.exists():
        raise VllmVenvMissing(
            f"vLLM venv not found or incomplete at {venv} (no {MARKER}): run "
            f"`bash {HERE / 'setup_vllm.sh'}` first (WARMROUTE_VLLM_VENV selects the path)"
        )
    return py


def ensure_model(model_dir: str | os.PathLike | None = None, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Build the tiny model (make_tiny_model.py) if needed, in this process; return its path.
    Needs numpy + safetensors, and the project's tokenizer deps unless tokenizer_dir is given."""
    sys.path.insert(0, str(HERE))
    try:
        import make_tiny_model
    finally:
        sys.path.remove(str(HERE))
    return make_tiny_model.make_tiny_model(model_dir or DEFAULT_MODEL_DIR, tokenizer_dir)


def _free_ports(n: int) -> list[int]:
    """n distinct free ports, below the ephemeral range (loadtests.ports: a vLLM start takes a
    minute, long enough for a client socket to take a port the kernel picked)."""
    return [free_port() for _ in range(n)]


def _tail(path: Path, lines: int = 60) -> str:
    try:
        data = path.read_bytes()[-64_000:].decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class Replica:
    """One vLLM API server (+ its EngineCore process) on fixed ports; restartable in place."""

    name: str  # replica id, e.g. "r0"; also the log file's stem
    model_dir: Path  # served model directory
    served_model_name: str  # the `model` field clients send
    port: int  # HTTP port on 127.0.0.1
    events_port: int  # KV-event PUB port (engine binds *:events_port)
    replay_port: int  # KV-event replay ROUTER port (127.0.0.1)
    log_path: Path  # engine stdout+stderr (appended across restarts)
    python: Path  # the vLLM venv's python
    block_size: int = 32
    max_model_len: int = 4096
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override (None: from KV cache space)
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    hash_seed: str = VLLM_DEFAULT_SEED  # NONE_HASH seed in effect (PYTHONHASHSEED if set)
    cpu_index: int = 0  # core for cpu_bind="spread"
    cpu_bind: str = "nobind"  # "nobind" | "spread"
    enforce_eager: bool = True  # --enforce-eager: no torch.compile warm-up (saves CPU at start)
    extra_args: list[str] = field(default_factory=list)  # more engine flags
    extra_env: dict[str, str] = field(default_factory=dict)  # more engine environment
    proc: subprocess.Popen | None = field(default=None, repr=False)
    starts: int = 0  # how many times start() ran
    last_startup_s: float | None = None  # seconds from spawn to healthy, last start

    # -- addresses ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """Where a SUB socket connects."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where a DEALER socket connects."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def kv_topic(self) -> str:
        return KV_TOPIC

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -- command line ------------------------------------------------------------------------
    def argv(self) -> list[str]:
        kv_cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": KV_TOPIC,
        }
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--block-size", str(self.block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_cfg, separators=(",", ":")),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            "--disable-uvicorn-access-log",
        ]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("PYTHONHASHSEED", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE_DEVICES"):
            env.pop(k, None)
        if self.hash_seed != VLLM_DEFAULT_SEED:
            env["PYTHONHASHSEED"] = self.hash_seed
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind" if self.cpu_bind == "nobind" else str(self.cpu_index),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_TARGET_DEVICE": "cpu",
                # Offline: no hub, no telemetry.
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # The engine's scratch files (gloo's file store vllm_dist_*) go beside the log, not /tmp.
        env["TMPDIR"] = str(self.log_path.parent / f"{self.name}-tmp")
        env.update(self.extra_env)
        return env

    # -- lifecycle ---------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the process (does not wait). Use wait_ready() or start()."""
        if self.is_alive():
            raise RuntimeError(f"{self.name} already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        (self.log_path.parent / f"{self.name}-tmp").mkdir(exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== warmroute launch: start #{self.starts} at {time.ctime()} =====\n".encode())
            log.write((" ".join(self.argv()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=str(self.log_path.parent),
                start_new_session=True,  # own process group: signals reach the EngineCore too
            )
        self._spawned_at = time.monotonic()

    def health(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 420.0) -> float:
        """Wait for /health 200 and the model list; return seconds since spawn."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ReplicaStartError(
                    f"vLLM replica {self.name} exited with code {code} during start-up "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            if self.health():
                self.last_startup_s = time.monotonic() - self._spawned_at
                return self.last_startup_s
            if time.monotonic() > deadline:
                self.stop()
                raise ReplicaStartError(
                    f"vLLM replica {self.name} not healthy after {timeout:.0f} s; stopped "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def start(self, timeout: float = 420.0) -> float:
        self.spawn()
        return self.wait_ready(timeout)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid (start_new_session)
        except ProcessLookupError:
            pass

    def _group_pids(self) -> list[int]:
        if self.proc is None:
            return []
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.getpgid(int(d.name)) == self.proc.pid:
                        pids.append(int(d.name))
                except (ProcessLookupError, PermissionError):
                    pass
        return pids

    def _reap_group(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._group_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_pids():
            self._signal_group(signal.SIGKILL)

    def stop(self, timeout: float = 20.0) -> None:
        """Graceful stop: SIGTERM to the group, SIGKILL after `timeout`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._reap_group(5.0)
        self.proc = None

    def kill(self) -> None:
        """Crash the replica: SIGKILL to the whole group, no clean-up by the engine."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self._reap_group(5.0)
        self.proc = None

    def restart(self, timeout: float = 420.0, graceful: bool = True) -> float:
        """Stop (or kill) and start again on the same ports; the new engine's KV seq starts at 0."""
        if graceful:
            self.stop()
        else:
            self.kill()
        return self.start(timeout)

    def rss_bytes(self) -> int:
        """Resident memory of the replica's processes together (API server + EngineCore)."""
        total = 0
        for pid in self._group_pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def pss_bytes(self) -> int:
        """Proportional set size of the replica's processes (shared pages split between them):
        the fair figure for "memory this replica costs"."""
        total = 0
        for pid in self._group_pids():
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def info(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "model": self.served_model_name,
            "pid": self.pid,
            "kv_events_endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "kv_topic": KV_TOPIC,
            "block_size": self.block_size,
            "hash_seed": self.hash_seed,
            "log_path": str(self.log_path),
            "startup_s": self.last_startup_s,
            "rss_mb": round(self.rss_bytes() / 2**20, 1),
            "pss_mb": round(self.pss_bytes() / 2**20, 1),
        }


def start_replicas(
    n: int,
    model_dir: str | os.PathLike,
    *,
    served_model_name: str = "tiny",
    venv: str | os.PathLike | None = None,
    log_dir: str | os.PathLike | None = None,
    block_size: int = 32,
    max_model_len: int = 4096,
    num_gpu_blocks: int | None = 512,
    kv_cache_space_gib: int = 1,
    hash_seed: str | None = None,
    cpu_bind: str = "nobind",
    enforce_eager: bool = True,
    concurrent: bool = True,
    timeout: float = 420.0,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[Replica]:
    """Start n replicas on free 127.0.0.1 ports and wait until all are healthy.

    concurrent=True spawns all first, then waits (about as fast as one on 2 cores, see
    README.md); False starts them one after another. On any failure every replica started here
    is stopped and ReplicaStartError (with the failing log's tail) is raised.
    """
    py = vllm_python(venv)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} is not a model directory: build it with make_tiny_model.py")
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="wr-vllm-logs-"))
    ncpu = os.cpu_count() or 1
    reps = []
    for i in range(n):
        port, ev, rp = _free_ports(3)
        reps.append(
            Replica(
                name=f"r{i}",
                model_dir=model_dir,
                served_model_name=served_model_name,
                port=port,
                events_port=ev,
                replay_port=rp,
                log_path=log_dir / f"r{i}.log",
                python=py,
                block_size=block_size,
                max_model_len=max_model_len,
                num_gpu_blocks=num_gpu_blocks,
                kv_cache_space_gib=kv_cache_space_gib,
                hash_seed=hash_seed if hash_seed is not None else VLLM_DEFAULT_SEED,
                cpu_index=i % ncpu,
                cpu_bind=cpu_bind,
                enforce_eager=enforce_eager,
                extra_args=list(extra_args or []),
                extra_env=dict(extra_env or {}),
            )
        )
    try:
        if concurrent:
            for r in reps:
                r.spawn()
            for r in reps:
                r.wait_ready(timeout)
        else:
            for r in reps:
                r.start(timeout)
    except BaseException:
        stop_replicas(reps)
        raise
    return reps


def stop_replicas(reps: list[Replica]) -> None:
    for r in reps:
        r.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start real vLLM CPU replicas of the tiny model (Ctrl-C stops them).")
    ap.add_argument("-n", "--replicas", type=int, default=2)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="model dir (built if missing)")
    ap.add_argument("--tokenizer-dir", help="tokenizer to put in a newly built model (default: the project's)")
    ap.add_argument("--venv", default=None, help=f"vLLM venv (default {DEFAULT_VENV})")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--num-gpu-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hash-seed", default=None, help="PYTHONHASHSEED for the engines (default: unset)")
    ap.add_argument("--cpu-bind", choices=["nobind", "spread"], default="nobind")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: --enforce-eager)")
    ap.add_argument("--sequential", action="store_true", help="start one after another")
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable), e.g. --engine-arg=--enforce-eager")
    ap.add_argument("--check", action="store_true", help="start, print figures, stop")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    model = ensure_model(args.model, args.tokenizer_dir)
    t_model = time.monotonic() - t0
    t1 = time.monotonic()
    reps = start_replicas(
        args.replicas,
        model,
        venv=args.venv,
        log_dir=args.log_dir,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        hash_seed=args.hash_seed,
        cpu_bind=args.cpu_bind,
        enforce_eager=not args.compile,
        concurrent=not args.sequential,
        timeout=args.timeout,
        extra_args=args.engine_arg,
    )
    out = {
        "model_s": round(t_model, 1),
        "startup_all_s": round(time.monotonic() - t1, 1),
        "replicas": [r.info() for r in reps],
    }
    print(json.dumps(out, indent=2), flush=True)
    try:
        if not args.check:
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
            while all(r.is_alive() for r in reps):
                time.sleep(1)
            print("a replica exited; stopping the others", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stop_replicas(reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
