#!/usr/bin/env python3
"""Generate pdgrpc/v1 (messages, gRPC stubs and .pyi type stubs) from protos/pdgrpc/v1.

Usage: python scripts/gen_protos.py [--out DIR]

The generated files are committed; tests/test_codegen.py regenerates into a temporary
directory and fails if anything differs, so never edit pdgrpc/v1 by hand.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_PROTOS = PROTO_ROOT / "pdgrpc" / "v1"

INIT_TEXT = '"""Generated protobuf and gRPC code for package pdgrpc.v1. Do not edit: run `make gen`."""\n'


def generate(out_root: Path) -> list[Path]:
    """Write generated modules under out_root/pdgrpc/v1; return the files written."""
    from grpc_tools import protoc  # test extra; imported here so --help works without it

    protos = sorted(PACKAGE_PROTOS.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PACKAGE_PROTOS}")
    (out_root / "pdgrpc" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    plugin_dir = Path(sys.executable).parent
    import os

    env_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{plugin_dir}{os.pathsep}{env_path}"
    try:
        rc = protoc.main(args)
    finally:
        os.environ["PATH"] = env_path
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    init = out_root / "pdgrpc" / "v1" / "__init__.py"
    init.write_text(INIT_TEXT)
    return sorted((out_root / "pdgrpc" / "v1").iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write into DIR/pdgrpc/v1 instead of the repo")
    ns = parser.parse_args()
    if ns.out is not None:
        generate(ns.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        target = ROOT / "pdgrpc" / "v1"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for f in generated:
            if f.is_file():
                shutil.copy2(f, target / f.name)
    print(f"generated {len(generated)} files in {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
