// Paddle custom ops over the swap core: pull pointer, shape, dtype, place and stream out
// of paddle::Tensor and call custom_ops/csrc.  No copy logic lives here.
//
// One translation unit: it includes the C ABI (which includes the core and, with CUDA,
// the launchers), so the extension also exports fdkv_host_alloc & co. for ops.py's
// cuda_host_alloc, matching the installed Paddle (pinned memory only with CUDA).
#include "../capi/fdkv_capi.cc"

#include <string>
#include <vector>

#include "pd_static_op.h"

namespace {

const char kInvalidTag[] = "[fdkv:invalid] ";

int64_t ItemSize(const paddle::Tensor& t, const char* op, const char* name, size_t index) {
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
      throw fdkv::InvalidArgument(std::string(op) + ": " + name + "[" + std::to_string(index) +
                                  "] has an unsupported dtype; use bfloat16, float16, float32 or uint8");
  }
}

fdkv::TensorDesc Describe(const paddle::Tensor& t, const char* op, const char* name, size_t index) {
  const std::vector<int64_t> shape = t.shape();
  if (shape.empty()) {
    throw fdkv::InvalidArgument(std::string(op) + ": " + name + "[" + std::to_string(index) +
                                "] is 0-d; dim 0 must be the block index");
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
// tensor's current stream.
fdkv::ExecTarget Target(const std::vector<paddle::Tensor>& tensors, const char* op, int64_t stream,
                        bool sync, int path) {
  fdkv::ExecTarget target;
  target.sync = sync;
  target.copy_path = path;  // validated by the core; ignored on CPU tensors
  const bool gpu = tensors.front().is_gpu();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].is_gpu() != gpu || (gpu && tensors[i].place() != tensors.front().place())) {
      throw fdkv::InvalidArgument(std::string(op) + ": cache_gpu_tensors[" + std::to_string(i) +
                                  "] is on another device than cache_gpu_tensors[0]");
    }
  }
  if (gpu) {
#if FDKV_WITH_CUDA
    target.cuda = true;
    target.stream = stream != 0 ? reinterpret_cast<void*>(stream)
                                : reinterpret_cast<void*>(tensors.front().stream());
#else
    throw fdkv::InvalidArgument(std::string(op) +
                                ": cache_gpu_tensors[0] is a GPU tensor but the ops were built without CUDA");
#endif
  } else if (!tensors.front().is_cpu()) {
    throw fdkv::InvalidArgument(std::string(op) + ": cache_gpu_tensors[0] must be a GPU or CPU tensor");
  }
  return target;
}

// Run `fn` and turn core exceptions into Paddle errors; validation errors carry a tag
// that ops.py turns into SwapOpError.
template <typename Fn>
void Run(const std::vector<paddle::Tensor>& tensors, Fn&& fn) {
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
    PD_THROW(kInvalidTag, e.what());
  } catch (const fdkv::CudaFailure& e) {
    PD_THROW(e.what());
  }
}

void PerLayer(const char* op, const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr,
              int64_t max_block_num_cpu, const std::vector<int64_t>& ids_gpu,
              const std::vector<int64_t>& ids_cpu, int mode, int64_t stream, bool sync, int path) {
  const std::vector<paddle::Tensor> tensors{cache_gpu};
  Run(tensors, [&] {
    std::vector<fdkv::TensorDesc> descs{Describe(cache_gpu, op, "cache_gpu", 0)};
    std::vector<void*> hosts{reinterpret_cast<void*>(cache_cpu_ptr)};
    fdkv::ExecTarget target = Target(tensors, op, stream, sync, path);
    fdkv::SwapLayers(op, descs, hosts, max_block_num_cpu,
                     fdkv::IdSpan{ids_gpu.data(), static_cast<int64_t>(ids_gpu.size()), "swap_block_ids_gpu"},
                     fdkv::IdSpan{ids_cpu.data(), static_cast<int64_t>(ids_cpu.size()), "swap_block_ids_cpu"},
                     mode, target, "cache_cpu_ptr");
  });
}

}  // namespace

// ------------------------------------------------------------------------ kernels
void SwapCachePerLayer(const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr, int64_t max_block_num_cpu,
                       const std::vector<int64_t>& swap_block_ids_gpu,
                       const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode, int path) {
  (void)rank;  // the device comes from the tensor's place
  PerLayer("swap_cache_per_layer", cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu,
           swap_block_ids_cpu, mode, /*stream=*/0, /*sync=*/true, path);
}

void SwapCachePerLayerAsync(const paddle::Tensor& cache_gpu, int64_t cache_cpu_ptr, int64_t max_block_num_cpu,
                            const std::vector<int64_t>& swap_block_ids_gpu,
                            const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode,
                            int64_t stream, int path) {
  (void)rank;
  PerLayer("swap_cache_per_layer_async", cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu,
           swap_block_ids_cpu, mode, stream, /*sync=*/false, path);
}

void SwapCacheAllLayers(const std::vector<paddle::Tensor>& cache_gpu_tensors,
                        const std::vector<int64_t>& cache_cpu_ptrs, int64_t max_block_num_cpu,
                        const std::vector<int64_t>& swap_block_ids_gpu,
                        const std::vector<int64_t>& swap_block_ids_cpu, int rank, int mode, int64_t stream,
                        int path) {
  (void)rank;
  const char* op = "swap_cache_all_layers";
  Run(cache_gpu_tensors, [&] {
    if (cache_gpu_tensors.empty()) {
      throw fdkv::InvalidArgument(std::string(op) + ": cache_gpu_tensors is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> descs;
    for (size_t i = 0; i < cache_gpu_tensors.size(); ++i) {
      descs.push_back(Describe(cache_gpu_tensors[i], op, "cache_gpu_tensors", i));
    }
    std::vector<void*> hosts;
    for (int64_t p : cache_cpu_ptrs) hosts.push_back(reinterpret_cast<void*>(p));
    fdkv::ExecTarget target = Target(cache_gpu_tensors, op, stream, /*sync=*/false, path);
    fdkv::SwapLayers(op, descs, hosts, max_block_num_cpu,
                     fdkv::IdSpan{swap_block_ids_gpu.data(), static_cast<int64_t>(swap_block_ids_gpu.size()),
                                  "swap_block_ids_gpu"},
                     fdkv::IdSpan{swap_block_ids_cpu.data(), static_cast<int64_t>(swap_block_ids_cpu.size()),
                                  "swap_block_ids_cpu"},
                     mode, target, "cache_cpu_ptrs");
  });
}

void SwapCacheLayout(const std::vector<paddle::Tensor>& cache_gpu_tensors, int64_t cache_cpu_ptr,
                     const std::vector<int64_t>& cache_shape, const std::vector<int64_t>& gpu_block_ids,
                     const std::vector<int64_t>& cpu_block_ids, int rank, int mode, int64_t stream,
                     int64_t max_block_num_cpu, int path) {
  (void)rank;
  const char* op = "swap_cache_layout";
  Run(cache_gpu_tensors, [&] {
    if (cache_gpu_tensors.empty()) {
      throw fdkv::InvalidArgument(std::string(op) + ": cache_gpu_tensors is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> descs;
    for (size_t i = 0; i < cache_gpu_tensors.size(); ++i) {
      if (!cache_shape.empty() && cache_gpu_tensors[i].shape() != cache_shape) {
        throw fdkv::InvalidArgument(std::string(op) + ": cache_gpu_tensors[" + std::to_string(i) +
                                    "] does not have the shape given in cache_shape");
      }
      descs.push_back(Describe(cache_gpu_tensors[i], op, "cache_gpu_tensors", i));
    }
    fdkv::ExecTarget target = Target(cache_gpu_tensors, op, stream, /*sync=*/false, path);
    fdkv::SwapLayout(op, descs, reinterpret_cast<void*>(cache_cpu_ptr), max_block_num_cpu,
                     fdkv::IdSpan{gpu_block_ids.data(), static_cast<int64_t>(gpu_block_ids.size()), "gpu_block_ids"},
                     fdkv::IdSpan{cpu_block_ids.data(), static_cast<int64_t>(cpu_block_ids.size()), "cpu_block_ids"},
                     mode, target);
  });
}

// ------------------------------------------------------------------------ registration
// Attribute lists follow the FastDeploy design (DESIGN.md), each with one optional trailing
// attribute `path` (the call's copy path: -1 the process-wide option, 0 auto, 1 kernel,
// 2 dma; ignored on CPU tensors) that ops.py fills with -1 unless the caller passes one.
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
