"""``python -m pdgrpc.client`` and gRPC server reflection, against a real 1p1d cluster.

The client command runs as a subprocess, the way a user types it: plain text, ``--json``,
``--stream`` and ``--chat``; its printed seed replays a sampled output exactly. Reflection
is what ``grpcurl`` relies on: grpc's reflection client lists every server's services,
and a Generate call built only from the descriptors the router serves (no generated
code) gets the tokens that the generated client gets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.e2e.harness import wait_nothing_held

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    async with Cluster("1p1d", transport="tcp", start_timeout=120) as c:
        yield c


def client(router: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run(
        [sys.executable, "-m", "pdgrpc.client", router, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )


async def test_the_client_command_prints_text_timings_and_a_seed_that_replays(cluster):
    router = cluster.router_address
    plain = client(router, "The capital of France is", "--max-new-tokens", "6")
    assert plain.returncode == 0, plain.stderr
    text, summary = plain.stdout.rsplit("\n", 2)[-3:-1]
    assert "6 tokens, finish length; ttft" in summary and "kv " in summary and " GB/s" in summary and "seed " in summary

    full = json.loads(client(router, "The capital of France is", "--max-new-tokens", "6", "--json").stdout)
    assert full["text"] == text and len(full["token_ids"]) == 6 and full["ttft_seconds"] > 0
    # A repeated prompt may be served from the decode's prefix cache, moving no KV.
    assert isinstance(full["bytes_transferred"], int) and full["bytes_transferred"] >= 0

    streamed = client(router, "The capital of France is", "--max-new-tokens", "6", "--stream", "--json")
    assert streamed.returncode == 0, streamed.stderr
    *messages, done = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert "".join(m.get("text", "") for m in messages) == text == done["text"]
    assert "ttft_seconds" in messages[0] and "seed" in messages[0] and len(messages) == done["messages"]

    sampled = [json.loads(client(router, "hello", "--temperature", "1", "--ignore-eos", "--json").stdout) for _ in range(2)]
    assert sampled[0]["token_ids"] != sampled[1]["token_ids"]
    again = json.loads(client(router, "hello", "--temperature", "1", "--ignore-eos", "--json", "--seed", str(sampled[0]["seed"])).stdout)
    assert again["token_ids"] == sampled[0]["token_ids"] and again["seed"] == sampled[0]["seed"]

    chat = json.loads(client(router, "hello there", "--chat", "--json", "--max-new-tokens", "4").stdout)
    async with grpc.aio.insecure_channel(router) as channel:  # the byte tokenizer's template, rendered; no BOS
        want = await generate(GenerateServiceStub(channel), input_ids=list(b"user: hello there\nassistant: "), max_new_tokens=4)
    assert chat["token_ids"] == list(want.token_ids)

    failed = client("127.0.0.1:1", "hello", "--timeout", "2")
    assert failed.returncode == 1 and "127.0.0.1:1: UNAVAILABLE" in failed.stderr
    bad = client(router, "hello", "--max-new-tokens", "0")
    assert bad.returncode == 2 and "--max-new-tokens" in bad.stderr
    await wait_nothing_held(cluster)


async def test_reflection_describes_every_server_and_drives_a_call(cluster):
    expected = {
        "router": "pdgrpc.v1.GenerateService", "prefill": "pdgrpc.v1.PrefillService",
        "decode": "pdgrpc.v1.DecodeService",
    }
    for name, service in expected.items():
        with grpc.insecure_channel(cluster.address(name)) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            assert {service, "grpc.health.v1.Health"} <= set(db.get_services()), name
            pool = descriptor_pool.DescriptorPool(db)
            assert pool.FindServiceByName(service).methods, name

    with grpc.insecure_channel(cluster.router_address) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("pdgrpc.v1.GenerateService").FindMethodByName("Generate")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = request_cls(prompt="hello", sampling={"max_new_tokens": 5, "seed": 0})
        call = channel.unary_stream(
            "/pdgrpc.v1.GenerateService/Generate", request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        replies = list(call(request, timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 5 and replies[0].ttft_seconds > 0 and replies[0].seed == 0
    assert replies[-1].finish_reason == "length"
    await wait_nothing_held(cluster)


def _readme_grpcurl() -> tuple[list[str], str, str]:
    """The README's grpcurl session: the services ``list`` prints, and the method and JSON
    body of its Generate call. grpcurl itself is not installable here (no Debian package;
    its PyPI wrapper downloads a release binary at run time), so this test does what it
    does, through the same reflection service."""
    text = (REPO / "README.md").read_text()
    block = text.split("$ grpcurl -plaintext 127.0.0.1:PORT list\n", 1)[1].split("```", 1)[0]
    listed, call = block.split("$ grpcurl", 1)
    body = re.search(r"-d '(.*?)'", call)
    method = re.search(r"127\.0\.0\.1:PORT (\S+)", call)
    assert body is not None and method is not None, call
    return listed.split(), method.group(1), body.group(1)


async def test_the_readme_grpcurl_session_holds_against_the_router(cluster):
    listed, method, body = _readme_grpcurl()
    with grpc.insecure_channel(cluster.router_address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert sorted(db.get_services()) == listed  # what `grpcurl list` prints, in its order
        service, name = method.rsplit("/", 1)
        desc = descriptor_pool.DescriptorPool(db).FindServiceByName(service).FindMethodByName(name)
        request_cls = message_factory.GetMessageClass(desc.input_type)
        response_cls = message_factory.GetMessageClass(desc.output_type)
        request = json_format.Parse(body, request_cls())  # grpcurl's -d: JSON, field names as in the .proto
        call = channel.unary_stream(
            f"/{method}", request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString,
        )
        replies = list(call(request, timeout=30))
    assert sum(len(r.token_ids) for r in replies) == request.sampling.max_new_tokens > 0
    assert replies[-1].finish_reason == "length" and replies[0].ttft_seconds > 0
    await wait_nothing_held(cluster)


async def test_a_plaintext_call_to_a_tls_server_says_to_pass_its_ca(tmp_path):
    # A local cluster serves mTLS by default: the client without --tls-ca is refused at the
    # TLS layer, and gRPC says only UNAVAILABLE. The client finds the server speaks TLS and says so.
    from pdgrpc.rpc.certs import issue, make_ca

    ca = make_ca(tmp_path)
    cert = issue(ca, tmp_path, "server")
    creds = grpc.ssl_server_credentials(
        [(cert.key.read_bytes(), cert.cert.read_bytes())], root_certificates=ca.cert.read_bytes(), require_client_auth=True,
    )
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        refused = client(f"127.0.0.1:{port}", "hello", "--timeout", "5")
    finally:
        await server.stop(0)
    assert refused.returncode == 1 and f"127.0.0.1:{port}: UNAVAILABLE" in refused.stderr
    assert "speaks TLS" in refused.stderr and "--tls-ca" in refused.stderr, refused.stderr
    nothing = client("127.0.0.1:1", "hello", "--timeout", "2")
    assert nothing.returncode == 1 and "TLS" not in nothing.stderr, nothing.stderr


@pytest.mark.parametrize("flag, value", [
    ("--top-k", "-1"), ("--seed", "-5"), ("--seed", str(2**64)), ("--temperature", "-1"), ("--top-p", "2"),
    ("--timeout", "0"), ("--timeout", "-1"), ("--timeout", "nan"), ("--top-k", str(2**32)), ("--max-new-tokens", str(2**32)),
])
async def test_a_sampling_flag_out_of_range_is_a_usage_error_naming_it(flag, value):
    # Refused before any call: nothing listens at 127.0.0.1:1, so a call would fail otherwise.
    out = client("127.0.0.1:1", "hello", flag, value)
    assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr, out.stderr
