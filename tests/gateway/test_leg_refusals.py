"""The prefill and decode legs refuse a prompt of ids outside the served vocabulary under
smg's field name, ``tokenized.input_ids``, before the inner call sees it (the inner
handlers name their own ``input_ids``, and the prefill's message leads with pdgrpc's
room, which smg never sent)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.engine.tokenizer import VOCAB_SIZE, ByteTokenizer  # noqa: E402
from pdgrpc.gateway.servicer import DecodeLeg, PrefillLeg, WorkerInfo  # noqa: E402
from tests.servicer_context import Context, Refused  # noqa: E402


class Inner:
    """The prefill's and the decode's handlers, noting each call they get."""

    def __init__(self) -> None:
        self.scheduler = self
        self.calls = 0

    async def Prefill(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls += 1
        raise AssertionError("the prefill leg called the prefill")

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.calls += 1
        raise AssertionError("the decode leg called the decode")
        yield


def worker(mode: str) -> WorkerInfo:
    return WorkerInfo(mode=mode, served_model_name="m", transport="tcp", max_seq_len=64, max_prompt_tokens=32,
                      max_running_requests=4, bootstrap_port=0, tokenizer=ByteTokenizer())


@pytest.mark.parametrize("mode", ["prefill", "decode"])
async def test_ids_outside_the_vocabulary_are_refused_naming_smgs_field(mode: str) -> None:
    inner = Inner()
    info = worker(mode)
    leg: Any = (
        PrefillLeg(inner, lambda: info, active=lambda: 0, healthy=lambda: True, kv_events=None) if mode == "prefill"
        else DecodeLeg(inner, lambda: info, active=lambda: 0, healthy=lambda: True)
    )
    req = pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=[104, VOCAB_SIZE + 42]), logprob_start_len=-1,
        sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=4, n=1),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=4000, bootstrap_room=3),
    )
    with pytest.raises(Refused) as info_:
        async for _ in leg.Generate(req, Context("smg")):
            pass
    assert info_.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info_.value.message == f"tokenized.input_ids[1] = {VOCAB_SIZE + 42} is not a token id in [0, {VOCAB_SIZE})"
    assert inner.calls == 0
    assert not (await leg.Abort(pb.AbortRequest(request_id="r"), Context("smg"))).success  # nothing left running
