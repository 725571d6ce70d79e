"""The real smg in front of pdgrpc serving a checkpoint (``--model DIR``): smg tokenizes
with the checkpoint's own tokenizer, fetched through ``GetTokenizer``.

One cluster, ``smg-1p1d`` over tcp, whose prefill and decode serve the tiny random Llama
checkpoint of ``tests/conftest.py`` (a byte-level BPE ``tokenizer.json`` trained with
``tokenizers``, a ChatML template, EOS ``</s>``), built offline. smg gets the
checkpoint's files and model facts from the workers, encodes text and chat messages with
them, and shows text that equals ``transformers``' greedy generation from the same
directory, decoded with the same tokenizer.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import io
import zipfile
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")
transformers = pytest.importorskip("transformers", reason="the reference implementation (test extra)")

import torch  # noqa: E402
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from pdgrpc.cluster import Cluster, load_topology  # noqa: E402
from pdgrpc.engine.hf.tokenizer import load_tokenizer  # noqa: E402
from pdgrpc.gateway.tokenizer import tokenizer_zip  # noqa: E402
from tests.e2e.harness import wait_nothing_held  # noqa: E402
from tests.gateway import smg_http  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

NEW_TOKENS = 12
PROMPTS = ["The quick brown fox jumps over", "Grüße aus Köln: 東京 🙂"]
CHAT = [{"role": "user", "content": "Prefill computes the prompt"}]


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint) -> Path:
    return Path(hf_checkpoint("llama"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_dir):
    t = load_topology("smg-1p1d")
    topo = dataclasses.replace(t, name="smg-1p1d-hf", engine={**t.engine, "model": str(model_dir)})
    async with Cluster(topo, transport="tcp", start_timeout=180, metrics=True) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def greedy_ids(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    return [int(t) for t in seq[0, len(ids):]]


def shown_text(model_dir: Path, ids: list[int]) -> str:
    """What smg shows for output ``ids``: their bytes (special tokens have none) as UTF-8,
    invalid sequences replaced, an incomplete last character held back (never flushed)."""
    tok = load_tokenizer(model_dir)
    data = b"".join(tok.token_bytes(t) for t in ids)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)


async def call(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def test_smg_gets_the_checkpoints_tokenizer_files_and_model_facts(cluster, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    eos = tok.convert_tokens_to_ids("</s>")
    for name in ("prefill", "decode"):
        s = pb_grpc.SglangSchedulerStub(cluster.channel(name))
        info = await s.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.served_model_name, info.model_type, info.vocab_size) == (model_dir.name, "llama", 384)
        assert list(info.eos_token_ids) == [eos] and info.bos_token_id == tok.bos_token_id
        assert info.max_context_length == cluster.topology.engine["max-seq-len"]
        chunks = [c async for c in s.GetTokenizer(smg_common_pb2.GetTokenizerRequest())]
        data = b"".join(c.data for c in chunks)
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            files = {n: zf.read(n) for n in zf.namelist()}
        assert files == {n: (model_dir / n).read_bytes() for n in
                         ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")}
        assert (data, chunks[-1].sha256) == tokenizer_zip(files)
    status, body = await call(smg_http.get, cluster.openai_base_url.removesuffix("/v1"), "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [model_dir.name]


async def test_completions_and_chat_show_the_text_of_transformers_greedy_generation(cluster, model_dir, hf_model):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    base = cluster.openai_base_url.removesuffix("/v1")
    params = {"model": model_dir.name, "max_tokens": NEW_TOKENS, "temperature": 0}
    texts = []
    for prompt in PROMPTS:  # smg encodes a completion's prompt without special tokens
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        want = greedy_ids(hf_model, ids)
        status, body = await call(smg_http.post, base, "/v1/completions", {**params, "prompt": prompt})
        assert status == 200, body
        assert body["choices"][0]["text"] == shown_text(model_dir, want), (prompt, want)
        texts.append(body["choices"][0]["text"])
        # The same ids through /generate: exactly transformers' tokens.
        gen = {"model": model_dir.name, "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
        status, body = await call(smg_http.post, base, "/generate", gen)
        assert status == 200, body
        assert body[0]["output_ids"] == want
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    want = greedy_ids(hf_model, tok(rendered, add_special_tokens=False)["input_ids"])
    status, events = await call(smg_http.stream, base, "/v1/chat/completions", {**params, "messages": CHAT})
    assert status == 200, events
    assert smg_http.streamed_text(events) == shown_text(model_dir, want), want
    texts.append(smg_http.streamed_text(events))
    assert all(texts), f"an output was empty: the text checks would mean little ({texts})"
    await wait_nothing_held(cluster)
