"""Secrets kept in files: the smg room key and the bearer token.

An smg request's room secret is keyed by the cluster's smg room key, so the request id,
which smg and the servers log, no longer gives it; the launcher makes the key for a
topology with smg and gives the same file to its prefill and decode servers. A secret
file others can read is refused, naming its flag.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.topology import load_topology
from pdgrpc.errors import ConfigError
from pdgrpc.gateway import add_gateway_arguments, room_key
from pdgrpc.gateway.requests import room_secret
from pdgrpc.rpc.certs import write_token
from pdgrpc.rpc.security import Security
from pdgrpc.serving.room_proof import abort_message, abort_proof, verify

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gateway_arguments(p, rooms=True)
    return p.parse_args(list(argv))


def test_a_request_id_alone_no_longer_proves_an_smg_room(tmp_path: Path) -> None:
    key = room_key(_args("--smg-room-key-file", str(write_token(tmp_path / "key"))))
    rid, room = "cmpl-0123456789abcdef01234567-0190a1b2c3d4", (1 << 62) + 12345
    secret = room_secret(rid, key)
    # What a reader of the logs computes from the request id: it proves nothing now.
    guessed = hashlib.sha256(b"pdgrpc.v1 smg room secret\0" + rid.encode()).digest()
    assert guessed == room_secret(rid)  # the keyless derivation, still what an unkeyed cluster uses
    assert not verify(secret, abort_message(room), abort_proof(guessed, room))
    assert verify(secret, abort_message(room), abort_proof(room_secret(rid, key), room))  # both legs agree
    other = room_key(_args("--smg-room-key-file", str(write_token(tmp_path / "other"))))
    assert room_secret(rid, other) != secret  # another cluster's key gives another secret


def test_a_room_key_file_others_can_read_or_too_short_is_refused_naming_the_flag(tmp_path: Path) -> None:
    loose = write_token(tmp_path / "loose")
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match=r"--smg-room-key-file .* \(mode 644\): chmod 600"):
        room_key(_args("--smg-room-key-file", str(loose)))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 16)
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match=r"--smg-room-key-file .* 16 bytes; a key needs at least 32"):
        room_key(_args("--smg-room-key-file", str(short)))
    with pytest.raises(ConfigError, match="--smg-room-key-file: cannot read"):
        room_key(_args("--smg-room-key-file", str(tmp_path / "missing")))


def test_a_token_file_others_can_read_is_refused_naming_the_flag(tmp_path: Path) -> None:
    token = write_token(tmp_path / "token")
    assert Security(token_file=token).token
    os.chmod(token, 0o640)
    with pytest.raises(ConfigError, match=r"--auth-token-file .* \(mode 640\): chmod 600"):
        Security(token_file=token)


def test_the_launcher_gives_smgs_prefill_and_decode_one_private_room_key(tmp_path: Path) -> None:
    cluster = Cluster(load_topology(REPO / "servers" / "smg-1p1d.toml"), transport="fake", log_dir=tmp_path / "run")
    keys = {}
    for name, proc in cluster.procs.items():
        argv = list(proc.argv)
        if "--smg-room-key-file" in argv:
            keys[proc.spec.role] = Path(argv[argv.index("--smg-room-key-file") + 1])
    assert set(keys) == {"prefill", "decode"} and len(set(keys.values())) == 1
    key = keys["decode"]
    assert key.stat().st_mode & 0o077 == 0 and len(room_key(_args("--smg-room-key-file", str(key)))) >= 32
    plain = Cluster(load_topology(REPO / "servers" / "1p1d.toml"), transport="fake", log_dir=tmp_path / "plain")
    assert not any("--smg-room-key-file" in p.argv for p in plain.procs.values())


def test_the_launcher_gives_a_colocated_server_only_flags_it_takes(tmp_path: Path) -> None:
    # No room key among them: a colocated server has no rooms, and refuses the flag.
    from pdgrpc.colocated.server import build_parser

    cluster = Cluster(load_topology(REPO / "servers" / "colocated.toml"), transport="fake", log_dir=tmp_path / "run")
    (proc,) = cluster.procs.values()
    argv = list(proc.argv)
    assert argv[1:3] == ["-m", "pdgrpc.colocated"]
    build_parser().parse_args(argv[3:])
    assert "--smg-room-key-file" not in argv
