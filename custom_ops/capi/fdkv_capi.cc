// extern "C" ABI over the swap core, for callers without Paddle (ctypes from Python with
// CuPy / torch / numpy memory).  Every function returns a status code; the message of the
// calling thread's last failure is available from fdkv_last_error().
//
// This file is also the single translation unit of libfdkv_capi.so: it pulls in the core
// (and, when built by nvcc with FDKV_WITH_CUDA=1, the CUDA launchers), which keeps the
// build to one compiler invocation.
#include "../csrc/swap_core.cc"
#if FDKV_WITH_CUDA
#include "../csrc/swap_cuda.cu"
#endif

#include "fdkv_capi.h"

#include <new>
#include <string>
#include <vector>

namespace {

thread_local std::string t_last_error;

int Fail(int code, const char* what) {
  t_last_error = what;
  return code;
}

// Run `fn`, mapping exceptions to the ABI's status codes.
template <typename Fn>
int Guard(Fn&& fn) {
  try {
    fn();
    t_last_error.clear();
    return FDKV_OK;
  } catch (const fdkv::InvalidArgument& e) {
    return Fail(FDKV_ERR_INVALID_ARGUMENT, e.what());
  } catch (const fdkv::CudaFailure& e) {
    return Fail(FDKV_ERR_CUDA, e.what());
  } catch (const std::bad_alloc&) {
    return Fail(FDKV_ERR_OTHER, "fdkv: out of host memory");
  } catch (const std::exception& e) {
    return Fail(FDKV_ERR_OTHER, e.what());
  } catch (...) {
    return Fail(FDKV_ERR_OTHER, "fdkv: unknown error");
  }
}

std::vector<fdkv::TensorDesc> Tensors(void* const* dev_ptrs, const int64_t* num_dev_blocks,
                                      const int64_t* block_bytes, int64_t num_tensors) {
  std::vector<fdkv::TensorDesc> tensors(static_cast<size_t>(num_tensors > 0 ? num_tensors : 0));
  for (size_t t = 0; t < tensors.size(); ++t) {
    tensors[t].dev = dev_ptrs[t];
    tensors[t].num_blocks = num_dev_blocks[t];
    tensors[t].block_bytes = block_bytes[t];
  }
  return tensors;
}

}  // namespace

extern "C" {

FDKV_API const char* fdkv_last_error(void) { return t_last_error.c_str(); }

FDKV_API int fdkv_is_cuda(void) { return fdkv::BuiltWithCuda() ? 1 : 0; }

FDKV_API int fdkv_abi_version(void) { return FDKV_ABI_VERSION; }

FDKV_API int fdkv_host_alloc(size_t nbytes, unsigned flags, void** out) {
  if (out == nullptr) return Fail(FDKV_ERR_INVALID_ARGUMENT, "cuda_host_alloc: out is a null pointer");
  *out = nullptr;
  return Guard([&] { *out = fdkv::HostAlloc(nbytes, flags); });
}

FDKV_API int fdkv_host_free(void* ptr) {
  return Guard([&] { fdkv::HostFree(ptr); });
}

FDKV_API int fdkv_swap_layers(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptrs,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path) {
  return Guard([&] {
    const char* name = (op != nullptr && *op != '\0') ? op : "swap_all_layers";
    if (num_tensors <= 0 || dev_ptrs == nullptr || host_ptrs == nullptr) {
      throw fdkv::InvalidArgument(std::string(name) + ": dev_ptrs is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> tensors = Tensors(dev_ptrs, num_dev_blocks, block_bytes, num_tensors);
    std::vector<void*> hosts(host_ptrs, host_ptrs + num_tensors);
    fdkv::ExecTarget target{fdkv::BuiltWithCuda(), stream, sync != 0, path};
    fdkv::SwapLayers(name, tensors, hosts, num_host_blocks,
                     fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                     fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, target, "host_ptrs");
  });
}

FDKV_API int fdkv_swap_layout(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptr,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path) {
  return Guard([&] {
    const char* name = (op != nullptr && *op != '\0') ? op : "swap_layout";
    if (num_tensors <= 0 || dev_ptrs == nullptr || host_ptr == nullptr) {
      throw fdkv::InvalidArgument(std::string(name) + ": dev_ptrs is empty; pass at least one tensor");
    }
    std::vector<fdkv::TensorDesc> tensors = Tensors(dev_ptrs, num_dev_blocks, block_bytes, num_tensors);
    fdkv::ExecTarget target{fdkv::BuiltWithCuda(), stream, sync != 0, path};
    fdkv::SwapLayout(name, tensors, host_ptr[0], num_host_blocks,
                     fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                     fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, target);
  });
}

FDKV_API int fdkv_set_option(const char* name, int64_t value) {
  if (name == nullptr || !fdkv::SetOption(name, value)) {
    return Fail(FDKV_ERR_INVALID_ARGUMENT,
                (std::string("set_option: name '") + (name ? name : "") + "' unknown or value " +
                 std::to_string(value) + " invalid").c_str());
  }
  return FDKV_OK;
}

FDKV_API int fdkv_get_option(const char* name, int64_t* value) {
  if (name == nullptr || value == nullptr || !fdkv::GetOption(name, value)) {
    return Fail(FDKV_ERR_INVALID_ARGUMENT,
                (std::string("get_option: name '") + (name ? name : "") + "' unknown").c_str());
  }
  return FDKV_OK;
}

FDKV_API int fdkv_last_path(void) { return fdkv::LastPath(); }

FDKV_API int fdkv_stream_synchronize(void* stream) {
  return Guard([&] { fdkv::StreamSynchronize(stream); });
}

}  // extern "C"
