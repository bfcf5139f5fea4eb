#!/usr/bin/env bash
# Build the C ABI library build/libfdkv_capi.so from one translation unit.
#   cpu: g++, no CUDA ("device" pointers are host memory; CI tests it with numpy)
#   gpu: nvcc, sm_90a machine code plus compute_90 PTX for other/newer GPUs
# Needs no venv.  Idempotent: rebuilds only when a source is newer than the library.
set -euo pipefail
cd "$(dirname "$0")/../.."
kind=${1:-cpu}
out=build/libfdkv_capi.so
stamp=build/.capi_kind
mkdir -p build
srcs=(custom_ops/capi/fdkv_capi.cc custom_ops/capi/fdkv_capi.h custom_ops/csrc/swap_core.h
      custom_ops/csrc/swap_core.cc custom_ops/csrc/swap_cuda.cu custom_ops/capi/build_capi.sh)
up_to_date() {
  [ -f "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$kind" ] || return 1
  for s in "${srcs[@]}"; do [ "$s" -nt "$out" ] && return 1; done
  return 0
}
if up_to_date; then echo "[build_capi] $out ($kind) is up to date" >&2; exit 0; fi
# -Bsymbolic: calls inside the library bind to its own copies even if the Paddle
# extension (which exports the same ABI) was loaded first with RTLD_GLOBAL.
case "$kind" in
  cpu)
    ${CXX:-g++} -std=c++17 -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra \
      -DFDKV_WITH_CUDA=0 -Wl,-Bsymbolic -o "$out.tmp" custom_ops/capi/fdkv_capi.cc ;;
  gpu)
    NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    "$NVCC" -std=c++17 -O3 -x cu -shared -Xcompiler -fPIC,-fvisibility=hidden,-Wall \
      -DFDKV_WITH_CUDA=1 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 \
      -lineinfo -Xlinker -Bsymbolic -o "$out.tmp" custom_ops/capi/fdkv_capi.cc ;;
  *)
    echo "usage: build_capi.sh {cpu|gpu}" >&2; exit 2 ;;
esac
mv -f "$out.tmp" "$out"
echo "$kind" > "$stamp"
echo "[build_capi] built $out ($kind)" >&2
