#!/usr/bin/env bash
# Build, install and test fastdeploy_kvcache.  Idempotent: safe to run again.
#
#   bash build.sh          venv + pip packages + Paddle custom ops + C ABI (CPU) library
#   bash build.sh test     the above, then the whole test suite (GPU tests skip with reasons)
#   bash build.sh gpu      build the CUDA C ABI library with nvcc (no venv or Paddle needed)
#   bash build.sh gpu-test build it, then run tests/gpu with the system python3 (CuPy, pytest)
#   bash build.sh bench    run the benchmarks (GPU ones need `bash build.sh gpu` first)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV=${FDKV_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
log() { printf '[build.sh] %s\n' "$*" >&2; }

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup_venv() {
  if [ ! -x "$PY" ]; then
    log "creating venv at $VENV"
    python3 -m venv "$VENV" || {
      log "python3 -m venv failed; installing python3-venv"
      apt-get update -qq && apt-get install -y -qq python3-venv && python3 -m venv "$VENV"
    }
  fi
  local paddle_pkg=paddlepaddle
  if have_gpu; then paddle_pkg=paddlepaddle-gpu; fi
  # One pip call, quiet; a no-op when everything is installed already.
  if ! "$PY" -c "import paddle, numpy, pytest, hypothesis, xxhash" >/dev/null 2>&1; then
    log "installing pip packages ($paddle_pkg, numpy, pytest, hypothesis, xxhash)"
    "$PY" -m pip install -q --upgrade pip setuptools wheel
    "$PY" -m pip install -q "$paddle_pkg>=3.0" numpy pytest hypothesis xxhash \
      || { log "$paddle_pkg failed; falling back to CPU paddlepaddle"; "$PY" -m pip install -q "paddlepaddle>=3.0" numpy pytest hypothesis xxhash; }
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
}

# Mooncake Store client (storage tier's mooncake backend and its tests): the Debian package
# libibverbs1 (only when missing; apt-get update only when the install needs it) and the
# CPU wheel, which also ships mooncake_master and mooncake_client.  Best effort: without it
# the file backend still works and the Mooncake tests skip saying to run this script.
install_mooncake() {
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    log "installing Debian package libibverbs1 (Mooncake needs it)"
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libibverbs1; } \
      || log "could not install libibverbs1; the mooncake storage backend will be unavailable"
  fi
  if ! "$PY" -c "from mooncake.store import MooncakeDistributedStore" >/dev/null 2>&1; then
    log "installing mooncake-transfer-engine-non-cuda"
    "$PY" -m pip install -q mooncake-transfer-engine-non-cuda \
      || log "pip install mooncake-transfer-engine-non-cuda failed; the mooncake storage backend will be unavailable"
  fi
}

build_capi_cpu() { bash custom_ops/capi/build_capi.sh cpu; }
build_capi_gpu() { bash custom_ops/capi/build_capi.sh gpu; }
# On a machine with a GPU and nvcc, `build`/`test` also build the CUDA C ABI so that
# tests/gpu run instead of skipping.
build_capi_gpu_if_possible() {
  if have_gpu && { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then build_capi_gpu; fi
}
build_paddle_ops() { "$PY" setup_ops.py; }

cmd=${1:-build}
case "$cmd" in
  build)
    setup_venv; install_mooncake; build_capi_cpu; build_capi_gpu_if_possible; build_paddle_ops ;;
  test)
    setup_venv; install_mooncake; build_capi_cpu; build_capi_gpu_if_possible; build_paddle_ops
    shift || true
    # -rs prints every skipped test with its reason (the GPU tests say what they need).
    "$PY" -m pytest -q -rs tests "$@" ;;
  gpu)
    build_capi_gpu ;;
  gpu-test)
    # On a GPU machine without the venv (the device machine): system python3 with CuPy.
    build_capi_gpu
    shift || true
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "${GPU_PY:-python3}" -m pytest -q -rs -p no:cacheprovider tests/gpu "$@" ;;
  bench)
    shift || true
    for b in benchmarks/bench_*.py; do log "running $b"; "${BENCH_PY:-$PY}" "$b" "$@"; done ;;
  *)
    echo "usage: bash build.sh [build|test|gpu|gpu-test|bench]" >&2; exit 2 ;;
esac
