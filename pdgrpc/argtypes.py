"""argparse types shared by the servers' flags, and checks of the flags a type cannot
take: a bad value is a CLI error naming the flag (argparse adds it), never a traceback
at start-up."""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["check_address", "check_rank", "duration", "milliseconds", "port", "positive_seconds", "rank_count", "seconds", "whole_number"]


def check_address(addr: str, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``addr`` is the ``HOST:PORT`` of a peer to
    call: a host and a port in [1, 65535] (0 picks a free port only for a listener); an
    IPv6 host in brackets, since a bare one reads as HOST:PORT at its last colon ("::1"
    as port 1 of "::"). A check rather than an argparse type: argparse passes a flag's
    string default (a "" that means none) through its type too."""
    host, sep, number = addr.rpartition(":")
    if not sep or not host or not number.isdigit() or not 0 < int(number) < 65536:
        raise ValueError(f"{flag}: {addr!r} is not HOST:PORT")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{flag}: {addr!r} is not HOST:PORT (an IPv6 host goes in brackets: [::1]:PORT)")


def check_rank(rank: int, size: int, name: str, size_name: str, first: int = 0) -> None:
    """Raise ValueError unless ``rank`` is in ``[first, size)``, a place in a group of
    ``size`` ranks; ``name`` and ``size_name`` (flags or fields) name the two in the
    message. A check rather than an argparse type: the bound is another flag's value."""
    if not first <= rank < size:
        raise ValueError(f"{name} must be in [{first}, {size_name}={size}), got {rank}")


def whole_number(minimum: int, unit: str = "", *, maximum: int | None = None) -> Callable[[str], int]:
    """The argparse type of an integer flag of at least ``minimum`` (and at most
    ``maximum``: a protobuf field's width); ``unit`` (plural, e.g. "seconds") names what it
    counts in the errors."""
    what = f"whole {unit}" if unit else "a whole number"
    units = f" {unit}" if unit else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{units}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}{units}, got {value}")
        return value

    return parse


# The argparse type of a group size (--dp-size, --tp-size): one rank or more, with one
# message wherever a role takes one.
rank_count = whole_number(1, "ranks")


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


def duration(unit: str = "seconds", positive: bool = False) -> Callable[[str], float]:
    """The argparse type of a duration flag: a finite number of ``unit`` >= 0, or > 0 with
    ``positive`` (a deadline of 0 fails every call it bounds)."""
    bound = ">" if positive else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit}, got {text!r}") from None
        if not (0 < value if positive else 0 <= value) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit} {bound} 0, got {text}")
        return value

    return parse


seconds = duration()
positive_seconds = duration(positive=True)
milliseconds = duration("milliseconds")
