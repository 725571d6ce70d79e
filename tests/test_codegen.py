"""Generated code in pdgrpc/v1 is exactly what the protos produce (never hand-edited)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regenerating_protos_changes_nothing(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = tmp_path / "pdgrpc" / "v1"
    committed = ROOT / "pdgrpc" / "v1"
    fresh_names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    committed_names = sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    assert fresh_names == committed_names, "run `make gen`: generated file set differs"
    for name in fresh_names:
        assert (fresh / name).read_bytes() == (committed / name).read_bytes(), f"pdgrpc/v1/{name} is stale or hand-edited: run `make gen`"


def test_every_proto_field_is_commented() -> None:
    """buf style as a rule the tests enforce: every message field carries a comment."""
    missing = []
    for proto in sorted((ROOT / "protos" / "pdgrpc").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "package", "//", "rpc"))
            is_enum_value = is_field and s.split()[0].isupper()
            if is_field and not is_enum_value:
                prev = lines[i - 1].strip() if i else ""
                if not prev.startswith("//") and "//" not in s:
                    missing.append(f"{proto.name}:{i + 1}: {s}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)
