"""gateway/epp/wire: the checked-in generated code matches its .proto, and the subset agrees with
Envoy's own API field by field. The oracle is envoy-data-plane (betterproto2 classes generated
independently from the whole Envoy API): same field names, numbers and kinds, the same enum
numbers, and bytes written by either side read back by the other."""
from __future__ import annotations

import ast
import dataclasses
import enum
import typing

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as FD

from gateway.epp.wire import ext_proc_pb2 as pb

try:  # the oracle is in the test extra; its absence must fail, not skip
    import betterproto2
    from envoy_data_plane.envoy.config.core import v3 as core
    from envoy_data_plane.envoy.service.ext_proc import v3 as ep
    from envoy_data_plane.google import protobuf as gp
except ImportError as exc:  # pragma: no cover
    raise RuntimeError("envoy-data-plane is missing: pip install -e '.[test]'") from exc

_SCALAR = {FD.TYPE_STRING: "string", FD.TYPE_BYTES: "bytes", FD.TYPE_BOOL: "bool", FD.TYPE_INT32: "int32",
           FD.TYPE_UINT32: "uint32", FD.TYPE_ENUM: "enum", FD.TYPE_MESSAGE: "message"}
# Our int32 where Envoy has an enum with the same numbers (the same varint on the wire).
_INT_FOR_ENUM = {("HttpStatus", "code")}


def _serialized_file(generated_py: str) -> bytes:
    """The FileDescriptorProto bytes a generated _pb2.py registers (its AddSerializedFile argument)."""
    for node in ast.walk(ast.parse(generated_py)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError("no AddSerializedFile call in the generated code")


def test_checked_in_code_matches_the_proto(tmp_path):
    from gateway.epp.wire.regenerate import compile_to

    fresh = descriptor_pb2.FileDescriptorProto.FromString(_serialized_file(compile_to(tmp_path, stubs=False).read_text()))
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh.package == "warmroute.epp.wire" and len(fresh.message_type) > 20
    assert fresh == checked_in, "gateway/epp/wire/ext_proc_pb2.py is stale: python -m gateway.epp.wire.regenerate"


def _compare(ours, theirs, seen: set) -> int:
    """Every field of our message exists in Envoy's with the same number and kind; recurse."""
    if ours.full_name in seen:
        return 0
    seen.add(ours.full_name)
    fields = {f.name: f for f in dataclasses.fields(theirs)}
    hints = typing.get_type_hints(theirs)
    checked = 0
    for f in ours.fields:
        assert f.name in fields, f"{ours.name}.{f.name} is not in Envoy's {theirs.__name__}"
        meta = fields[f.name].metadata["betterproto"]
        assert meta.number == f.number, f"{ours.name}.{f.name}: number {f.number}, Envoy {meta.number}"
        is_map = f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry
        kind = "map" if is_map else _SCALAR[f.type]
        if (ours.name, f.name) in _INT_FOR_ENUM:
            assert meta.proto_type == "enum"
        else:
            assert meta.proto_type == kind, f"{ours.name}.{f.name}: {kind}, Envoy {meta.proto_type}"
        repeated = f.is_repeated and not is_map
        assert bool(meta.repeated) == repeated or typing.get_origin(hints[f.name]) is list
        if ours.fields_by_name[f.name].containing_oneof is not None:
            assert meta.group == ours.fields_by_name[f.name].containing_oneof.name
        target = hints[f.name]
        args = [a for a in typing.get_args(target) if a is not type(None)]
        inner = args[0] if args else target
        if typing.get_origin(inner) is list:
            inner = typing.get_args(inner)[0]
        if f.type == FD.TYPE_MESSAGE and not is_map and f.message_type.file.name == pb.DESCRIPTOR.name:
            checked += _compare(f.message_type, inner, seen)
        if f.type == FD.TYPE_ENUM:
            ours_enum = {v.name: v.number for v in f.enum_type.values}
            theirs_enum = {m.name: m.value for m in inner}
            assert ours_enum.items() <= theirs_enum.items(), f"{ours.name}.{f.name} enum differs"
        checked += 1
    return checked


def test_subset_matches_envoys_api_field_by_field():
    seen: set = set()
    n = _compare(pb.ProcessingRequest.DESCRIPTOR, ep.ProcessingRequest, seen)
    n += _compare(pb.ProcessingResponse.DESCRIPTOR, ep.ProcessingResponse, seen)
    assert n >= 40 and len(seen) >= 20  # the whole closure was walked, not just the top level
    ours_modes = {v.name: v.number for v in pb.ProcessingMode.DESCRIPTOR.enum_types_by_name["BodySendMode"].values}
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode

    assert ours_modes == {m.name: m.value for m in ProcessingModeBodySendMode}


def test_envoy_shaped_request_bytes_decode_with_the_subset():
    hm = core.HeaderMap(headers=[core.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                 core.HeaderValue(key="content-type", raw_value=b"application/json")])
    hint = gp.Struct(fields={"x-gateway-destination-endpoint-subset": gp.Value(list_value=gp.ListValue(
        values=[gp.Value(string_value="10.0.0.1:8000"), gp.Value(string_value="10.0.0.2:8000")]))})
    theirs = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=hm, end_of_stream=False),
        metadata_context=core.Metadata(filter_metadata={"envoy.lb.subset_hint": hint}),
        attributes={"request.path": gp.Struct(fields={"x": gp.Value(string_value="y")})},  # unknown to us: skipped
        protocol_config=ep.ProtocolConfiguration(request_body_mode=4, response_body_mode=4))
    ours = pb.ProcessingRequest.FromString(bytes(theirs))
    assert ours.WhichOneof("request") == "request_headers"
    assert [(h.key, h.raw_value) for h in ours.request_headers.headers.headers] == [
        (":path", b"/v1/completions"), ("content-type", b"application/json")]
    assert ours.protocol_config.request_body_mode == pb.ProcessingMode.FULL_DUPLEX_STREAMED
    vals = ours.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"]
    assert [v.string_value for v in vals.list_value.values] == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_subset_response_bytes_decode_with_envoys_api():
    from gateway.epp.extproc import ExtProcStream, Pick, Reject

    conv = ExtProcStream()
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/completions")])
    conv.receive(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm)))
    conv.receive(pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"prompt":"x"}', end_of_stream=True)))
    out = [ep.ProcessingResponse.parse(m.SerializeToString()) for m in conv.decide(Pick(b'{"prompt":"y"}', ["a:1", "b:2"]))]
    name, headers_resp = betterproto2.which_one_of(out[0], "response")
    assert name == "request_headers"
    sets = {o.header.key: (o.header.raw_value, o.append_action) for o in headers_resp.response.header_mutation.set_headers}
    assert sets["x-gateway-destination-endpoint"] == (b"a:1,b:2", core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD)
    lb = out[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert lb.string_value == "a:1,b:2"
    sr = out[1].request_body.response.body_mutation.streamed_response
    assert sr.body == b'{"prompt":"y"}' and sr.end_of_stream is True

    conv = ExtProcStream()
    conv.receive(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True)))
    (imm,) = conv.decide(Reject(429, b'{"error":{}}', {"Retry-After": "1"}))
    theirs = ep.ProcessingResponse.parse(imm.SerializeToString()).immediate_response
    assert isinstance(theirs.status.code, enum.Enum) and theirs.status.code.value == 429
    assert theirs.body == b'{"error":{}}' and theirs.details == "warmroute_epp_429"
    assert {o.header.key: o.header.raw_value for o in theirs.headers.set_headers} == {
        "content-type": b"application/json", "retry-after": b"1"}
