"""argparse types shared by the servers' flags: a bad value is a CLI error naming the
flag (argparse adds it), never a traceback at start-up."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["port", "positive_seconds", "seconds", "whole_number"]


def whole_number(minimum: int, unit: str = "") -> Callable[[str], int]:
    """The argparse type of an integer flag of at least ``minimum``; ``unit`` (plural,
    e.g. "seconds") names what it counts in the errors."""
    what = f"whole {unit}" if unit else "a whole number"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{' ' + unit if unit else ''}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """The argparse type of a TCP port flag: a whole number in [0, 65535] (0: a free
    one). Outside the range the socket layer would take the value modulo 65536, a port
    the user never asked for."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    """The argparse type of a duration flag: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """The argparse type of a deadline flag: a finite number of seconds > 0 (a deadline
    of 0 fails every call it bounds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value
