"""Endpoint Picker overhead benchmark (not a test): TTFT that Envoy + the picker add over Envoy
routing directly, and over the warmroute HTTP gateway, with the picker's CPU per request; side by
side in one run, against the same upstream.

Targets (each in its own process(es); the load generator is this process):
  envoy      client -> Envoy (round robin, no ext_proc) -> upstream
  envoy+epp  client -> Envoy (ext_proc FULL_DUPLEX_STREAMED request and response bodies,
             override_host; gateway/epp/envoy.py) <-> picker (gRPC) ; Envoy -> upstream
  gateway    client -> `warmroute gateway` (one worker, no auth) -> upstream
at each `--levels` concurrency: streams of `--tokens` token events `--interval-ms` apart,
"steady" arrivals (streams start at independent times; see bench_gateway_overhead.run_level,
whose load generator and fake upstream this reuses). Added TTFT = that target's TTFT
percentile minus envoy's (and minus gateway's) at the same level. CPU per request from /proc of
the picker process and of each Envoy, over the measured phase.

The picker: by default `TransportOnlyPicker` below, which names the upstream and forwards the
body unchanged: the figures are then the EPP *transport* (gRPC, ext_proc conversation, the
response passthrough), not warmroute's decision. `--picker pipeline` measures warmroute's own
(gateway.epp.picker: authentication off, the gateway's tokenization, keys, index, policy,
learning); `--picker MODULE:FACTORY` another: FACTORY(endpoints: list[str]) -> Picker (or an
awaitable of one), called in the picker process.

`--transports h2,grpcio` runs a picker (and an Envoy in front of it) per gRPC transport, side by
side (gateway.epp.server.TRANSPORTS; h2 is the default).

Run:  python -m loadtests.bench_epp [--levels 1,64] [--seconds 6] [--transports h2,grpcio] [--no-gateway] [--json FILE]
A short smoke: python -m loadtests.bench_epp --levels 1,8 --seconds 2
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import multiprocessing as mp
import os
import subprocess
import sys
from typing import Any, Mapping, Sequence

from loadtests.ports import free_port
from loadtests.processes import stop_processes
from loadtests.bench_gateway_overhead import MODEL, fake_upstream_main, run_level
from loadtests.runner import process_cpu_s, wait_http


class TransportOnlyPicker:
    """Picks the first endpoint and forwards the body as it came (the transport's cost alone)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.outcomes = 0

    async def pick(self, headers: Mapping[str, str], body: bytes, subset: Sequence[str] | None):
        from gateway.epp.extproc import Pick

        return Pick(body=body, endpoints=self.endpoints)

    def observe(self, ctx: Any, outcome) -> None:
        self.outcomes += 1


async def pipeline_picker(endpoints: Sequence[str]):
    """warmroute's own picker (gateway.epp.picker over a Gateway without its HTTP port): no auth,
    an in-process feed, the endpoints as static replicas. `--picker pipeline`."""
    from gateway.config import config_from_dict
    from gateway.epp.picker import PipelinePicker
    from gateway.server import Gateway

    cfg = config_from_dict({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0}, "auth": {"enabled": False},
        "membership": {"replicas": [f"r{i}=http://{ep}" for i, ep in enumerate(endpoints)]},
        "feed": {"url": "memory://bench-epp"}, "model": {"name": MODEL, "max_model_len": 4096},
    }, env={})
    gw = Gateway(cfg, api_port=False)
    await gw.start()
    return PipelinePicker(gw)


def _load_factory(spec: str | None):
    if not spec:
        return TransportOnlyPicker
    if spec == "pipeline":
        return pipeline_picker
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "make_picker")


def picker_main(port: int, endpoints: list[str], factory_spec: str | None, ready, transport: str = "h2") -> None:
    import uvloop

    from gateway.epp.server import EppServer

    async def main() -> None:
        picker = _load_factory(factory_spec)(endpoints)
        if inspect.isawaitable(picker):
            picker = await picker
        srv = EppServer(picker, host="127.0.0.1", port=port, transport=transport)
        await srv.start()
        await srv.set_ready(True)
        ready.set()
        await srv.wait_closed()

    uvloop.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,64", help="concurrent streams per phase")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per phase and target")
    ap.add_argument("--tokens", type=int, default=32, help="token events per stream")
    ap.add_argument("--interval-ms", type=float, default=15.0, help="fake decode step between token events")
    ap.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads (both Envoys)")
    ap.add_argument("--picker", default=None, metavar="MODULE:FACTORY", help="the picker to measure: pipeline (warmroute's), MODULE:FACTORY, or none for transport only (default)")
    ap.add_argument("--response-body-mode", default="FULL_DUPLEX_STREAMED",
                    choices=["FULL_DUPLEX_STREAMED", "STREAMED", "NONE"],
                    help="ext_proc response body mode: FULL_DUPLEX_STREAMED (the protocol's; every chunk through the "
                         "picker), NONE (response headers only: no usage for the picker) ...")
    ap.add_argument("--transports", default="h2", help="the picker's gRPC transports to measure, side by side (h2,grpcio: "
                                                       "one picker process and one Envoy each)")
    ap.add_argument("--no-gateway", action="store_true", help="skip the warmroute HTTP gateway target")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)

    from gateway.epp.envoy import EnvoyOptions, EnvoyProcess, bootstrap, direct_bootstrap

    ctx = mp.get_context("spawn")
    up_port = free_port()
    endpoint = f"127.0.0.1:{up_port}"
    up = ctx.Process(target=fake_upstream_main, args=(up_port, args.interval_ms), daemon=True)
    up.start()
    transports = [t for t in args.transports.split(",") if t]
    pickers: dict[str, tuple] = {}  # transport -> (process, port)
    for t in transports:
        port, ready = free_port(), ctx.Event()
        pk = ctx.Process(target=picker_main, args=(port, [endpoint], args.picker, ready, t), daemon=True)
        pk.start()
        pickers[t] = (pk, port, ready)
    epp_names = {t: "envoy+epp" if len(transports) == 1 else f"envoy+epp[{t}]" for t in transports}
    procs: list = []
    gw = None
    report: dict = {"command": " ".join(sys.argv), "picker": args.picker or "TransportOnlyPicker (transport only)",
                    "response_body_mode": args.response_body_mode, "transports": transports,
                    "tokens_per_stream": args.tokens, "interval_ms": args.interval_ms, "cpus": os.cpu_count(),
                    "envoy_concurrency": args.envoy_concurrency, "loadavg_start": os.getloadavg(), "levels": []}
    try:
        wait_http(f"http://{endpoint}/health", 120.0)
        for t, (_, _, ready) in pickers.items():
            if not ready.wait(60):
                raise RuntimeError(f"picker ({t}) did not start")
        # Port 0: each Envoy binds a port of the kernel's choosing and reports it (EnvoyProcess.listen_port).
        direct = EnvoyProcess(direct_bootstrap(0, 0, [("127.0.0.1", up_port)]), 0,
                              concurrency=args.envoy_concurrency).start()
        procs.append(direct)
        targets = {"envoy": (f"http://127.0.0.1:{direct.listen_port}", direct.proc.pid)}
        picker_pids = {}
        for t, (pk, port, _) in pickers.items():
            epp = EnvoyProcess(bootstrap(EnvoyOptions(
                0, 0, ("127.0.0.1", port), [("127.0.0.1", up_port)], response_body_mode=args.response_body_mode)),
                               0, concurrency=args.envoy_concurrency).start()
            procs.append(epp)
            targets[epp_names[t]] = (f"http://127.0.0.1:{epp.listen_port}", epp.proc.pid)
            picker_pids[epp_names[t]] = pk.pid
        if not args.no_gateway:
            gw_port, gw_admin = free_port(), free_port()
            gw = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "gateway", "--host", "127.0.0.1", "--port", str(gw_port),
                 "--admin-port", str(gw_admin), "--replica", f"r0=http://{endpoint}", "--no-auth", "--feed", "memory://",
                 "--model", MODEL, "--max-model-len", "4096"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_http(f"http://127.0.0.1:{gw_admin}/readyz", 300.0)
            targets["gateway"] = (f"http://127.0.0.1:{gw_port}", gw.pid)
        import uvloop

        stagger = args.tokens * args.interval_ms / 1000
        for c in [int(x) for x in args.levels.split(",") if x]:
            row: dict = {"concurrency": c}
            for name, (url, pid) in targets.items():
                ppid = picker_pids.get(name)
                cpu0, pcpu0 = process_cpu_s(pid), process_cpu_s(ppid) if ppid else 0.0
                res = uvloop.run(run_level(url, c, args.seconds, args.tokens, stagger_s=stagger))
                n = max(1, res["requests"])
                res["proxy_cpu_ms_per_request"] = (process_cpu_s(pid) - cpu0) * 1000 / n
                if ppid:
                    res["picker_cpu_ms_per_request"] = (process_cpu_s(ppid) - pcpu0) * 1000 / n
                row[name] = res
            base = row["envoy"]["ttft_ms"]
            for name in picker_pids:
                sfx = name[len("envoy+epp"):]  # "" or "[transport]"
                row["epp_added_over_envoy_ms" + sfx] = {k: row[name]["ttft_ms"][k] - base[k] for k in ("p50", "p99")}
                if "gateway" in row:
                    row["epp_added_over_gateway_ms" + sfx] = {k: row[name]["ttft_ms"][k] - row["gateway"]["ttft_ms"][k]
                                                              for k in ("p50", "p99")}
            report["levels"].append(row)
            cells = []
            for name in targets:
                r = row[name]
                cells.append(f"{name} p50 {r['ttft_ms']['p50']:6.2f} p99 {r['ttft_ms']['p99']:6.2f} ms "
                             f"({r['requests']} req, {r['errors']} err, proxy {r['proxy_cpu_ms_per_request']:.2f} CPU-ms/req)")
            print(f"c={c:3d}  " + " | ".join(cells), flush=True)
            for name in picker_pids:
                sfx, e = name[len("envoy+epp"):], row[name]
                over_envoy = row["epp_added_over_envoy_ms" + sfx]
                line = f"       {name} adds p50 {over_envoy['p50']:+.2f} p99 {over_envoy['p99']:+.2f} ms over envoy"
                if "gateway" in row:
                    over_gw = row["epp_added_over_gateway_ms" + sfx]
                    line += f", p50 {over_gw['p50']:+.2f} p99 {over_gw['p99']:+.2f} ms over the gateway"
                print(line + f"; picker {e['picker_cpu_ms_per_request']:.3f} CPU-ms/req", flush=True)
    finally:
        for p in procs:
            p.stop()
        stop_processes([gw], 15)
        for p in [pk for pk, _, _ in pickers.values()] + [up]:
            p.terminate()
            p.join(5)
    report["loadavg_end"] = os.getloadavg()
    print(f"picker: {report['picker']}; machine load average {report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f} "
          f"on {report['cpus']} CPUs (other work running makes every figure worse)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
