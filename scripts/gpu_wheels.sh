#!/usr/bin/env bash
# Run HERE (a machine with PyPI access), before scripts/gpu_check.sh runs on the GPU machine:
# downloads into .whl/ (git-ignored) the wheels that machine's image lacks, for its
# python3 (3.12, x86-64), so the device call can carry them (`carry: [".whl"]`, ~49 MiB;
# .whl/ is in .gitignore).
# The image already has CUDA torch, numpy, uvloop, prometheus-client, safetensors,
# tokenizers, transformers, pytest, pytest-timeout and hypothesis
# (/work/.library/device/KINDS.md); pdgrpc itself runs from the checkout (PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  libucx-cu12==1.21.0 grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  pytest-asyncio==1.5.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2
du -sh .whl
