#!/usr/bin/env bash
# Build the C ABI library from one translation unit.
#   cpu: build/libfdkv_capi_cpu.so with g++, no CUDA ("device" pointers are host memory,
#        so CI tests the ABI with numpy arrays)
#   gpu: build/libfdkv_capi.so with nvcc: sm_90a machine code plus compute_90 PTX that the
#        driver can compile for other GPUs
# The two can coexist: fastdeploy_kvcache.ops.load_capi() prefers the CUDA one.
# Needs no venv.  Idempotent: rebuilds only when a source is newer than the library.
set -euo pipefail
cd "$(dirname "$0")/../.."
kind=${1:-cpu}
case "$kind" in cpu) out=build/libfdkv_capi_cpu.so ;; *) out=build/libfdkv_capi.so ;; esac
mkdir -p build
srcs=(custom_ops/capi/fdkv_capi.cc custom_ops/capi/fdkv_capi.h custom_ops/csrc/swap_core.h
      custom_ops/csrc/swap_core.cc custom_ops/csrc/file_io.cc custom_ops/csrc/stack_launcher.cc custom_ops/csrc/swap_cuda.cu custom_ops/csrc/swap_staged.cu
      custom_ops/capi/build_capi.sh)
up_to_date() {
  [ -f "$out" ] || return 1
  for s in "${srcs[@]}"; do [ "$s" -nt "$out" ] && return 1; done
  return 0
}
if up_to_date; then echo "[build_capi] $out ($kind) is up to date" >&2; exit 0; fi
# -Bsymbolic: calls inside the library bind to its own copies even if the Paddle
# extension (which exports the same ABI) was loaded first with RTLD_GLOBAL.
case "$kind" in
  cpu)
    ${CXX:-g++} -std=c++17 -O2 -D_FORTIFY_SOURCE=2 -fPIC -shared -fvisibility=hidden -Wall -Wextra \
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
echo "[build_capi] built $out ($kind)" >&2
