// Paddle custom ops over the swap core: pull pointer, shape, dtype, place and stream out
// of paddle::Tensor and call custom_ops/csrc.  No copy logic lives here.
//
// One translation unit: it includes the C ABI (which includes the core and, with CUDA,
// the launchers), so the extension also exports fdkv_host_alloc & co. for fastdeploy_kvcache/ops'
// cuda_host_alloc, matching the installed Paddle (pinned memory only with CUDA).
#include "../capi/fdkv_capi.cc"

#include <string>
#include <vector>

#include "pd_static_op.h"

namespace {

// `index` -1: the one tensor of a per-layer op (named without an index).
int64_t ItemSize(const paddle::Tensor& t, const char* op, const char* name, int64_t index) {
  switch (t.dtype()) {
    case paddle::DataType::BFLOAT16:
    case paddle::DataType::FLOAT16:
      return 2;
    case paddle::DataType::FLOAT32:
      return 4;
    case paddle::DataType::UINT8:
    case paddle::DataType::INT8:
      return 1;
    default:
      throw fdkv::InvalidArgument(op, name, index,
                                  " has an unsupported dtype; use bfloat16, float16, float32 or uint8");
  }
}

fdkv::TensorDesc Describe(const paddle::Tensor& t, const char* op, const char* name, int64_t index) {
  const std::vector<int64_t> shape = t.shape();
  if (shape.empty()) {
    throw fdkv::InvalidArgument(op, name, index, " is 0-d; dim 0 must be the block index");
  }
  int64_t per_block = 1;
  for (size_t d = 1; d < shape.size(); ++d) per_block *= shape[d];
  fdkv::TensorDesc desc;
  desc.dev = const_cast<void*>(t.data());
  desc.num_blocks = shape[0];
  desc.block_bytes = per_block * ItemSize(t, op, name, index);
  return desc;
}

#if FDKV_WITH_CUDA
// Makes the tensors' device current for the call (the scratch ring and the launch use
// the current device), restoring the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (device != prev_) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};
#endif

// Where the tensors live decides CPU vs CUDA execution; `stream` 0 means the first
// tensor's current stream.  `rank` is the CUDA device ordinal the tensors must be on
// (FastDeploy passes the worker's device id there); -1 accepts the tensors' own device.
// On CPU tensors it is only range-checked.
fdkv::ExecTarget Target(const std::vector<paddle::Tensor>& tensors, const char* op, const char* name,
                        int rank, int64_t stream, bool sync, int path) {
  fdkv::ExecTarget target;
  target.sync = sync;
  target.copy_path = path;  // validated by the core; ignored on CPU tensors
  if (rank < -1) {
    throw fdkv::InvalidArgument(op, "rank", -1, " = " + std::to_string(rank) +
                                                    " must be the tensors' device ordinal, or -1");
  }
  const bool gpu = tensors.front().is_gpu();
  const int64_t first = tensors.size() == 1 && std::string(name) == "cache_gpu" ? -1 : 0;  // per-layer: no index
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].is_gpu() != gpu || (gpu && tensors[i].place() != tensors.front().place())) {
      throw fdkv::InvalidArgument(op, name, static_cast<int64_t>(i), " is on another device than " +
                                                                      std::string(name) + "[0]");
    }
  }
  if (gpu) {
#if FDKV_WITH_CUDA
    const int device = tensors.front().place().GetDeviceId();
    if (rank >= 0 && rank != device) {
      throw fdkv::InvalidArgument(op, "rank", -1, " = " + std::to_string(rank) + " but " + name +
                                                      " live on GPU " + std::to_string(device) +
                                                      "; rank is the device ordinal (-1: the tensors' device)");
    }
    target.cuda = true;
    target.stream = stream != 0 ? reinterpret_cast<void*>(stream)
                                : reinterpret_cast<void*>(tensors.front().stream());
#else
    throw fdkv::InvalidArgument(op, name, first, " is a GPU tensor but the ops were built without CUDA");
#endif
  } else if (!tensors.front().is_cpu()) {
    throw fdkv::InvalidArgument(op, name, first, " must be a GPU or CPU tensor");
  }
  return target;
}

// Run `fn` and turn core exceptions into Paddle errors.  A validation error is also
// recorded, with its op / argument / index as values, in the calling thread's error state
// of the C ABI this extension exports (fdkv_last_error_fields): fastdeploy_kvcache/ops reads the fields
// from there, not from Paddle's rewrapped message text.
template <typename Fn>
void Run(const std::vector<paddle::Tensor>& tensors, Fn&& fn) {
  ClearError();
  try {
#if FDKV_WITH_CUDA
    if (!tensors.empty() && tensors.front().is_gpu()) {
      DeviceGuard guard(tensors.front().place().GetDeviceId());
      fn();
      return;
    }
#endif
    (void)tensors;
    fn();
  } catch (const fdkv::InvalidArgument& e) {
    FailInvalid(e);
    PD_THROW(e.what());
  } catch (const fdkv::CudaFailure& e) {
    Fail(FDKV_ERR_CUDA, e.what());
    PD_THROW(e.what());
  } catch (const std::bad_alloc&) {
    Fail(FDKV_ERR_NO_MEMORY, "fdkv: out of host memory");
    PD_THROW("fdkv: out of host memory");
  }
}

void PerLayer(const char* op, const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr,
              int64_t max_block_num_cpu, const std::vector<int64_t>& ids_gpu,
              const std::vector<int64_t>& ids_cpu, int rank, int mode, int64_t stream, bool sync, int path) {
  const std::vector<paddle::Tensor> tensors{cache_gpu};
  Run(tensors, [&] {
    std::vector<fdkv::TensorDesc> descs{Describe(cache_gpu, op, "cache_gpu", -1)};
    std::vector<void*> hosts{reinterpret_cast<void*>(cache_cpu_ptr)};
    fdkv::ExecTarget target = Target(tensors, op, "cache_gpu", rank, stream, sync, path);
    fdkv::SwapLayers(op, descs, hosts, max_block_num_cpu,
                     fdkv::IdSpan{ids_gpu.data(), static_cast<int64_t>(ids_gpu.size()), "swap_block_ids_gpu"},
                     fdkv::IdSpan{ids_cpu.data(), static_cast<int64_t>(ids_cpu.size()), "swap_block_ids_cpu"},
                     mode, target, fdkv::PaddleArgNames("cache_gpu", "cache_cpu_ptr"));
  });
}

}  // namespace

// ------------------------------------------------------------------------ kernels
void SwapCachePerLayer(const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr, int64_t max_block_num_cpu,
                       const std::vector<int64_t>& swap_block_ids_gpu,
                       const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode, int path) {
  PerLayer("swap_cache_per_layer", cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu,
           swap_block_ids_cpu, rank, mode, /*stream=*/0, /*sync=*/true, path);
}

void SwapCachePerLayerAsync(const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr, int64_t max_block_num_cpu,
                            const std::vector<int64_t>& swap_block_ids_gpu,
                            const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode,
                            int64_t stream, int path) {
  PerLayer("swap_cache_per_layer_async", cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu,
           swap_block_ids_cpu, rank, mode, stream, /*sync=*/false, path);
}

void SwapCacheAllLayers(const std::vector<paddle::Tensor>& cache_gpu_tensors,
                        const std::vector<int64_t>& cache_cpu_ptrs, int64_t max_block_num_cpu,
                        const std::vector<int64_t>& swap_block_ids_gpu,
                        const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode, int64_t stream,
                        int path) {
  const char* op = "swap_cache_all_layers";
  Run(cache_gpu_tensors, [&] {
    if (cache_gpu_tensors.empty()) {
      throw fdkv::InvalidArgument(op, "cache_gpu_tensors", -1, " is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> descs;
    for (size_t i = 0; i < cache_gpu_tensors.size(); ++i) {
      descs.push_back(Describe(cache_gpu_tensors[i], op, "cache_gpu_tensors", static_cast<int64_t>(i)));
    }
    std::vector<void*> hosts;
    for (int64_t p : cache_cpu_ptrs) hosts.push_back(reinterpret_cast<void*>(p));
    fdkv::ExecTarget target = Target(cache_gpu_tensors, op, "cache_gpu_tensors", rank, stream, /*sync=*/false, path);
    fdkv::SwapLayers(op, descs, hosts, max_block_num_cpu,
                     fdkv::IdSpan{swap_block_ids_gpu.data(), static_cast<int64_t>(swap_block_ids_gpu.size()),
                                  "swap_block_ids_gpu"},
                     fdkv::IdSpan{swap_block_ids_cpu.data(), static_cast<int64_t>(swap_block_ids_cpu.size()),
                                  "swap_block_ids_cpu"},
                     mode, target, fdkv::PaddleArgNames("cache_gpu_tensors", "cache_cpu_ptrs"));
  });
}

void SwapCacheLayout(const std::vector<paddle::Tensor>& cache_gpu_tensors, int64_t cache_cpu_ptr,
                     const std::vector<int64_t>& cache_shape, const std::vector<int64_t>& gpu_block_ids,
                     const std::vector<int64_t>& cpu_block_ids, int rank, int mode, int64_t stream,
                     int64_t max_block_num_cpu, int path) {
  const char* op = "swap_cache_layout";
  Run(cache_gpu_tensors, [&] {
    if (cache_gpu_tensors.empty()) {
      throw fdkv::InvalidArgument(op, "cache_gpu_tensors", -1, " is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> descs;
    for (size_t i = 0; i < cache_gpu_tensors.size(); ++i) {
      if (!cache_shape.empty() && cache_gpu_tensors[i].shape() != cache_shape) {
        throw fdkv::InvalidArgument(op, "cache_gpu_tensors", static_cast<int64_t>(i),
                                    " does not have the shape given in cache_shape");
      }
      descs.push_back(Describe(cache_gpu_tensors[i], op, "cache_gpu_tensors", static_cast<int64_t>(i)));
    }
    fdkv::ExecTarget target = Target(cache_gpu_tensors, op, "cache_gpu_tensors", rank, stream, /*sync=*/false, path);
    fdkv::SwapLayout(op, descs, reinterpret_cast<void*>(cache_cpu_ptr), max_block_num_cpu,
                     fdkv::IdSpan{gpu_block_ids.data(), static_cast<int64_t>(gpu_block_ids.size()), "gpu_block_ids"},
                     fdkv::IdSpan{cpu_block_ids.data(), static_cast<int64_t>(cpu_block_ids.size()), "cpu_block_ids"},
                     mode, target, fdkv::PaddleArgNames("cache_gpu_tensors", "cache_cpu_ptr"));
  });
}

// ------------------------------------------------------------------------ registration
// Attribute lists follow FastDeploy's swap ops (docs/ops.md, "API"), each with one optional trailing
// attribute `path` (the call's copy path: -1 the process-wide option, 0 auto, 1 kernel,
// 2 dma; ignored on CPU tensors) that fastdeploy_kvcache/ops fills with -1 unless the caller passes one.
PD_BUILD_STATIC_OP(swap_cache_per_layer)
    .Inputs({"cache_gpu"})
    .Outputs({"cache_dst_out"})
    .Attrs({"cache_cpu_ptr: int64_t", "max_block_num_cpu: int64_t",
            "swap_block_ids_gpu: std::vector<int64_t>", "swap_block_ids_cpu: std::vector<int64_t>",
            "rank: int", "mode: int", "path: int"})
    .SetInplaceMap({{"cache_gpu", "cache_dst_out"}})
    .SetKernelFn(PD_KERNEL(SwapCachePerLayer));

PD_BUILD_STATIC_OP(swap_cache_per_layer_async)
    .Inputs({"cache_gpu"})
    .Outputs({"cache_dst_out"})
    .Attrs({"cache_cpu_ptr: int64_t", "max_block_num_cpu: int64_t",
            "swap_block_ids_gpu: std::vector<int64_t>", "swap_block_ids_cpu: std::vector<int64_t>",
            "rank: int", "mode: int", "stream: int64_t", "path: int"})
    .SetInplaceMap({{"cache_gpu", "cache_dst_out"}})
    .SetKernelFn(PD_KERNEL(SwapCachePerLayerAsync));

PD_BUILD_STATIC_OP(swap_cache_all_layers)
    .Inputs({paddle::Vec("cache_gpu_tensors")})
    .Outputs({paddle::Vec("cache_dst_outs")})
    .Attrs({"cache_cpu_ptrs: std::vector<int64_t>", "max_block_num_cpu: int64_t",
            "swap_block_ids_gpu: std::vector<int64_t>", "swap_block_ids_cpu: std::vector<int64_t>",
            "rank: int", "mode: int", "stream: int64_t", "path: int"})
    .SetInplaceMap({{paddle::Vec("cache_gpu_tensors"), paddle::Vec("cache_dst_outs")}})
    .SetKernelFn(PD_KERNEL(SwapCacheAllLayers));

PD_BUILD_STATIC_OP(swap_cache_layout)
    .Inputs({paddle::Vec("cache_gpu_tensors")})
    .Outputs({paddle::Vec("cache_dst_outs")})
    .Attrs({"cache_cpu_ptr: int64_t", "cache_shape: std::vector<int64_t>",
            "gpu_block_ids: std::vector<int64_t>", "cpu_block_ids: std::vector<int64_t>", "rank: int",
            "mode: int", "stream: int64_t", "max_block_num_cpu: int64_t", "path: int"})
    .SetInplaceMap({{paddle::Vec("cache_gpu_tensors"), paddle::Vec("cache_dst_outs")}})
    .SetKernelFn(PD_KERNEL(SwapCacheLayout));
