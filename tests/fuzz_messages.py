"""Hypothesis strategies for every request message of ``protos/pdgrpc/v1``, valid and
mutated, and a runner that sends them to a live server (issue 16, "Fuzzing").

:func:`request_bytes` builds a message from its descriptor (every field, scalar edges,
nested messages, repeated fields, unknown enum values), serializes it, and sometimes
mutates the bytes (flips, truncation, junk). :func:`call` sends one to a method of a
server in another process (sync grpc, so hypothesis drives it) and returns the status
code. A server crashes when it answers ``UNKNOWN`` or ``INTERNAL`` (an uncaught
exception), or stops reporting SERVING.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from pdgrpc.v1 import bootstrap_pb2, decode_pb2, generate_pb2, handshake_pb2, prefill_pb2

F = FieldDescriptor
CRASHES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
SERVICES: dict[str, ServiceDescriptor] = {
    s.full_name: s
    for mod in (bootstrap_pb2, decode_pb2, generate_pb2, handshake_pb2, prefill_pb2)
    for s in mod.DESCRIPTOR.services_by_name.values()
}

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if f.type in _INT_RANGES:
        lo, hi = _INT_RANGES[f.type]
        return st.one_of(st.integers(max(lo, 0), min(hi, 300)), st.sampled_from([lo, hi]), st.integers(lo, hi))
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if f.type == F.TYPE_FLOAT else 64)
    if f.type == F.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(["127.0.0.1:9", "tcp", "fake", "rdma"]))
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(0, 50))
    assert f.message_type is not None
    return message(f.message_type, depth + 1)


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """A valid instance of ``desc`` (every field optional; nesting up to depth 3)."""
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            continue
        s = _scalar(f, depth)
        fields[f.name] = st.lists(s, max_size=4) if f.is_repeated else s

    def build(values: dict[str, Any]) -> Any:
        m = cls()
        for name, v in values.items():
            f = desc.fields_by_name[name]
            if f.is_repeated:
                if f.message_type is not None:
                    for item in v:
                        getattr(m, name).add().CopyFrom(item)
                else:
                    getattr(m, name).extend(v)
            elif f.message_type is not None:
                getattr(m, name).CopyFrom(v)
            else:
                setattr(m, name, v)
        return m

    return st.fixed_dictionaries({}, optional=fields).map(build)  # type: ignore[arg-type]


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None, junk: bytes) -> bytes:
    b = bytearray(data)
    for pos, value in edits:
        if b:
            b[pos % len(b)] = value
    if cut is not None:
        del b[cut % (len(b) + 1):]
    return bytes(b) + junk


def request_bytes(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """Serialized requests for ``method``: valid, or mutated."""
    valid = message(method.input_type).map(lambda m: m.SerializeToString())
    mutated = st.builds(
        _mutate, valid, st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
        st.none() | st.integers(0, 1 << 16), st.binary(max_size=8),
    )
    return st.one_of(valid, mutated)


def methods(service: str) -> list[MethodDescriptor]:
    return list(SERVICES[service].methods)


def call(channel: grpc.Channel, method: MethodDescriptor, body: bytes, timeout: float = 2.0) -> grpc.StatusCode:
    """Send ``body`` to ``method``; the status it ended with (OK included)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(body, timeout=timeout):
                pass
        else:
            channel.unary_unary(path)(body, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def fuzz(channel: grpc.Channel, services: list[str], max_examples: int = 40) -> None:
    """Send ``max_examples`` generated requests to the methods of ``services``; fail on a
    crash status, or when the server stops reporting SERVING."""
    from hypothesis import HealthCheck, given, settings

    ms = [m for name in services for m in methods(name)]

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(ms), label="method")
        body = data.draw(request_bytes(method), label="request bytes")
        code = call(channel, method, body)
        assert code not in CRASHES, f"{method.full_name} answered {code.name} to {body!r}"

    run()
    assert serving(channel)


def serving(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[no-any-return]
