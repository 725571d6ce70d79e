#!/usr/bin/env bash
# The GPU check of issue 20, in one shot, on a machine with an NVIDIA GPU (docs/gpu.md).
# From the repo root: `bash scripts/gpu_check.sh`; results go under $OUT (default
# ./gpu-check-out), at most eight files: env.txt, tests.txt, tests_detail.txt (only when a
# test failed: the failures again, with UCX's log), transport_rdma.txt (with
# UCX_PROTO_INFO=y), proto_gpu_to_host.txt, transport_tcp.txt, e2e.txt, summary.txt.
# Every step has its own time limit; the limits add up to 9 minutes (540 s).
# Wheels the machine lacks travel in .whl/ (scripts/gpu_wheels.sh, run beforehand).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pdgrpc-site .whl/*.whl \
    || echo "gpu_check: installing .whl failed" >> "$OUT/summary.txt"
  export PYTHONPATH=/tmp/pdgrpc-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# UCX may use its CUDA transports (the tests' default leaves them out)
export UCX_TLS=${UCX_TLS:-tcp,sm,self,cuda_copy,cuda_ipc}
start=$SECONDS
step() {  # step NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.txt, note rc and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  return $rc
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
  $PY -c "from pdgrpc.transport.rdma_regions import ucx_moves_cuda; print('libucx with CUDA transports:', ucx_moves_cuda())"
  echo "UCX_TLS=$UCX_TLS"
  # What UCX itself sees: its version and the CUDA transports it could load
  ucx=$($PY -c "import libucx, os; print(os.path.dirname(libucx.__file__))" 2>/dev/null) \
    && LD_LIBRARY_PATH=$ucx/lib:$ucx/lib/ucx timeout 30 "$ucx/bin/ucx_info" -v \
    && LD_LIBRARY_PATH=$ucx/lib:$ucx/lib/ucx UCX_TLS=all timeout 30 "$ucx/bin/ucx_info" -d | grep -E "Transport:|Device:" | sort | uniq -c
} > "$OUT/env.txt" 2>&1

# 1. The CUDA test set (and the CPU unit tests of the same pieces, now with CUDA present).
tests=(
  tests/test_device.py tests/transport/test_memkind.py tests/transport/test_staging.py
  tests/transport/test_tcp_staged.py tests/bench/test_device.py tests/e2e/test_cuda.py
  "tests/transport/test_conformance.py::TestTcpCudaConformance"
  "tests/transport/test_conformance.py::TestRdmaCudaConformance"
  "tests/transport/test_conformance.py::TestTcpCudaToHostConformance::test_round_trip_random_page_lists"
  "tests/transport/test_conformance.py::TestRdmaCudaToHostConformance::test_round_trip_random_page_lists"
)
cache=(-o cache_dir=/tmp/pdgrpc-pytest-cache)
if ! step tests 275 $PY -m pytest "${cache[@]}" -v -rs --durations=10 --timeout 200 "${tests[@]}"; then
  # the failures again, alone, with UCX's own log
  step tests_detail 60 env UCX_LOG_LEVEL=info $PY -m pytest "${cache[@]}" -x -s -v --lf --timeout 50 "${tests[@]}"
fi

# 2. Which protocol UCX picks, GPU memory to host memory (one round trip, UCX_PROTO_INFO=y).
step proto_gpu_to_host 40 env UCX_PROTO_INFO=y $PY -m pytest -p no:cacheprovider -q -s --timeout 35 \
  "tests/transport/test_conformance.py::TestRdmaCudaToHostConformance::test_prepared_write_sends_what_write_would"

# 3. GB/s vs a CUDA IPC copy_ of the same bytes; UCX_PROTO_INFO=y shows same-GPU protocols.
step transport_rdma 70 env UCX_PROTO_INFO=y $PY -m pdgrpc.bench transport --backend rdma --device cuda \
  --tokens 1024 8192 32768 --cases contiguous scattered --iterations 5 --warmup 2
step transport_tcp 35 $PY -m pdgrpc.bench transport --backend tcp --device cuda \
  --tokens 1024 8192 32768 --cases contiguous scattered --iterations 3 --warmup 1

# 4. TTFT of 1p1d vs colocated, every engine on the GPU, 512-token prompts.
step e2e 60 $PY -m pdgrpc.bench e2e --device cuda --prompt-tokens 512 --transports rdma,tcp \
  --ttft-requests 20 --warmup 3 --throughput-requests 8 --concurrency 4

echo "total: $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3 | tee -a "$OUT/summary.txt"
