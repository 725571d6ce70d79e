"""smg's GenerateRequest -> pdgrpc's request (pure): rooms, sampling, refused fields."""

from __future__ import annotations

import hashlib
import io
import json
import random
import zipfile

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.errors import RequestFailed  # noqa: E402
from pdgrpc.gateway.requests import DEFAULT_MAX_NEW_TOKENS, ROOM_BASE, convert, map_room, request_seed  # noqa: E402
from pdgrpc.engine.tokenizer import ByteTokenizer  # noqa: E402
from pdgrpc.engine.tokenizer_files import byte_symbols  # noqa: E402
from pdgrpc.gateway.tokenizer import tokenizer_zip  # noqa: E402
from pdgrpc.router.service import draw_room  # noqa: E402


def request(**sampling: object) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id="r1",
        tokenized=pb.TokenizedInput(input_ids=[256, 104, 105]),
        sampling_params=pb.SamplingParams(temperature=0.5, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_new_tokens=8, n=1),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=4000, bootstrap_room=0),
        logprob_start_len=-1,
    )
    for k, v in sampling.items():
        if isinstance(v, dict):
            getattr(req.sampling_params, k).update(v)
        elif isinstance(v, list):
            getattr(req.sampling_params, k).extend(v)
        else:
            setattr(req.sampling_params, k, v)
    return req


def refused(req: pb.GenerateRequest, disaggregated: bool = True) -> str:
    with pytest.raises(RequestFailed) as info:
        convert(req, disaggregated=disaggregated, max_seq_len=2048)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


def test_a_plain_request_converts_field_by_field():
    g = convert(request(stop_token_ids=[10]), disaggregated=True, max_seq_len=2048)
    assert g.input_ids == (256, 104, 105)
    assert g.room == ROOM_BASE  # smg's room 0 is mapped, never 0
    assert g.bootstrap_address == "127.0.0.1:4000"
    s = g.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.max_new_tokens, s.ignore_eos) == (0.5, 0, 1.0, request_seed("r1"), 8, False)
    assert g.stop_token_ids == frozenset({10})


def test_rooms_map_into_a_band_the_router_never_draws():
    assert map_room(0) == ROOM_BASE and map_room(2**31 - 1) == ROOM_BASE + 2**31 - 1
    for bad in (-1, 2**31):  # smg's room is an int32 >= 0: its own range, checked here
        with pytest.raises(RequestFailed) as err:
            map_room(bad)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == f"disaggregated_params.bootstrap_room must be in [0, 2**31), got {bad}"
    rng = random.Random(3)
    rooms = [draw_room(lambda bits: ROOM_BASE + rng.randrange(2**31) if rng.random() < 0.5 else rng.getrandbits(bits)) for _ in range(200)]
    assert all(r != 0 and not ROOM_BASE <= r < ROOM_BASE + 2**31 for r in rooms)


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 0.1), ("frequency_penalty", 0.5), ("presence_penalty", -0.5), ("repetition_penalty", 1.2),
        ("min_new_tokens", 3), ("regex", "a+"), ("json_schema", "{}"), ("n", 2),
    ],
)
def test_fields_the_engine_cannot_honour_are_refused_by_name(field, value):
    req = request()
    if isinstance(value, list):
        getattr(req.sampling_params, field).extend(value)
    else:
        setattr(req.sampling_params, field, value)
    assert f"sampling_params.{field}" in refused(req)


def test_request_level_fields_the_engine_cannot_honour_are_refused_by_name():
    for name, setup in [
        ("logit_bias", lambda r: r.sampling_params.logit_bias.update({"5": 1.0})),
        ("lora_id", lambda r: setattr(r, "lora_id", "a")),
        ("return_hidden_states", lambda r: setattr(r, "return_hidden_states", True)),
        ("token_ids_logprob", lambda r: r.token_ids_logprob.append(3)),
        ("logprob_start_len", lambda r: (setattr(r, "return_logprob", True), setattr(r, "logprob_start_len", 0))),
        ("mm_inputs", lambda r: r.mm_inputs.image_urls.append("x")),
    ]:
        req = request()
        setup(req)
        assert name in refused(req), name


def test_bad_values_name_their_field():
    req = request()
    del req.tokenized.input_ids[:]
    assert "tokenized.input_ids is empty" in refused(req)
    assert "top_k" in refused(request(top_k=-2))
    assert "max_new_tokens must be >= 1" in refused(request(max_new_tokens=0))
    assert "temperature must be finite" in refused(request(temperature=float("nan")))
    assert "custom_params.seed" in refused(request(custom_params={"seed": 1.5}))
    assert "sampling_params.stop[1] must be 1 to 256 bytes" in refused(request(stop=["ok", ""]))
    assert "over the limit of 16" in refused(request(stop=[str(i) for i in range(17)]))
    req = request()
    req.top_logprobs_num = 21
    assert "top_logprobs_num" in refused(req)
    req = request()
    req.disaggregated_params.bootstrap_port = 0
    assert "bootstrap_port" in refused(req)


def test_a_disaggregated_worker_needs_disaggregated_params():
    req = request()
    req.ClearField("disaggregated_params")
    assert "disaggregated_params is not set" in refused(req)
    assert convert(req, disaggregated=False, max_seq_len=2048).room == 0


def test_defaults_seed_and_logprobs():
    req = request(custom_params={"seed": 12345})
    req.sampling_params.ClearField("max_new_tokens")
    req.return_logprob, req.top_logprobs_num = True, 3
    g = convert(req, disaggregated=True, max_seq_len=2048)
    assert g.sampling.seed == 12345 and g.sampling.top_logprobs == 3 and g.return_logprob
    assert g.sampling.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert convert(req, disaggregated=True, max_seq_len=10).sampling.max_new_tokens == 7  # capped by the context


def test_a_request_without_a_seed_gets_one_from_its_id_equal_on_both_legs():
    """smg forwards no seed: each request samples with its own, and its two legs agree."""
    prefill_leg, decode_leg = request(), request()
    seeds = {convert(r, disaggregated=True, max_seq_len=2048).sampling.seed for r in (prefill_leg, decode_leg)}
    assert seeds == {request_seed("r1")}
    other = request()
    other.request_id = "r1-1"  # smg's second choice of n = 2
    assert convert(other, disaggregated=True, max_seq_len=2048).sampling.seed not in seeds
    assert convert(request(custom_params={"seed": 0}), disaggregated=True, max_seq_len=2048).sampling.seed == 0
    nameless = request()
    nameless.request_id = ""
    nameless.disaggregated_params.bootstrap_room = 7
    assert convert(nameless, disaggregated=True, max_seq_len=2048).sampling.seed == request_seed("", 7) != request_seed("", 8)
    nameless.ClearField("disaggregated_params")
    drawn = {convert(nameless, disaggregated=False, max_seq_len=2048).sampling.seed for _ in range(4)}
    assert len(drawn) == 4  # neither id nor room: a random seed each time


def test_the_tokenizer_bundle_is_a_byte_tokenizer():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256 and all(len(s) == 1 for s in symbols)
    files = ByteTokenizer().hf_files()
    data, sha = tokenizer_zip(files)
    assert hashlib.sha256(data).hexdigest() == sha and tokenizer_zip(ByteTokenizer().hf_files()) == (data, sha)  # deterministic
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == sorted(files)
        tok = json.loads(zf.read("tokenizer.json"))
    assert tok["model"]["vocab"] == {s: i for i, s in enumerate(symbols)}
    assert [(t["id"], t["special"]) for t in tok["added_tokens"]] == [(256, True), (257, True)]


def test_stop_token_ids_are_bounded_by_count():
    """The worker holds every stop id for the request's life: a message full of them cost
    it many times the message's size."""
    assert convert(request(stop_token_ids=list(range(1024))), disaggregated=True, max_seq_len=2048).stop_token_ids == frozenset(range(1024))
    message = refused(request(stop_token_ids=list(range(1_000_000))))
    assert message == "sampling_params.stop_token_ids has 1000000 ids, over the limit of 1024"


def test_a_bootstrap_host_longer_than_a_dns_name_is_refused():
    """The decode dials, logs and caches the address it is given: a host is a DNS name or an
    IP literal, at most 253 characters."""
    req = request()
    req.disaggregated_params.bootstrap_host = "h" * 253
    assert convert(req, disaggregated=True, max_seq_len=2048).bootstrap_address == "h" * 253 + ":4000"
    req.disaggregated_params.bootstrap_host = "h" * 1_000_000
    assert refused(req) == "disaggregated_params.bootstrap_host: 1000000 characters, over the limit of 253"


def test_sampling_values_out_of_the_engines_range_name_smgs_field():
    """The engine's ranges, refused at the facade under the name the caller sent."""
    assert refused(request(temperature=-1.0)) == "sampling_params.temperature must be in [0, 100], got -1.0"
    assert refused(request(top_p=2.0)) == "sampling_params.top_p must be in (0, 1], got 2.0"
    assert refused(request(top_p=float("inf"))) == "sampling_params.top_p must be finite, got inf"


@pytest.mark.parametrize("host", ["a b", "prefill/0", "h:4000:x", "::zz", "[::1", "host\n", "ho$t"])
def test_a_bootstrap_host_that_is_no_host_name_or_ip_literal_is_refused(host):
    """No bootstrap answers at such a host: the decode would dial it until its bootstrap
    deadline; refused at once, naming the field."""
    req = request()
    req.disaggregated_params.bootstrap_host = host
    assert refused(req) == f"disaggregated_params.bootstrap_host {host!r} is not a host name or an IP address"


@pytest.mark.parametrize(
    "host, address",
    [("10.0.0.7", "10.0.0.7:4000"), ("prefill-0.pd.svc.cluster.local", "prefill-0.pd.svc.cluster.local:4000"),
     ("my_host", "my_host:4000"), ("::1", "[::1]:4000"), ("[::1]", "[::1]:4000"), ("fe80::1%eth0", "[fe80::1%eth0]:4000")],
)
def test_host_names_and_ip_literals_make_the_bootstrap_address(host, address):
    req = request()
    req.disaggregated_params.bootstrap_host = host
    assert convert(req, disaggregated=True, max_seq_len=2048).bootstrap_address == address
