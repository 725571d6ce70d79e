"""A GGUF file (``model = "FILE.gguf"`` in ``[engine]``) served 1p1d over tcp (a GGUF
engine's KV pages are plain float32 pages: test_hf moves a checkpoint engine's over rdma).

A tiny quantized Llama GGUF written with the ``gguf`` package's writer, served by real
processes (prefill, decode, router): greedy outputs of token prompts, a text prompt
tokenized by the router and chat messages rendered with the file's chat template all
equal ``transformers``' GGUF loader token for token; afterwards nothing is held.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import pytest_asyncio
import torch

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.harness import Case, generate_all, skip_unless_transport, wait_nothing_held

pytest.importorskip("gguf", reason="GGUF support needs the gguf package (pdgrpc[gguf])")
transformers = pytest.importorskip("transformers", reason="the reference implementation (test extra)")

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

NEW_TOKENS = 8
LENGTHS = (1, 16, 17, 130)  # pages of 16, prefill chunks of 64


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from pdgrpc.engine.hf.build import build_gguf

    return build_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama-Q8_0.gguf", "llama", "Q8_0")


@pytest.fixture(scope="module")
def reference(gguf_file):
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    model.eval()

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        return seq[0, len(ids):].tolist()

    return tok, greedy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(gguf_file):
    skip_unless_transport("tcp")
    t = load_topology("1p1d")
    topology = dataclasses.replace(t, name="1p1d-gguf", engine={**t.engine, "model": str(gguf_file)})
    async with Cluster(topology, transport="tcp", start_timeout=180) as c:
        yield c


async def test_gguf_1p1d_equals_transformers_gguf_loader(cluster, reference):
    tok, greedy = reference
    g = torch.Generator().manual_seed(5)
    cases = [Case(tuple(torch.randint(0, len(tok) - 1, (n,), generator=g).tolist()), NEW_TOKENS) for n in LENGTHS]
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        got, _ = await generate_all(stub, cases)
        assert [list(r.token_ids) for r in got] == [greedy(list(c.input_ids)) for c in cases]

        text = "Prefill computes the prompt; decode generates."
        done = await generate(stub, prompt=text, max_new_tokens=NEW_TOKENS)
        assert list(done.token_ids) == greedy(tok(text)["input_ids"])

        messages = [{"role": "user", "content": "Say hi."}]
        req = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(**m) for m in messages],
            sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS),
        )
        ids = [t for r in [r async for r in stub.Generate(req)] for t in r.token_ids]
        chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == greedy(list(chat_ids))
    await wait_nothing_held(cluster)
