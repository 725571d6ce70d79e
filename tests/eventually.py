"""``eventually``: wait, polling, until a condition holds; fail naming what never did.

For state a test cannot await directly (a process's log line, a metric, a server's
counters). Every wait is bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

__all__ = ["eventually", "eventually_async"]

T = TypeVar("T")


def _failure(predicate: object, timeout: float, what: str | Callable[[], str]) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"not within {timeout} s: {text or getattr(predicate, '__name__', repr(predicate))}")


def eventually(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str | Callable[[], str] = "") -> T:
    """Call ``predicate`` until it returns something truthy, and return that; after
    ``timeout`` seconds raise AssertionError naming ``what`` (a text, or a function that
    describes what is still wrong; default: the predicate's name)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(predicate, timeout, what)
        time.sleep(interval)


async def eventually_async(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.02, what: str | Callable[[], str] = ""
) -> T:
    """:func:`eventually` on the running loop: ``predicate`` may be sync or async, and the
    loop runs between tries."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _failure(predicate, timeout, what)
        await asyncio.sleep(interval)
