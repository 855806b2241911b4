"""Generated ext_proc message classes (`ext_proc_pb2`) from `ext_proc.proto`, a wire-compatible
subset of Envoy's external processing API; `python -m gateway.epp.wire.regenerate` rebuilds them.

Why not a packaged binding: `xds-protos` ships the same messages for grpcio but overwrites
`opentelemetry.proto` and breaks the OTLP exporter; `envoy-data-plane` (betterproto2) installs
cleanly but its pure-Python codec costs about 25x more CPU per message
(`python -m loadtests.bench_epp_binding`), and the picker handles every request's every chunk.
"""
