"""A real checkpoint (``model = "PATH"`` in ``[engine]``) through every serving path.

A tiny random Llama checkpoint (llama3 rope scaling, sharded safetensors, BPE tokenizer),
built offline once per session, served by real processes:

- the colocated server (one process, no transfer);
- ``1p1d`` over tcp;
- prefill dp 2 (TP 1) -> decode TP 2 over rdma (dp, different TP sizes, rdma at once);
- ``tp2`` (prefill TP 2 -> decode TP 2) over tcp.

Greedy outputs equal ``transformers``' ``generate()`` on the same directory, seeded
sampling equals colocated generation with the same engine in this process; a text prompt
and chat messages are tokenized by the router with the checkpoint's tokenizer and chat
template (``chat_template.jinja``, where transformers 5 saves it); a prompt over the
context length is INVALID_ARGUMENT; a request without a seed samples with a fresh one,
which the first message returns and which replays it; afterwards every live gauge
(slots, pages, quarantine, transport rooms) reads 0.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.topology import ProcessSpec
from pdgrpc.cluster.client import generate
from pdgrpc.serving.metadata import metadata_layout
from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.harness import NO_LOCAL_PREFILL, Case, generate_all, reference_outputs_for, skip_unless_transport, wait_nothing_held

transformers = pytest.importorskip("transformers", reason="the reference implementation (test extra)")

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

NEW_TOKENS = 10
LENGTHS = (1, 2, 15, 16, 17, 63, 65, 130, 300, 700)  # pages of 16, prefill chunks of 64


def _topology(name: str, model: str, prefill_args: dict | None = None, other_model: str | None = None):
    t = load_topology(name)
    procs = tuple(
        dataclasses.replace(p, args={**p.args, **prefill_args}) if p.role == "prefill" and prefill_args
        # The decode keeps a prefix cache; every prompt still goes through a prefill.
        else dataclasses.replace(p, args={**p.args, "decode-prefix-cache": True}) if p.role == "decode"
        else dataclasses.replace(p, args={**p.args, **NO_LOCAL_PREFILL}) if p.role == "router"
        else p
        for p in t.processes
    )
    if other_model:  # a decode serving another checkpoint, behind its own router
        procs += (
            ProcessSpec("decode-other", "decode", {"num-slots": 4, "model": other_model}),
            ProcessSpec("router-other", "router", prefill=("prefill",), decode=("decode-other",)),
        )
    return dataclasses.replace(t, name=f"{name}-hf", engine={**t.engine, "model": model}, processes=procs)


CLUSTERS = {
    "colocated": ("colocated", "tcp", None),  # python -m pdgrpc.colocated --model
    "1p1d-tcp": ("1p1d", "tcp", None),
    "dp2-to-tp2-rdma": ("tp1-to-tp2", "rdma", {"dp-size": 2}),
    "tp2-tcp": ("tp2", "tcp", None),
}
_EXPECTED: dict[str, list] = {}


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint, tmp_path_factory):
    """The tiny Llama with its tokenizer saved by transformers 5's ``save_pretrained``: the
    chat template in ``chat_template.jinja``, none in ``tokenizer_config.json``."""
    src = Path(hf_checkpoint("llama"))
    out = tmp_path_factory.mktemp("ckpt-llama-tf5")
    shutil.copytree(src, out, dirs_exist_ok=True)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    assert (out / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    return str(out)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(CLUSTERS))
async def cluster(request, model_dir, hf_checkpoint):
    name, transport, prefill_args = CLUSTERS[request.param]
    skip_unless_transport(transport)
    other = str(hf_checkpoint("llama-tied")) if request.param == "1p1d-tcp" else None
    topology = _topology(name, model_dir, prefill_args, other)
    async with Cluster(topology, transport=transport, start_timeout=180, metrics=True) as c:
        yield c


def _cases(vocab: int) -> list[Case]:
    g = torch.Generator().manual_seed(3)
    greedy = [Case(tuple(torch.randint(0, vocab, (n,), generator=g).tolist()), NEW_TOKENS) for n in LENGTHS]
    sampled = [dataclasses.replace(c, temperature=0.9, seed=100 + i, top_k=20 if i % 2 else 0) for i, c in enumerate(greedy[::3])]
    return greedy + sampled


def _transformers_greedy(model_dir: str, prompts: list[tuple[int, ...]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(seq[0, len(p):].tolist())
    return out


def _expected(cluster: Cluster, model_dir: str, cases: list[Case]) -> tuple[list, list]:
    if not _EXPECTED:
        _EXPECTED["hf"] = _transformers_greedy(model_dir, [c.input_ids for c in cases if c.temperature == 0])
        _EXPECTED["colocated"] = reference_outputs_for(cluster.topology, cases)
    return _EXPECTED["hf"], _EXPECTED["colocated"]


async def test_outputs_equal_transformers_and_colocated_and_everything_is_released(cluster, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cases = _cases(len(tok))
    hf, colocated = _expected(cluster, model_dir, cases)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        got, _ = await generate_all(stub, cases)
        greedy = [g.token_ids for g, c in zip(got, cases) if c.temperature == 0]
        assert [list(t) for t in greedy] == hf
        assert [g.token_ids for g in got] == [e for e, _ in colocated]  # sampled ones too
        assert all(g.text == tok.decode(list(g.token_ids), skip_special_tokens=True) for g in got)

        # Text: tokenized by the router with tokenizer.json (BOS from its post-processor).
        text = "Grüße aus Köln: 東京 🙂"
        done = await generate(stub, prompt=text, max_new_tokens=NEW_TOKENS)
        assert list(done.token_ids) == _transformers_greedy(model_dir, [tuple(tok(text)["input_ids"])])[0]

        # Chat messages: rendered with chat_template.jinja's template, as transformers does.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
        req = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(**m) for m in messages],
            sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS),
        )
        ids = [t for r in [r async for r in stub.Generate(req)] for t in r.token_ids]
        chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == _transformers_greedy(model_dir, [tuple(chat_ids)])[0]

        with pytest.raises(grpc.aio.AioRpcError) as err:  # max-prompt-tokens = 1024 in the [engine] table
            await generate(stub, input_ids=[5] * 1100, max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1100" in err.value.details()
        if "router-other" in cluster.procs:  # another checkpoint's decode refuses, naming the model it serves
            other = generate_pb2_grpc.GenerateServiceStub(cluster.channel("router-other"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(other, input_ids=[5] * 10, max_new_tokens=2)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "compatibility hash mismatch" in err.value.details() and "ckpt-llama-tied" in err.value.details()
    await wait_nothing_held(cluster)


async def test_unseeded_sampling_differs_and_the_returned_seed_replays_it(cluster):
    """A request without a seed gets a fresh one, returned on the first message; sending
    it back replays the output exactly, as does any seed sent (0 included)."""
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        kw = dict(prompt="Once upon a time", max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
        a, b = [await generate(stub, **kw) for _ in range(2)]
        assert a.seed != b.seed and a.token_ids != b.token_ids
        assert (await generate(stub, seed=a.seed, **kw)).token_ids == a.token_ids
        zero = [await generate(stub, seed=0, **kw) for _ in range(2)]
        assert zero[0].seed == zero[1].seed == 0 and zero[0].token_ids == zero[1].token_ids
    await wait_nothing_held(cluster)


async def test_a_chats_next_turn_is_sent_only_what_the_decode_lacks_and_equals_colocated(cluster, model_dir):
    """Turn n+1 repeats turn n's prompt and answer: the decode's prefix cache holds every
    full page of both, the prefill sends the rest, and each answer (greedy and seeded)
    equals colocated generation with the same checkpoint."""
    vocab = len(transformers.AutoTokenizer.from_pretrained(model_dir))
    g = torch.Generator().manual_seed(9)
    prompt = tuple(torch.randint(0, vocab, (40,), generator=g).tolist())
    disaggregated = bool(cluster.topology.by_role("decode"))
    row = metadata_layout().row_bytes
    page_bytes = held = 0
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for turn in range(3):
            case = Case(prompt, NEW_TOKENS, temperature=0.8 * (turn % 2), seed=turn)
            (expected,) = reference_outputs_for(cluster.topology, [case])
            (got,), _ = await generate_all(stub, [case])
            assert (got.token_ids, got.finish_reason) == expected, turn
            pages = -(-len(prompt) // 16)
            if disaggregated:
                page_bytes = page_bytes or (got.bytes_transferred - row) // pages  # turn 0 moves every page
                assert got.bytes_transferred == (pages - held) * page_bytes + row, (turn, held)
            held = (len(prompt) + len(got.token_ids) - 1) // 16
            prompt = prompt + tuple(got.token_ids) + tuple(torch.randint(0, vocab, (20,), generator=g).tolist())
    await wait_nothing_held(cluster)
