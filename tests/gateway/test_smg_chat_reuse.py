"""A chat through the real smg (pdgrpc[gateway]) over /v1/chat/completions: each turn
repeats the conversation so far, and the decode, which keeps what it received and what it
generated (``--decode-prefix-cache``), is sent only what it lacks.

Per turn the decode's ``pdgrpc_transfer_bytes_total`` grows by less than the whole prompt's
KV (from turn 2 on), its ``pdgrpc_decode_reused_tokens_total`` by at least the last turn's
full prompt pages, and the text equals colocated generation of the prompt smg rendered
(the byte tokenizer's chat template: ``role: content`` lines, then ``assistant: ``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
import pytest_asyncio

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from pdgrpc.cluster import Cluster, load_topology  # noqa: E402
from pdgrpc.cluster.reference import reference_engine  # noqa: E402
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME  # noqa: E402
from pdgrpc.serving.metadata import metadata_layout  # noqa: E402
from tests.e2e.harness import Case, Counters, reference_outputs, skip_unless_transport, wait_nothing_held  # noqa: E402
from tests.gateway import smg_http  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
PAGE = 16  # smg-1p1d's page size
MESSAGES = ["Tell me about KV caches.", "And why move them between servers?", "What does a delta transfer send?", "Thanks!"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    skip_unless_transport("tcp")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    topology = load_topology("smg-1p1d")
    procs = tuple(dataclasses.replace(p, args={**p.args, "decode-prefix-cache": True}) if p.role == "decode" else p for p in topology.processes)
    topology = dataclasses.replace(topology, processes=procs)
    async with Cluster(topology, transport="tcp", start_timeout=180, metrics=True, extra_env=env) as c:
        yield c


def rendered(messages: list[dict[str, str]]) -> tuple[int, ...]:
    """The prompt smg renders and tokenizes (the template's bytes; smg adds no BOS)."""
    return tuple("".join(f"{m['role']}: {m['content']}\n" for m in messages).encode() + b"assistant: ")


async def test_a_4_turn_chat_moves_less_than_its_history_and_equals_colocated(cluster):
    bufs = reference_engine(cluster.topology).kv_buffers()
    page_bytes = sum(t[0].numel() * t.element_size() for t in (*bufs.k, *bufs.v))
    row_bytes = metadata_layout().row_bytes
    base = cluster.openai_base_url.removesuffix("/v1")
    chat: list[dict[str, str]] = []
    last_prompt: tuple[int, ...] = ()
    for turn, message in enumerate(MESSAGES, 1):
        chat.append({"role": "user", "content": message})
        prompt = rendered(chat)
        before = await Counters.read(cluster)
        body = {"model": DEFAULT_SERVED_MODEL_NAME, "messages": chat, "max_tokens": 24, "temperature": 0}
        status, reply = await asyncio.to_thread(smg_http.post, base, "/v1/chat/completions", body)
        assert status == 200, reply
        await wait_nothing_held(cluster)
        after = await Counters.read(cluster)
        moved = after.delta(before, "pdgrpc_transfer_bytes_total", "decode")
        reused = after.delta(before, "pdgrpc_decode_reused_tokens_total", "decode")
        assert reply["usage"]["prompt_tokens"] == len(prompt), turn
        full = -(-len(prompt) // PAGE) * page_bytes + row_bytes
        if turn == 1:
            assert moved == full and reused == 0
        else:  # the decode held at least the last turn's full prompt pages
            assert reused >= len(last_prompt) // PAGE * PAGE, turn
            assert moved == full - reused // PAGE * page_bytes < full, turn
        (ids, _), = reference_outputs(cluster.topology.name, [Case(prompt, 24)])
        answer = reply["choices"][0]["message"]["content"]
        assert answer == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace"), turn
        chat.append({"role": "assistant", "content": answer})
        last_prompt = prompt
