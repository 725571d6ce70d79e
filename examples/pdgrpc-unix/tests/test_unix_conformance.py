"""What a plugin author writes to prove a backend: one subclass of the shipped suite."""

from pdgrpc.transport.testing import TransportConformance


class TestUnixConformance(TransportConformance):
    backend = "unix"  # the entry-point name from pyproject.toml
