"""A topology the launcher cannot use is one line naming the file or the field, exit 2,
before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdgrpc.cluster.__main__ import main


@pytest.mark.parametrize("what", ["a directory", "not UTF-8"])
def test_a_topology_that_is_no_text_file_is_refused(what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if what == "a directory":
        topology = tmp_path / "servers"
        topology.mkdir()
    else:
        topology = tmp_path / "1p1d.toml"
        topology.write_bytes(b"\xff\xfe description = 1\n")
    assert main([str(topology)]) == 2
    out = capsys.readouterr()
    assert f"error: topology {str(topology)!r}: cannot read {topology}: " in out.err
    assert "Traceback" not in out.err and "starting" not in out.out


def test_a_duplicate_process_name_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = tmp_path / "twice.toml"
    topology.write_text(
        '[[process]]\nname = "prefill"\nrole = "prefill"\n\n'
        '[[process]]\nname = "prefill"\nrole = "decode"\n\n'
        '[[process]]\nname = "router"\nrole = "colocated"\n'
    )
    assert main([str(topology)]) == 2
    err = capsys.readouterr().err
    assert "process names must be unique; more than one [[process]] is named 'prefill'" in err


def test_a_cluster_refused_before_it_starts_is_one_line_and_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pdgrpc.cluster.launcher

    topology = tmp_path / "etcd.toml"
    topology.write_text('[[process]]\nname = "etcd"\nrole = "etcd"\n\n[[process]]\nname = "router"\nrole = "colocated"\n')
    monkeypatch.setattr(pdgrpc.cluster.launcher, "find_etcd", lambda: None)  # a host without etcd
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the launcher makes its log directory
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)
    assert main([str(topology), "--insecure"]) == 2
    out = capsys.readouterr()
    assert "error: topology 'etcd' runs etcd, but there is none here: install" in out.err
    assert "Traceback" not in out.err and "starting" not in out.out
    assert list((tmp_path / "tmp").iterdir()) == []
