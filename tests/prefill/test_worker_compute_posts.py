"""What the prefill worker's compute thread tells its driver, without processes or sockets.

Every chunk posted to the loop wakes it, and the loop's Python then competes with the
compute for the GIL. So a chunk is posted only when the loop can write something (the
pages completed since the last post reach ``min_write_bytes``), on the last chunk, and
on a failure; the compute time of the chunks in between travels with the next post.
"""

from __future__ import annotations

import asyncio

import pytest

from pdgrpc.engine.base import PrefillRequest, SamplingParams
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.prefill.compute_thread import ThreadCompute
from pdgrpc.prefill.worker import PrefillWorker, WorkerConfig
from pdgrpc.transport import registry
from tests.prefill.harness import CONFIG, prompt

CHUNK = 8  # tokens; CONFIG's pages hold 4, so every chunk completes 2 pages
N = 60  # 7 full chunks and a last one of 4 tokens (15 pages)


async def _posts(min_write_pages: float, fail_at: int | None = None) -> list[tuple[int, bool, float, BaseException | None]]:
    engine = ReferenceEngine(CONFIG)
    kv = engine.kv_buffers()
    page_bytes = sum(t[0].numel() * t.element_size() for t in (*kv.k, *kv.v))  # one page, every layer
    worker = PrefillWorker(
        engine, registry.create("fake"), WorkerConfig(chunk_size=CHUNK, min_write_bytes=int(min_write_pages * page_bytes))
    )
    compute = worker.compute
    assert isinstance(compute, ThreadCompute)
    if fail_at is not None:
        real = compute.compute_chunk

        def failing(room: int, req: PrefillRequest, start: int, end: int):  # type: ignore[no-untyped-def]
            if start == fail_at:
                raise RuntimeError("engine blew up")
            return real(room, req, start, end)

        compute.compute_chunk = failing  # type: ignore[method-assign]
    pages = engine.alloc_pages(engine.pages_needed(N))
    assert pages is not None
    job = compute.begin(9, PrefillRequest(tuple(prompt(N, 1)), tuple(pages), SamplingParams()))
    posts = []
    while True:
        post = await asyncio.wait_for(job.posts.get(), 30)
        end, token, secs, err = post.end, post.token, post.seconds, post.error
        assert post.ready.done()  # a CPU engine's pages are written when the chunk returns
        posts.append((end, token is not None, secs, err))
        if err is not None or end == N:
            break
    await asyncio.wait_for(compute.finish(9, job), 30)  # the thread is done with the pages
    await compute.close()
    return posts


async def test_a_prompt_whose_kv_is_written_at_the_end_is_posted_once() -> None:
    posts = await _posts(min_write_pages=1000)
    assert [(end, has_token) for end, has_token, _, _ in posts] == [(N, True)]
    assert posts[0][2] > 0 and posts[0][3] is None  # the compute time of all eight chunks


@pytest.mark.parametrize(("min_write_pages", "ends"), [
    (0, list(range(CHUNK, N, CHUNK)) + [N]),  # every chunk: writes overlap the next chunk
    (2, list(range(CHUNK, N, CHUNK)) + [N]),  # one chunk's pages are worth a write
    (4, [16, 32, 48, N]),  # every second chunk
    (3.5, [16, 32, 48, N]),  # rounded up to whole pages
    (10, [40, N]),
])
async def test_chunks_are_posted_when_their_pages_are_worth_a_write(min_write_pages: float, ends: list[int]) -> None:
    posts = await _posts(min_write_pages)
    assert [end for end, _, _, _ in posts] == ends
    assert [has_token for _, has_token, _, _ in posts] == [False] * (len(ends) - 1) + [True]
    assert all(secs > 0 and err is None for _, _, secs, err in posts)


async def test_a_failing_chunk_is_posted_at_once_even_when_nothing_would_be_written() -> None:
    posts = await _posts(min_write_pages=1000, fail_at=24)
    assert len(posts) == 1
    end, has_token, secs, err = posts[0]
    assert end == 32 and not has_token and isinstance(err, RuntimeError) and "blew up" in str(err)
    assert secs > 0  # the chunks computed before it
