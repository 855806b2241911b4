"""warmroute as an Endpoint Picker (EPP) of the Gateway API Inference Extension: Envoy (or any
gateway speaking ext_proc) asks it, per request, which replica to send to.

Layers, each knowing only the one below:
- `wire/`: the ext_proc protobuf messages (a wire-compatible subset of Envoy's API, generated).
- `extproc`: the protocol, sans-I/O: messages in, events and replies out (the pick header and
  metadata, body mutation, ImmediateResponses, the response path's usage reading).
- `server`: one ext_proc stream served (`serve_stream`) and the health state; asks a `Picker`
  for decisions, over a transport: `h2_transport` (default; its HTTP/2 is `http2`, sans-I/O) or
  `grpcio_transport`.
- `cli`: the flags of `warmroute epp`.
The `Picker` (decide and learn) is the gateway's request pipeline; this package holds none of it.
"""
