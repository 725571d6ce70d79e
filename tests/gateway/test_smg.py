"""End to end with the real smg (pdgrpc[gateway]) in PD mode in front of pdgrpc's servers.

One cluster per (topology, transport): smg-1p1d over tcp, and smg-2p2d (two prefills x
two decodes) over rdma. Outputs are compared with colocated generation of the same token
ids (a ReferenceEngine built from the topology's own [engine] table): exact token ids
always, and the text wherever the output bytes are valid UTF-8 (smg's byte-level decoder
is deterministic there). smg 1.13.0 forwards no seed, so each sampled request runs at the
seed the workers draw from its request id, which smg's reply carries; the reference runs
at that seed too. Unseeded requests differ from one another, and ``n = 2`` gives two
different choices.

The protocol tests call the servers' SglangScheduler directly with what smg would never
send. Prefills run with a shorter --max-prompt-tokens than the decodes, so a prompt
between the two fails on the prefill leg only (a prefill failure smg must report), and
with short handshake/waiting deadlines, so the two legs disagreeing on the room ends in
seconds. Every prefill and decode runs its transport through
``tests.gateway.faulty:FailsLongPrompts*``: a prompt of ``MIN_PAGES`` pages or more fails
mid-transfer on the prefill leg, after the decode's handshake (shorter ones are untouched).
The last test kills the prefill's worker, so that its controller refuses the prefill leg.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from pdgrpc.cluster import Cluster, load_topology  # noqa: E402
from pdgrpc.cluster.topology import Topology  # noqa: E402
from pdgrpc.engine.tokenizer import EOS_ID, ByteTokenizer  # noqa: E402
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME  # noqa: E402
from pdgrpc.gateway.requests import request_seed  # noqa: E402
from pdgrpc.gateway.tokenizer import tokenizer_zip  # noqa: E402
from tests.e2e.harness import HELD_FIELDS, Case, Counters, reference_outputs, skip_unless_transport, wait_nothing_held  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402
from tests.gateway import smg_http  # noqa: E402
from tests.gateway.faulty import MIN_PAGES  # noqa: E402
from tests.prefill.procs import child_pids, pid_alive  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

# Each topology and each transport once: a third cluster (smg-1p1d on rdma) adds no check.
PARAMS = [("smg-1p1d", "tcp"), ("smg-2p2d", "rdma")]
PREFILL_MAX_PROMPT = 200  # the decodes keep the [engine] table's 1024
WRAPPERS = {"tcp": "tests.gateway.faulty:FailsLongPromptsTcp", "rdma": "tests.gateway.faulty:FailsLongPromptsRdma"}
# A failed prefill leg frees everything on every server this soon (the bound); the
# decodes' own waiting deadline (4 s) is longer, so only the prefill's signal meets it.
FREE_WITHIN_S = 2.0
MODEL = DEFAULT_SERVED_MODEL_NAME
REPO = Path(__file__).resolve().parents[2]


def gateway_topology(name: str, transport: str) -> Topology:
    topo = load_topology(name)
    procs = []
    wrapper = WRAPPERS[transport]
    for p in topo.processes:
        if p.role == "prefill":
            p = dataclasses.replace(
                p, args={**p.args, "max-prompt-tokens": PREFILL_MAX_PROMPT, "handshake-timeout": 3, "transport": wrapper}
            )
        elif p.role == "decode":
            p = dataclasses.replace(p, args={**p.args, "bootstrap-timeout": 3, "waiting-timeout": 4, "transport": wrapper})
        procs.append(p)
    return dataclasses.replace(topo, processes=tuple(procs))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=PARAMS, ids=[f"{t}-{x}" for t, x in PARAMS])
async def cluster(request):
    name, transport = request.param
    skip_unless_transport(transport)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    async with Cluster(gateway_topology(name, transport), transport=transport, start_timeout=180, metrics=True, extra_env=env) as c:
        yield c


def base(cluster: Cluster) -> str:
    return cluster.openai_base_url.removesuffix("/v1")


async def call(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


def expected_text(ids: tuple[int, ...]) -> str | None:
    """The text smg must show for ``ids`` (specials dropped), or None where the bytes are
    not valid UTF-8 (then only the token ids are compared)."""
    try:
        return bytes(t for t in ids if t < 256).decode("utf-8")
    except UnicodeDecodeError:
        return None


def seeded(c: Case, request_id: str) -> Case:
    """``c`` at the seed the workers drew for smg's request ``request_id`` (smg forwards no
    seed; its replies carry the request id)."""
    return dataclasses.replace(c, seed=request_seed(request_id))


def of_process(counters: Counters, name: str) -> Counters:
    """The counters of one process's endpoints (a prefill's controller and its workers)."""
    return Counters({k: v for k, v in counters.scrapes.items() if k.split("/")[0] == name})


OPENAI_REASON = {"eos": "stop", "length": "length"}

CASES = [  # (max_new_tokens, temperature, top_k): temperatures exact in float32 (smg's wire type)
    (12, 0.0, 0), (20, 0.5, 0), (7, 1.25, 20), (1, 0.0, 0), (16, 1.0, 0),
]


async def test_models_lists_the_served_model_name(cluster):
    status, body = await call(smg_http.get, base(cluster), "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]


async def test_generate_returns_the_token_ids_of_colocated_generation(cluster):
    prompts = [(256, *b"The quick brown fox"), (256, *b"KV pages move"), tuple(b"no BOS here"), (256,)]
    cases = [Case(ids, n, temperature=t, top_k=k) for ids in prompts for n, t, k in CASES]
    before = await Counters.read(cluster)

    async def one(c: Case):
        body = {"model": MODEL, "input_ids": list(c.input_ids),
                "sampling_params": {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature, "top_k": c.top_k or -1}}
        return await call(smg_http.post, base(cluster), "/generate", body)

    got = await asyncio.gather(*(one(c) for c in cases))
    assert all(status == 200 for status, _ in got), got
    expected = reference_outputs(cluster.topology.name, [seeded(c, body[0]["meta_info"]["id"]) for c, (_, body) in zip(cases, got)])
    for c, (status, body), (ids, reason) in zip(cases, got, expected):
        (out,) = body
        assert tuple(out["output_ids"]) == ids, c
        assert out["meta_info"]["finish_reason"]["type"] == OPENAI_REASON[reason], c
        if reason == "eos":
            assert out["meta_info"]["matched_stop"] == EOS_ID
        assert out["meta_info"]["completion_tokens"] == len(ids)
    await wait_nothing_held(cluster)
    # smg spread the requests over every prefill and every decode (2 x 2 in smg-2p2d).
    after = await Counters.read(cluster)
    for role in ("prefill", "decode"):
        for name in [p.name for p in cluster.topology.by_role(role)]:
            served = of_process(after, name).delta(of_process(before, name), "pdgrpc_requests_total", role, state="finished")
            assert served > 0, f"{name} served none"


async def test_completions_and_chat_return_the_text_of_colocated_generation(cluster):
    prompts = ["The capital of France is", "Disaggregated serving moves KV pages", "hi"]
    chat_prompt = [{"role": "user", "content": "hello there"}]
    chat_ids = tuple(b"user: hello there\nassistant: ")  # the exported chat template; smg adds no BOS
    cases = [Case(tuple(p.encode()), n, temperature=t, top_k=k) for p in prompts for n, t, k in CASES]
    chat_cases = [Case(chat_ids, n, temperature=t, top_k=k) for n, t, k in CASES]
    texts = 0

    def params(c: Case) -> dict:
        return {"model": MODEL, "max_tokens": c.max_new_tokens, "temperature": c.temperature, "top_k": c.top_k or -1}

    answers = []  # (case, full reply, streamed events): each request samples with its own id's seed
    for c in cases:
        body = {**params(c), "prompt": bytes(c.input_ids).decode()}
        (status, full), (s_status, events) = await asyncio.gather(
            call(smg_http.post, base(cluster), "/v1/completions", body),
            call(smg_http.stream, base(cluster), "/v1/completions", body),
        )
        assert status == 200 and s_status == 200, (full, events)
        answers.append((c, full, events))
    chats = []
    for c in chat_cases:
        status, events = await call(smg_http.stream, base(cluster), "/v1/chat/completions", {**params(c), "messages": chat_prompt})
        assert status == 200, events
        chats.append((c, events))
    runs = [seeded(c, r["id"]) for c, full, events in answers for r in (full, events[0])] + [seeded(c, e[0]["id"]) for c, e in chats]
    expected = iter(reference_outputs(cluster.topology.name, runs))
    for c, full, events in answers:
        (ids, reason), (s_ids, s_reason) = next(expected), next(expected)
        choice = full["choices"][0]
        assert full["usage"]["completion_tokens"] == len(ids) and full["usage"]["prompt_tokens"] == len(c.input_ids)
        assert choice["finish_reason"] == OPENAI_REASON[reason] and smg_http.finish_reason(events) == OPENAI_REASON[s_reason]
        for got, want in ((choice["text"], expected_text(ids)), (smg_http.streamed_text(events), expected_text(s_ids))):
            if want is not None:
                texts += 1
                assert got == want, c
    for c, events in chats:
        ids, reason = next(expected)
        assert smg_http.finish_reason(events) == OPENAI_REASON[reason]
        want = expected_text(ids)
        if want is not None:
            texts += 1
            assert smg_http.streamed_text(events) == want, c
    assert texts >= len(CASES), "too few outputs were valid UTF-8 for the text checks to mean anything"
    await wait_nothing_held(cluster)


async def test_unseeded_requests_and_the_choices_of_n_2_sample_differently(cluster):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 16, "temperature": 1.0}
    replies = await asyncio.gather(*(call(smg_http.post, base(cluster), "/v1/completions", body) for _ in range(2)))
    assert all(status == 200 for status, _ in replies), replies
    texts = [r["choices"][0]["text"] for _, r in replies]
    case = Case(tuple(b"hello"), 16, temperature=1.0)
    # Each is colocated generation at the seed of its own request id, so the two differ
    # unless the tiny model's peaked distribution gives both seeds the same text.
    want = reference_outputs(cluster.topology.name, [seeded(case, r["id"]) for _, r in replies])
    for text, (ids, _) in zip(texts, want):
        assert expected_text(ids) in (text, None)
    assert replies[0][1]["id"] != replies[1][1]["id"] and (texts[0] != texts[1] or want[0][0] == want[1][0])
    status, reply = await call(smg_http.post, base(cluster), "/v1/completions", {**body, "n": 2})
    assert status == 200, reply
    a, b = (c["text"] for c in reply["choices"])
    # smg sends each choice as a request of its own, id suffixed -0, -1: the text of each
    # is colocated generation at one of those ids' seeds, one each. smg lists the choices
    # as they finish, so either order.
    want = reference_outputs(cluster.topology.name, [seeded(case, f"{reply['id']}-{i}") for i in range(2)])
    texts = [expected_text(ids) for ids, _ in want]
    assert any(all(w in (t, None) for w, t in zip(texts, order)) for order in ((a, b), (b, a))), (a, b, texts)
    assert a != b or want[0][0] == want[1][0]
    await wait_nothing_held(cluster)


async def test_what_smg_drops_as_docs_gateway_md_says(cluster):
    """smg 1.13.0 drops logit_bias and /v1/completions logprobs without an error (the
    table in docs/gateway.md): when it starts forwarding them, the facade and the docs
    must change."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    (s1, plain), (s2, biased), (s3, with_logprobs) = await asyncio.gather(
        call(smg_http.post, base(cluster), "/v1/completions", body),
        call(smg_http.post, base(cluster), "/v1/completions", {**body, "logit_bias": {"65": 100}}),
        call(smg_http.post, base(cluster), "/v1/completions", {**body, "logprobs": 2}),
    )
    assert s1 == s2 == s3 == 200, (plain, biased, with_logprobs)
    assert biased["choices"][0]["text"] == plain["choices"][0]["text"] != "A" * 8
    assert with_logprobs["choices"][0].get("logprobs") is None
    await wait_nothing_held(cluster)


async def test_a_repeated_prompt_reports_its_cached_tokens_in_the_usage(cluster):
    # 60 tokens (smg adds no BOS): a repeat served by the same prefill reuses 3 full pages.
    prompt = "Prefix caching: the second time, only the last page computes."[:60]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    cached = []
    for _ in range(4):  # at least two land on one prefill, however smg spreads them
        status, full = await call(smg_http.post, base(cluster), "/v1/completions", body)
        assert status == 200, full
        cached.append((full["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        await wait_nothing_held(cluster)  # the prefill room ended: its pages are cached
    assert cached[0] == 0 and max(cached) == 48 and set(cached) <= {0, 48}, cached


async def test_a_prefill_that_refuses_gives_an_http_error_and_frees_everything_at_once(cluster):
    prompt = "x" * (PREFILL_MAX_PROMPT + 50)  # the decodes accept it, the prefills refuse it
    before = await Counters.read(cluster)
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})
    assert status >= 400, body
    assert "max_prompt_tokens" in str(body), body
    # smg aborts no leg: the decode ends its leg because the prefill said the room failed.
    await wait_nothing_held(cluster, timeout=FREE_WITHIN_S)
    after = await Counters.read(cluster)
    # The prefill refused the prompt as invalid: the client's mistake, not a failing prefill.
    assert after.requests(before, "decode") == {"finished": 0, "aborted": 1, "refused": 0, "aborted:bad_request": 1}
    # and the cluster still serves
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 3})
    assert status == 200, body
    await wait_nothing_held(cluster)


async def test_a_prefill_that_fails_at_its_start_fails_the_decode_leg_at_once(cluster):
    # Fits the pages a handshake may carry (13 pages of 16) but not --max-prompt-tokens:
    # the handshake is accepted (early or not), then the prefill refuses the prompt.
    prompt = "z" * (PREFILL_MAX_PROMPT + 5)
    before = await Counters.read(cluster)
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})
    assert status >= 400 and "max_prompt_tokens" in str(body), body
    await wait_nothing_held(cluster, timeout=FREE_WITHIN_S)
    after = await Counters.read(cluster)
    assert after.requests(before, "decode") == {"finished": 0, "aborted": 1, "refused": 0, "aborted:bad_request": 1}


async def test_a_prefill_that_fails_mid_transfer_gives_an_http_error_and_frees_everything_at_once(cluster):
    prompt = "y" * (MIN_PAGES * 16 + 20)  # under the prefills' limit; fails mid-transfer (tests.gateway.faulty)
    before = await Counters.read(cluster)
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})
    assert status >= 400, body
    assert "injected transfer fault" in str(body), body
    await wait_nothing_held(cluster, timeout=FREE_WITHIN_S)
    after = await Counters.read(cluster)
    assert after.requests(before, "decode") == {"finished": 0, "aborted": 1, "refused": 0, "aborted:prefill_error": 1}
    assert after.requests(before, "prefill")["aborted"] == 1
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 3})
    assert status == 200, body
    await wait_nothing_held(cluster)


async def test_a_client_that_disconnects_mid_stream_frees_both_sides(cluster):
    before = await Counters.read(cluster)
    body = {"model": MODEL, "prompt": "keep going " * 8, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    status, events = await call(smg_http.stream, base(cluster), "/v1/completions", body, stop_after=3)
    assert status == 200 and len(events) >= 3 and smg_http.finish_reason(events) is None
    await wait_nothing_held(cluster, timeout=30)
    # The decode ended it as cancelled, long before its 1500 tokens.
    after = await Counters.read(cluster)
    assert after.requests(before, "decode") == {"finished": 0, "aborted": 1, "refused": 0, "aborted:cancelled": 1}
    assert after.delta(before, "pdgrpc_output_tokens_total", "decode") < 1500


# ---- the protocol, called directly ----------------------------------------------------------


def stub(cluster: Cluster, name: str) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(cluster.channel(name))


def first(cluster: Cluster, role: str) -> str:
    return cluster.topology.by_role(role)[0].name


def gen_request(cluster: Cluster, rid: str, room: int = 7, ids=(256, 104, 105), max_new: int = 4) -> pb.GenerateRequest:
    prefill = first(cluster, "prefill")
    host, _, port = cluster.address(prefill).rpartition(":")
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(top_p=1.0, top_k=-1, repetition_penalty=1.0, max_new_tokens=max_new, n=1),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room),
        logprob_start_len=-1, stream=True,
    )


async def rpc_error(call_) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call_:
            pass
    return info.value


async def test_info_rpcs_describe_a_consistent_pair(cluster):
    p, d = stub(cluster, first(cluster, "prefill")), stub(cluster, first(cluster, "decode"))
    for s in (p, d):
        assert (await s.HealthCheck(pb.HealthCheckRequest())).healthy
        info = await s.GetModelInfo(pb.GetModelInfoRequest())
        assert info.served_model_name == MODEL and list(info.eos_token_ids) == [EOS_ID]
        loads = await s.GetLoads(pb.GetLoadsRequest())
        assert loads.aggregate.total_running_reqs == 0
    ps, ds = (await p.GetServerInfo(pb.GetServerInfoRequest())).server_args, (await d.GetServerInfo(pb.GetServerInfoRequest())).server_args
    assert (ps["disaggregation_mode"], ds["disaggregation_mode"]) == ("prefill", "decode")
    assert ps["disaggregation_transfer_backend"] == ds["disaggregation_transfer_backend"] == f"pdgrpc-{WRAPPERS[cluster.transport]}"
    assert int(ps["disaggregation_bootstrap_port"]) == int(cluster.bootstrap_address(first(cluster, "prefill")).rpartition(":")[2])
    chunks = [c async for c in p.GetTokenizer(smg_common_pb2.GetTokenizerRequest())]
    data, sha = tokenizer_zip(ByteTokenizer().hf_files())
    assert b"".join(c.data for c in chunks) == data and chunks[-1].sha256 == sha


async def test_bad_requests_are_refused_naming_the_field(cluster):
    p, d = stub(cluster, first(cluster, "prefill")), stub(cluster, first(cluster, "decode"))
    reply = await d.Abort(pb.AbortRequest(request_id="never-seen"))
    assert not reply.success and "nothing to abort" in reply.message
    for s in (p, d):
        req = gen_request(cluster, "no-dp")
        req.ClearField("disaggregated_params")
        err = await rpc_error(s.Generate(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "disaggregated_params" in err.details()
        req = gen_request(cluster, "unsupported")
        req.sampling_params.frequency_penalty = 0.5
        err = await rpc_error(s.Generate(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling_params.frequency_penalty" in err.details()
        err = await rpc_error(s.Generate(gen_request(cluster, "empty", ids=())))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenized.input_ids" in err.details()
        err = await rpc_error(s.Generate(gen_request(cluster, "too-long", max_new=4000)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len" in err.details(), err.details()
    await wait_nothing_held(cluster)


# Waits out the short deadlines (~4 s): on the first cluster only; the path does not
# depend on the transport or the topology's size.
@pytest.mark.parametrize("cluster", PARAMS[:1], ids=[f"{t}-{x}" for t, x in PARAMS[:1]], indirect=True)
async def test_legs_that_disagree_on_the_room_fail_and_free_everything(cluster):
    p, d = stub(cluster, first(cluster, "prefill")), stub(cluster, first(cluster, "decode"))
    p_err, d_err = await asyncio.gather(
        rpc_error(p.Generate(gen_request(cluster, "split", room=11))),
        rpc_error(d.Generate(gen_request(cluster, "split", room=12))),
    )
    assert p_err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, p_err.details()
    assert d_err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED), d_err.details()
    await wait_nothing_held(cluster)


async def test_abort_ends_a_running_leg_and_frees_it(cluster):
    d = stub(cluster, first(cluster, "decode"))
    leg = d.Generate(gen_request(cluster, "to-abort", room=21))  # no prefill leg: it waits for the KV
    await asyncio.sleep(0.5)
    assert (await cluster.stats(first(cluster, "decode"))).active_requests == 1
    reply = await d.Abort(pb.AbortRequest(request_id="to-abort", reason="test"))
    assert reply.success
    err = await rpc_error(leg)
    assert err.code() == grpc.StatusCode.CANCELLED
    await wait_nothing_held(cluster)


async def _decode_free(cluster: Cluster, name: str, seen: dict) -> bool:
    stats = await cluster.stats(name)
    seen.clear()
    seen.update({f: getattr(stats, f) for f in HELD_FIELDS if getattr(stats, f)})
    return not seen


# A planned restart of a decode smg uses (docs/gateway.md): its running legs finish. On
# the first cluster only: the drain is the same server code on every transport.
@pytest.mark.parametrize("cluster", PARAMS[:1], ids=[f"{t}-{x}" for t, x in PARAMS[:1]], indirect=True)
async def test_a_decode_restarted_under_smg_finishes_its_running_legs(cluster):
    decode = first(cluster, "decode")
    proc = cluster.procs[decode]
    log_from = proc.log_path.stat().st_size
    # Greedy, so that two references cover them; long enough that all run at once. Six:
    # the default thread pool's size on two cores (each HTTP call holds a thread).
    cases = [Case((256, *f"drain {i % 2} under smg".encode()), 96) for i in range(6)]
    expected = reference_outputs(cluster.topology.name, cases[:2])

    async def one(c: Case):
        body = {"model": MODEL, "input_ids": list(c.input_ids), "sampling_params": {"max_new_tokens": c.max_new_tokens, "temperature": 0}}
        return await call(smg_http.post, base(cluster), "/generate", body)

    running = [asyncio.ensure_future(one(c)) for c in cases]

    async def all_running() -> bool:
        return (await cluster.stats(decode)).active_requests == len(cases)

    await eventually_async(all_running, 30, 0.01, "the decode never held every leg at once")
    restart = asyncio.ensure_future(cluster.restart(decode))  # SIGTERM: it drains
    got = await asyncio.gather(*running)
    await restart
    log = proc.log_path.read_text()[log_from:]
    assert f"draining: {len(cases)} call(s) in flight" in log and "drain_timeout" not in log, log[-2000:]
    assert [status for status, _ in got] == [200] * len(cases), [body for status, body in got if status != 200]
    for i, (_, body) in enumerate(got):
        assert (tuple(body[0]["output_ids"]), body[0]["meta_info"]["finish_reason"]["type"]) == (
            expected[i % 2][0], OPENAI_REASON[expected[i % 2][1]]), i
    # smg takes the decode started again back once its health checks pass (every 1 s);
    # then its next request reaches it.
    async def ready() -> bool:
        return (await call(smg_http.get, base(cluster), "/readiness"))[0] == 200

    await eventually_async(ready, 30, 0.2, "smg never took the restarted decode back")
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 3})
    assert status == 200, body
    await wait_nothing_held(cluster)


# The prefill's controller refuses a leg before any worker sees it (here its only worker
# is dead and not started again yet), so no worker can tell the decode: the controller
# records the failure with its bootstrap, where the decode, whose handshake finds no
# worker, asks. On the first cluster only: the notice travels the control plane alone.
# Last in the file: it kills the prefill's worker (smg then keeps the prefill out of its
# rotation for a while).
@pytest.mark.parametrize("cluster", PARAMS[:1], ids=[f"{t}-{x}" for t, x in PARAMS[:1]], indirect=True)
async def test_a_prefill_leg_refused_by_the_controller_fails_the_decode_leg_at_once(cluster):
    prefill, decode = first(cluster, "prefill"), first(cluster, "decode")
    before = of_process(await Counters.read(cluster), decode)
    (worker,) = child_pids(cluster.procs[prefill].pid)
    os.kill(worker, signal.SIGKILL)
    p = stub(cluster, prefill)

    async def noticed() -> bool:
        return not pid_alive(worker) and not (await p.HealthCheck(pb.HealthCheckRequest())).healthy

    await eventually_async(noticed, 5, 0.01, "the controller notices its worker died")
    status, body = await call(smg_http.post, base(cluster), "/v1/completions", {"model": MODEL, "prompt": "no worker", "max_tokens": 8})
    assert status >= 500 and ("no live prefill worker" in str(body) or "is dead" in str(body)), body
    # Well before the decode's own deadlines (bootstrap 3 s, waiting 4 s).
    seen: dict = {}
    await eventually_async(lambda: _decode_free(cluster, decode, seen), FREE_WITHIN_S, 0.05, lambda: f"the decode still holds {seen}")

    # The controller starts the worker again; then nothing is held anywhere. (smg itself
    # may keep the prefill out of its rotation for a while: its retries opened its circuit
    # breaker. Hence last in the file.)
    async def serves_again() -> bool:
        return (await p.HealthCheck(pb.HealthCheckRequest())).healthy

    await eventually_async(serves_again, 60, 0.2, "the prefill's worker is started again")
    await wait_nothing_held(cluster)
    got = of_process(await Counters.read(cluster), decode).requests(before, "decode")
    # Every decode leg smg sent (smg retries a failed request) ended as a prefill error.
    assert got["finished"] == 0 and got["aborted"] >= 1 and got["aborted"] == got.get("aborted:prefill_error"), got
