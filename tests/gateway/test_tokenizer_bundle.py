"""What smg gets about the served model, without a socket: the ``GetTokenizer`` bundle
(files, zip, sha256, errors naming the file), ``GetModelInfo`` from the engine's tokenizer
(a checkpoint's several EOS ids included), and EOS / stop strings over a checkpoint's
multi-byte tokens."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")
pytest.importorskip("tokenizers", reason="a checkpoint's tokenizer needs the tokenizers package (hf extra)")

from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.engine.hf.build import CHATML, train_tokenizer  # noqa: E402
from pdgrpc.engine.hf.tokenizer import load_tokenizer  # noqa: E402
from pdgrpc.engine.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer  # noqa: E402
from pdgrpc.engine.tokenizer_files import TokenizerFilesError, read_tokenizer_files  # noqa: E402
from pdgrpc.serving.kv_events import KvEventFeed  # noqa: E402
from pdgrpc.gateway.requests import convert  # noqa: E402
from pdgrpc.gateway.servicer import PrefillLeg, WorkerInfo, model_info  # noqa: E402
from pdgrpc.gateway.stream import OutputStream  # noqa: E402
from pdgrpc.gateway.tokenizer import tokenizer_zip  # noqa: E402

VOCAB = 320


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """The config and tokenizer files of a Qwen2-style checkpoint (no weights: the
    tokenizer needs none), with two EOS ids in generation_config.json."""
    ids = train_tokenizer(tmp_path, VOCAB, bos=False)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "eos_token_id": ids["<|im_end|>"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["</s>"]]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    (tmp_path / "tool_use.jinja").write_text("{{ messages }}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # not a tokenizer file
    return tmp_path


def worker(tokenizer) -> WorkerInfo:
    return WorkerInfo(
        mode="prefill", served_model_name="m", transport="tcp", max_seq_len=2048, max_prompt_tokens=1024,
        max_running_requests=8, bootstrap_port=1, tokenizer=tokenizer,
    )


def test_a_checkpoints_bundle_is_its_tokenizer_files_zipped_with_their_sha256(checkpoint):
    files = load_tokenizer(checkpoint).hf_files()
    assert sorted(files) == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tool_use.jinja"]
    assert all(files[n] == (checkpoint / n).read_bytes() for n in files)
    data, sha = tokenizer_zip(files)
    assert sha == hashlib.sha256(data).hexdigest() and tokenizer_zip(dict(reversed(files.items()))) == (data, sha)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert {n: zf.read(n) for n in zf.namelist()} == files


def test_files_that_cannot_be_served_are_errors_naming_them(checkpoint):
    with pytest.raises(TokenizerFilesError, match="tokenizer.json: [0-9]+ bytes, over the limit of 5000 bytes"):
        read_tokenizer_files(checkpoint, max_file_bytes=5000)
    with pytest.raises(TokenizerFilesError, match="over smg's limit of 100"):
        tokenizer_zip(read_tokenizer_files(checkpoint), max_bytes=100)
    tok = load_tokenizer(checkpoint)
    (checkpoint / "tokenizer.json").unlink()  # gone after start-up
    with pytest.raises(TokenizerFilesError, match=f"{checkpoint / 'tokenizer.json'}: file not found"):
        tok.hf_files()


class Aborted(Exception):
    pass


class Context:
    """The part of grpc's ServicerContext a handler that aborts uses."""

    code: grpc.StatusCode | None = None
    details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


async def test_get_tokenizer_streams_the_bundle_or_says_which_file_is_missing(checkpoint):
    tok = load_tokenizer(checkpoint)
    leg = PrefillLeg(None, lambda: worker(tok), active=lambda: 0, healthy=lambda: True, kv_events=KvEventFeed())
    chunks = [c async for c in leg.GetTokenizer(smg_common_pb2.GetTokenizerRequest(), Context())]
    assert (b"".join(c.data for c in chunks), chunks[-1].sha256) == tokenizer_zip(tok.hf_files())
    assert all(not c.sha256 for c in chunks[:-1])
    (checkpoint / "tokenizer.json").unlink()
    # The bundle is built once per worker: the one served keeps serving what was loaded.
    again = [c async for c in leg.GetTokenizer(smg_common_pb2.GetTokenizerRequest(), Context())]
    assert b"".join(c.data for c in again) == b"".join(c.data for c in chunks)
    fresh = PrefillLeg(None, lambda: worker(tok), active=lambda: 0, healthy=lambda: True, kv_events=KvEventFeed())
    ctx = Context()
    with pytest.raises(Aborted):
        [c async for c in fresh.GetTokenizer(smg_common_pb2.GetTokenizerRequest(), ctx)]
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer.json: file not found" in ctx.details


def test_model_info_reports_the_served_tokenizer(checkpoint):
    tok = load_tokenizer(checkpoint)
    info = model_info(worker(tok))
    ends = sorted(tok.eos_token_ids)
    assert len(ends) == 2 and list(info.eos_token_ids) == ends
    assert (info.vocab_size, info.model_type, info.max_context_length, info.max_req_input_len) == (VOCAB, "qwen2", 2048, 1024)
    assert info.bos_token_id == 0  # no BOS: left unset (proto3's 0), as SGLang reports a config without one
    info = model_info(worker(ByteTokenizer()))
    assert (list(info.eos_token_ids), info.bos_token_id, info.vocab_size, info.model_type) == ([EOS_ID], BOS_ID, VOCAB_SIZE, "pdgrpc-reference")


def stream(tok, stop=(), no_stop_trim=False) -> OutputStream:
    req = pb.GenerateRequest(
        request_id="r", tokenized=pb.TokenizedInput(input_ids=[5]),
        sampling_params=pb.SamplingParams(top_p=1.0, top_k=-1, max_new_tokens=64, n=1, stop=list(stop), no_stop_trim=no_stop_trim),
        logprob_start_len=-1,
    )
    return OutputStream(convert(req, disaggregated=False, max_seq_len=2048), tok)


def run(s: OutputStream, ids: list[int], last: str = "") -> tuple[list[int], pb.GenerateComplete | None]:
    sent, done = [], None
    for i, t in enumerate(ids):
        for m in s.step([t], [0.0], [], last if i == len(ids) - 1 else ""):
            if m.HasField("complete"):
                done = m.complete
            else:
                sent += m.chunk.token_ids
        if done is not None:
            break
    return sent, done


def test_the_sampled_eos_id_and_stop_strings_inside_multibyte_tokens(checkpoint):
    tok = load_tokenizer(checkpoint)
    for eos in sorted(tok.eos_token_ids):  # whichever EOS id the engine stopped on
        ids = tok.encode("fox", add_bos=False) + [eos]
        sent, done = run(stream(tok), ids, last="eos")
        assert done is not None and done.matched_token_id == eos and sent == ids
    ids = tok.encode("The quick brown fox", add_bos=False)
    assert len(ids) < len("The quick brown fox")  # merged tokens of several bytes
    assert b"".join(tok.token_bytes(t) for t in ids) == b"The quick brown fox"
    assert tok.token_bytes(sorted(tok.eos_token_ids)[0]) == b""
    # "k br" begins inside a token ("ck") and ends inside another ("bro"): the request
    # stops there; the tokens that hold it are left out, or kept with no_stop_trim.
    def nbytes(n: int) -> int:
        return sum(len(tok.token_bytes(t)) for t in ids[:n])

    at = b"The quick brown fox".find(b"k br")
    start = next(i for i in range(len(ids)) if nbytes(i + 1) > at)  # the token "k br" begins in
    cut = next(i for i in range(len(ids)) if nbytes(i + 1) >= at + 4)  # the token it ends in
    assert nbytes(start) < at < nbytes(start + 1) and nbytes(cut) < at + 4 < nbytes(cut + 1)  # inside both
    sent, done = run(stream(tok, stop=["k br"]), ids)
    assert done is not None and done.matched_stop_str == "k br" and sent == ids[:start]
    sent, done = run(stream(tok, stop=["k br"], no_stop_trim=True), ids)
    assert done is not None and sent == ids[: cut + 1]
