"""Shared test configuration."""

from __future__ import annotations

import os
import signal

# Keep UCX on loopback-friendly transports and quiet in tests; real hosts override this.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
# Tests spawn servers (fork + exec) from a process that uses gRPC; with gRPC's fork
# handlers on, a forked child can abort before exec (see pdgrpc/serving/launch.py).
# Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# A suite started in the background (``pytest &``) has SIGINT ignored, and the servers it
# starts would inherit that: Ctrl-C tests then test the shell, not the server. Children
# start with SIGINT as under a terminal; a test that wants it ignored says so.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---- tiny random Hugging Face checkpoints (built once per session, offline) --------------

import pytest  # noqa: E402

# Llama 3.1-style rope scaling; original context 256 so that the scaling bends frequencies
# inside the prompt lengths the tests use.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
HF_ARCHS = {
    # name -> build_checkpoint keyword arguments
    "llama": dict(arch="llama", rope_scaling=LLAMA3_ROPE, max_shard_size="100KB"),  # sharded, with an index
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "qwen3": dict(arch="qwen3"),
}


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(name)`` -> directory of the tiny random checkpoint ``name`` (see
    HF_ARCHS), built with transformers on first use and shared by the whole session."""
    pytest.importorskip("transformers", reason="the hf tests build checkpoints with transformers (the test extra)")
    from pdgrpc.engine.hf.build import build_checkpoint

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = build_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"), **HF_ARCHS[name])
        return built[name]

    return get


# ---- a real etcd (the Debian package etcd-server) on 127.0.0.1 ---------------------------

@pytest.fixture(scope="session")
def etcd():
    """One plain etcd for the session's discovery tests (each test uses its own cluster name)."""
    from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, EtcdProcess, find_etcd

    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {ETCD_PACKAGE_HINT}")
    with EtcdProcess.start_on("127.0.0.1") as e:
        yield e


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory):
    """An etcd that speaks TLS only and takes only clients with a certificate of its CA;
    yields (etcd, the CA, a client's CertFiles)."""
    from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, EtcdProcess, EtcdTls, find_etcd
    from pdgrpc.rpc.certs import issue, make_ca
    from pdgrpc.rpc.roles import CLIENT, DECODE

    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {ETCD_PACKAGE_HINT}")
    d = tmp_path_factory.mktemp("etcd-tls")
    ca = make_ca(d)
    server = issue(ca, d, "etcd", role=CLIENT)
    client = issue(ca, d, "decode", role=DECODE)
    with EtcdProcess.start_on("127.0.0.1", tls=EtcdTls(ca.cert, server.cert, server.key)) as e:
        yield e, ca.cert, client
