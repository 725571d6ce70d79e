"""When a compute posts a chunk to its driver (one rule for the thread, the process and the
TP leader): only when pages worth a write completed, on the last chunk, or on a failure;
the compute time of the chunks kept back travels with the next post."""

from __future__ import annotations

import pytest

from pdgrpc.errors import ConfigError
from pdgrpc.state.chunk_posting import ChunkPosting


def posts(rule: ChunkPosting, chunk: int) -> list[tuple[int, float]]:
    out = []
    for end in range(chunk, rule.num_tokens + chunk, chunk):
        end = min(end, rule.num_tokens)
        secs = rule.computed(end, 1.0)
        if secs is not None:
            out.append((end, secs))
    return out


@pytest.mark.parametrize(
    ("min_pages", "expected"),
    [
        (0, [(8, 1.0), (16, 1.0), (24, 1.0), (30, 1.0)]),  # every chunk
        (2, [(8, 1.0), (16, 1.0), (24, 1.0), (30, 1.0)]),  # each chunk completes 2 pages of 4 tokens
        (4, [(16, 2.0), (30, 2.0)]),
        (100, [(30, 4.0)]),  # written at the end anyway: posted once, with all the compute time
    ],
)
def test_chunks_are_posted_when_their_pages_are_worth_a_write(min_pages: int, expected: list[tuple[int, float]]) -> None:
    assert posts(ChunkPosting(30, 4, min_pages), 8) == expected


def test_a_failure_is_posted_with_the_time_kept_back() -> None:
    rule = ChunkPosting(30, 4, 100)
    assert rule.computed(8, 1.0) is None and rule.computed(16, 1.5) is None
    assert rule.failed() == 2.5 and rule.unposted_s == 0.0


def test_bad_rule_names_its_fields() -> None:
    with pytest.raises(ConfigError, match="min_pages"):
        ChunkPosting(30, 4, -1)
