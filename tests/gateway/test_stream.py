"""OutputStream: stop token ids, stop strings (held back, trimmed or kept), EOS, length."""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import Any

import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.engine.tokenizer import EOS_ID, ByteTokenizer  # noqa: E402
from pdgrpc.gateway.requests import convert  # noqa: E402
from pdgrpc.gateway import stream as stream_module  # noqa: E402
from pdgrpc.gateway.stream import OutputStream  # noqa: E402


def stream(stop=(), stop_ids=(), no_stop_trim=False, logprobs=False) -> OutputStream:
    req = pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=[256]),
        sampling_params=pb.SamplingParams(top_p=1.0, top_k=-1, max_new_tokens=64, n=1, stop=list(stop), stop_token_ids=list(stop_ids), no_stop_trim=no_stop_trim),
        logprob_start_len=-1, return_logprob=logprobs,
    )
    return OutputStream(convert(req, disaggregated=False, max_seq_len=2048), ByteTokenizer())


def feed(s: OutputStream, data: bytes, last: str = "", per_step: int = 1) -> tuple[list[list[int]], pb.GenerateComplete | None]:
    """Feed ``data`` as byte tokens; the chunks' token ids as sent, and the complete (if any)."""
    chunks, done = [], None
    steps = [list(data[i:i + per_step]) for i in range(0, len(data), per_step)]
    for i, ids in enumerate(steps):
        for m in s.step(ids, [-1.0] * len(ids), [], last if i == len(steps) - 1 else ""):
            assert done is None, "nothing follows complete"
            if m.HasField("complete"):
                done = m.complete
            else:
                chunks.append(list(m.chunk.token_ids))
        if done is not None:
            break
    return chunks, done


def test_a_stop_string_split_over_tokens_is_trimmed_and_named():
    chunks, done = feed(stream(stop=["wor"]), b"hello world")
    assert bytes(t for c in chunks for t in c) == b"hello "
    assert done.matched_stop_str == "wor" and done.finish_reason == "stop"
    assert list(done.output_ids) == list(b"hello ") and done.completion_tokens == 6


def test_no_stop_trim_keeps_the_stop_string():
    chunks, done = feed(stream(stop=["wor"], no_stop_trim=True), b"hello world", per_step=3)
    assert bytes(done.output_ids) == b"hello wor" and done.matched_stop_str == "wor"


def test_a_partial_match_is_held_back_then_released():
    s = stream(stop=["xyz"])
    assert feed(s, b"ax")[0] == [[ord("a")]]  # "x" could start "xyz": held
    chunks, done = feed(s, b"xq")  # "xx": the first x can no longer start it; "xq" neither
    assert bytes(t for c in chunks for t in c) == b"xxq" and done is None
    chunks, done = feed(s, b"xy", last="length")  # the end sends what was held
    assert bytes(t for c in chunks for t in c) == b"xy" and done.finish_reason == "length"
    assert bytes(done.output_ids) == b"axxqxy"


def test_stop_token_ids_and_eos():
    chunks, done = feed(stream(stop_ids=[ord("l")]), b"hello", per_step=5)
    assert chunks == [list(b"hel")] and done.matched_token_id == ord("l") and done.finish_reason == "stop"
    s = stream(logprobs=True)
    msgs = s.step([104, EOS_ID], [-0.5, -0.25], [], "eos")
    assert msgs[-1].complete.matched_token_id == EOS_ID and list(msgs[-1].complete.output_ids) == [104, EOS_ID]
    assert list(msgs[-1].complete.output_logprobs.token_logprobs) == [-0.5, -0.25]


def test_cached_tokens_reach_every_chunk_and_complete() -> None:
    s = stream()
    s.cached_tokens = 48  # what the first decode message said the prefill's cache supplied
    msgs = s.step([65], [-1.0], [], "") + s.step([66], [-1.0], [], "length")
    assert [m.chunk.cached_tokens for m in msgs if m.HasField("chunk")] == [48, 48]
    assert msgs[-1].complete.cached_tokens == 48 and msgs[-1].complete.prompt_tokens == 1


def test_stop_token_id_0_on_the_last_token_is_a_stop_not_the_length() -> None:
    """Token id 0 is a token like any other (a byte tokenizer's NUL, "!" in GPT-2's)."""
    msgs = stream(stop_ids=[0]).step([65, 0], [-1.0, -1.0], [], "length")
    done = msgs[-1].complete
    assert done.finish_reason == "stop" and done.WhichOneof("matched_stop") == "matched_token_id" and done.matched_token_id == 0


def lines_run(s: OutputStream, data: bytes) -> int:
    """How many lines of the stream's module run while ``data`` is fed as byte tokens: its
    work, counted (a count, unlike a time, is the same on every machine)."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == stream_module.__file__ else None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        chunks, done = feed(s, data)
    finally:
        sys.settrace(before)
    assert done is None and bytes(t for c in chunks for t in c) == data[:-1]  # nothing matched; the last byte could start one
    return count


def test_the_work_per_token_does_not_grow_with_the_stop_strings_length() -> None:
    """Stop strings are checked on the worker's event loop, between every other request's
    tokens: 16 stop strings of 255 bytes cost each token what 16 of 3 bytes cost."""
    short = [f"a{chr(0x62 + i)}" + "z" for i in range(16)]
    long = [("ab" * 128)[:254] + chr(0x63 + i) for i in range(16)]
    assert lines_run(stream(stop=long), b"a" * 200) <= 2 * lines_run(stream(stop=short), b"a" * 200)


def test_each_token_is_sent_once_it_can_no_longer_begin_a_stop_string() -> None:
    """Random stop strings and outputs over a small alphabet (so that partial matches
    overlap), against the definition: after each token the client has every output byte
    but the longest tail that begins a stop string; the first stop string to end ends it."""
    rng = random.Random(5)
    for _ in range(300):
        stops = sorted({"".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))})
        data = "".join(rng.choice("ab") for _ in range(rng.randint(1, 30))).encode()
        s, sent = stream(stop=stops), b""
        for i in range(len(data)):
            out = data[: i + 1]
            msgs = s.step([out[-1]], [-1.0], [], "")
            sent += bytes(t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids)
            ended = [x.encode() for x in stops if out.endswith(x.encode())]
            if ended:
                first = max(ended, key=len)  # of those ending here, the one starting first
                assert msgs[-1].complete.matched_stop_str == first.decode() and sent == out[: len(out) - len(first)], (stops, data)
                break
            held = max((n for n in range(1, len(out) + 1) for x in stops if x.encode().startswith(out[-n:])), default=0)
            assert sent == out[: len(out) - held], (stops, data, i)
