"""The colocated server as smg's non-PD worker: SglangScheduler over a real gRPC port,
answered by the same scheduler as its GenerateService (in this process)."""

from __future__ import annotations

import argparse

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from pdgrpc.cluster import load_topology  # noqa: E402
from pdgrpc.colocated.server import ColocatedServer  # noqa: E402
from pdgrpc.cluster.reference import reference_engine  # noqa: E402
from pdgrpc.engine.base import SamplingParams  # noqa: E402
from pdgrpc.engine.colocated import generate as colocated_generate  # noqa: E402
from pdgrpc.gateway import colocated_service  # noqa: E402
from pdgrpc.gateway.requests import request_seed  # noqa: E402
from pdgrpc.rpc.drain import Drain  # noqa: E402
from pdgrpc.rpc.server import start_server  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def request(rid: str, ids, max_new: int, temperature: float = 0.0, **extra) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_new_tokens=max_new, n=1),
        logprob_start_len=-1, stream=True, **extra,
    )


async def ends_cancelled_and_released(call, impl: ColocatedServer) -> None:
    """An aborted Generate call ends CANCELLED, and the server then holds no request."""
    with pytest.raises(grpc.aio.AioRpcError) as info_:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert info_.value.code() == grpc.StatusCode.CANCELLED
    await eventually_async(lambda: impl.active_requests() == 0, 10, 0.05, lambda: "an aborted request is still held")


async def test_generate_stop_tokens_logprobs_and_abort():
    topology = load_topology("colocated")
    impl = ColocatedServer(reference_engine(topology), chunk_tokens=64)
    server = await start_server([colocated_service(impl, argparse.Namespace(served_model_name="m"), Drain())], what="test colocated")
    reference = reference_engine(topology)
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.server_args["disaggregation_mode"] == "null"
            for ids, n, t in [((256, *b"hello"), 12, 0.0), (tuple(b"abc"), 9, 1.25)]:
                (want,) = colocated_generate(reference, [ids], n, SamplingParams(temperature=t, seed=request_seed("a")))
                msgs = [m async for m in stub.Generate(request("a", ids, n, t, return_logprob=True, top_logprobs_num=2))]
                chunks, done = [m.chunk for m in msgs[:-1]], msgs[-1].complete
                assert [t for c in chunks for t in c.token_ids] == list(done.output_ids) == list(want.token_ids)
                assert done.finish_reason == {"eos": "stop", "length": "length"}[want.finish_reason]
                assert len(done.output_logprobs.token_logprobs) == len(want.token_ids)
                assert all(len(x.token_ids) == 2 for x in done.output_logprobs.top_logprobs)
                # The same request with its third token as a stop token id ends there.
                stop = want.token_ids[2]
                req = request("a", ids, n, t)  # the same id: the same seed (smg sends none)
                req.sampling_params.stop_token_ids.append(stop)
                done = [m async for m in stub.Generate(req)][-1].complete
                cut = list(want.token_ids).index(stop) + 1
                assert list(done.output_ids) == list(want.token_ids[:cut]) and done.matched_token_id == stop
            # A PD request is refused here; an Abort ends a running request and frees it.
            req = request("c", (256,), 4)
            req.disaggregated_params.bootstrap_host = "x"
            with pytest.raises(grpc.aio.AioRpcError) as info_:
                [m async for m in stub.Generate(req)]
            assert info_.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "colocated" in info_.value.details()
            req = request("long", (256,), 1500)
            req.sampling_params.ignore_eos = True
            call = stub.Generate(req)
            await call.read()
            assert (await stub.Abort(pb.AbortRequest(request_id="long"))).success
            await ends_cancelled_and_released(call, impl)
    finally:
        await server.stop(0)
        await impl.close()


async def test_health_check_reports_a_drain_while_a_request_runs():
    """smg's HealthCheck on the facade says not healthy once the server drains, while the
    request it admitted before still streams to its end."""
    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64)
    drain = Drain()
    server = await start_server(
        [colocated_service(impl, argparse.Namespace(served_model_name="m"), drain)], what="test colocated", drain=drain
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
            req = request("long", (256,), 300)
            req.sampling_params.ignore_eos = True
            call = stub.Generate(req)
            await call.read()
            server.start_drain(30.0)
            await eventually_async(lambda: drain.draining, 5, 0.01, lambda: "the drain did not start")
            health = await stub.HealthCheck(pb.HealthCheckRequest())
            assert not health.healthy and "draining" in health.message
            last = None
            while (msg := await call.read()) is not grpc.aio.EOF:
                last = msg
            assert last is not None and last.complete.finish_reason == "length"
    finally:
        await server.stop(0)
        await impl.close()


async def test_an_abort_reason_over_the_limit_is_refused_and_the_request_runs_on():
    """An Abort's reason is logged and becomes the aborted call's status message: one of
    megabytes filled the log and ended the call RESOURCE_EXHAUSTED instead of CANCELLED."""
    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64)
    server = await start_server([colocated_service(impl, argparse.Namespace(served_model_name="m"), Drain())], what="test colocated")
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            req = request("long", (256,), 1500)
            req.sampling_params.ignore_eos = True
            call = stub.Generate(req)
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as info_:
                await stub.Abort(pb.AbortRequest(request_id="long", reason="x" * 100_000))
            assert info_.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info_.value.details() == "Abort: reason: 100000 characters, over the limit of 1024"
            assert (await stub.Abort(pb.AbortRequest(request_id="long", reason="x" * 1024))).success
            with pytest.raises(grpc.aio.AioRpcError) as info_:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info_.value.code() == grpc.StatusCode.CANCELLED and info_.value.details().endswith("x" * 1024)
    finally:
        await server.stop(0)
        await impl.close()


async def test_request_ids_are_each_callers_own(tmp_path):
    """Two callers may run requests under one request_id: neither is refused because of the
    other's, and neither can abort the other's. Requests without an id run side by side."""
    from pdgrpc.rpc.certs import issue, make_ca
    from pdgrpc.rpc.roles import GATEWAY
    from pdgrpc.rpc.security import Security

    ca = make_ca(tmp_path)
    server_cert, a, b = (issue(ca, tmp_path, name, role=GATEWAY) for name in ("worker", "smg-a", "smg-b"))

    def security(c):
        return Security(cert=c.cert, key=c.key, ca=ca.cert)

    def long(rid):
        req = request(rid, (256,), 1500)
        req.sampling_params.ignore_eos = True
        return req

    async def finish(stub, req):
        return [m async for m in stub.Generate(req)][-1].complete.finish_reason

    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64)
    server = await start_server(
        [colocated_service(impl, argparse.Namespace(served_model_name="m"), Drain())], what="test colocated",
        security=security(server_cert),
    )
    try:
        async with security(a).channel(server.address) as ch_a, security(b).channel(server.address) as ch_b:
            stub_a, stub_b = pb_grpc.SglangSchedulerStub(ch_a), pb_grpc.SglangSchedulerStub(ch_b)
            call_a = stub_a.Generate(long("same"))
            await call_a.read()
            assert await finish(stub_b, request("same", (256, 65), 3)) == "length"
            assert not (await stub_b.Abort(pb.AbortRequest(request_id="same"))).success
            with pytest.raises(grpc.aio.AioRpcError) as info_:  # a's own second one is a duplicate
                await finish(stub_a, request("same", (256, 65), 3))
            assert info_.value.code() == grpc.StatusCode.ALREADY_EXISTS
            unnamed = stub_a.Generate(long(""))
            await unnamed.read()
            assert await finish(stub_a, request("", (256, 66), 3)) == "length"
            unnamed.cancel()
            assert (await stub_a.Abort(pb.AbortRequest(request_id="same"))).success
            await ends_cancelled_and_released(call_a, impl)
    finally:
        await server.stop(0)
        await impl.close()
