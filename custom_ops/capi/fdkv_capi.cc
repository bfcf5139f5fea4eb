// extern "C" ABI over the swap core, for callers without Paddle (ctypes from Python with
// CuPy / torch / numpy memory).  Every function returns a status code; the message of the
// calling thread's last failure is available from fdkv_last_error().
//
// This file is also the single translation unit of libfdkv_capi.so: it pulls in the core
// (and, when built by nvcc with FDKV_WITH_CUDA=1, the CUDA launchers), which keeps the
// build to one compiler invocation.
#include "../csrc/swap_core.cc"
#include "../csrc/file_io.cc"
#include "../csrc/stack_launcher.cc"
#if FDKV_WITH_CUDA
#include "../csrc/swap_cuda.cu"
#endif

#include "fdkv_capi.h"

#include <new>
#include <string>
#include <vector>

namespace {

// The calling thread's last failure: the code, the message, and for
// FDKV_ERR_INVALID_ARGUMENT the op / argument / index as separate values.
struct ErrorState {
  int code = FDKV_OK;
  std::string message;
  std::string op;
  std::string argument;
  int64_t index = -1;
};
thread_local ErrorState t_error;

void ClearError() {
  t_error.code = FDKV_OK;
  t_error.message.clear();
  t_error.op.clear();
  t_error.argument.clear();
  t_error.index = -1;
}

int Fail(int code, const std::string& what) {
  ClearError();
  t_error.code = code;
  t_error.message = what;
  return code;
}

int FailInvalid(const fdkv::InvalidArgument& e) {
  Fail(FDKV_ERR_INVALID_ARGUMENT, e.what());
  t_error.op = e.op();
  t_error.argument = e.argument();
  t_error.index = e.index();
  return FDKV_ERR_INVALID_ARGUMENT;
}

// Run `fn`, mapping exceptions to the ABI's status codes.  No exception crosses the ABI.
template <typename Fn>
int Guard(Fn&& fn) {
  try {
    fn();
    ClearError();
    return FDKV_OK;
  } catch (const fdkv::InvalidArgument& e) {
    return FailInvalid(e);
  } catch (const fdkv::CudaFailure& e) {
    return Fail(FDKV_ERR_CUDA, e.what());
  } catch (const std::bad_alloc&) {
    return Fail(FDKV_ERR_NO_MEMORY, "fdkv: out of host memory");
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

// The C arrays a swap reads before the core sees them (the core cannot check a null table).
void CheckArrays(const char* op, int64_t num_tensors, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                 const int64_t* block_bytes, void* const* host_ptrs) {
  if (num_tensors <= 0) {
    throw fdkv::InvalidArgument(op, "dev_ptrs", -1, " is empty (num_tensors = " + std::to_string(num_tensors) +
                                                        "); pass at least one tensor");
  }
  if (dev_ptrs == nullptr) throw fdkv::InvalidArgument(op, "dev_ptrs", -1, " is a null pointer");
  if (num_dev_blocks == nullptr) throw fdkv::InvalidArgument(op, "num_dev_blocks", -1, " is a null pointer");
  if (block_bytes == nullptr) throw fdkv::InvalidArgument(op, "block_bytes", -1, " is a null pointer");
  if (host_ptrs == nullptr) throw fdkv::InvalidArgument(op, "host_ptrs", -1, " is a null pointer");
}

// The per-tensor swaps' shared arguments (fdkv_swap_layers, fdkv_swap_layer_groups), checked
// and converted once: the op's name, the tensors, one host pointer per tensor, the target.
struct LayerArgs {
  const char* name;
  std::vector<fdkv::TensorDesc> tensors;
  std::vector<void*> hosts;
  fdkv::ExecTarget target;
};

LayerArgs PrepareLayers(const char* op, const char* default_name, void* const* dev_ptrs,
                        const int64_t* num_dev_blocks, const int64_t* block_bytes, int64_t num_tensors,
                        void* const* host_ptrs, void* stream, int sync, int path) {
  const char* name = (op != nullptr && *op != '\0') ? op : default_name;
  CheckArrays(name, num_tensors, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs);
  return LayerArgs{name, Tensors(dev_ptrs, num_dev_blocks, block_bytes, num_tensors),
                   std::vector<void*>(host_ptrs, host_ptrs + num_tensors),
                   fdkv::ExecTarget{fdkv::BuiltWithCuda(), stream, sync != 0, path}};
}

}  // namespace

extern "C" {

FDKV_API const char* fdkv_last_error(void) { return t_error.message.c_str(); }

FDKV_API int fdkv_last_error_fields(const char** op, const char** argument, int64_t* index) {
  if (op != nullptr) *op = t_error.op.c_str();
  if (argument != nullptr) *argument = t_error.argument.c_str();
  if (index != nullptr) *index = t_error.index;
  return t_error.code;
}

FDKV_API void fdkv_clear_error(void) { ClearError(); }

FDKV_API int fdkv_is_cuda(void) { return fdkv::BuiltWithCuda() ? 1 : 0; }

FDKV_API int fdkv_abi_version(void) { return FDKV_ABI_VERSION; }

FDKV_API int fdkv_host_alloc(size_t nbytes, unsigned flags, void** out) {
  if (out == nullptr) return FailInvalid(fdkv::InvalidArgument("cuda_host_alloc", "out", -1, " is a null pointer"));
  *out = nullptr;
  return Guard([&] { *out = fdkv::HostAlloc(nbytes, flags); });
}

FDKV_API int fdkv_host_free(void* ptr) {
  return Guard([&] { fdkv::HostFree(ptr); });
}

FDKV_API int fdkv_host_reserve(size_t nbytes, void** out) {
  if (out == nullptr) return FailInvalid(fdkv::InvalidArgument("cuda_host_reserve", "out", -1, " is a null pointer"));
  *out = nullptr;
  return Guard([&] { *out = fdkv::HostReserve(nbytes); });
}

FDKV_API int fdkv_host_pin_ranges(void* base, const int64_t* offsets, const int64_t* lengths, int64_t n,
                                  int threads, int device, int64_t* pinned) {
  return Guard([&] {
    const int64_t got = fdkv::HostPinRanges(base, offsets, lengths, n, threads, device);
    if (pinned != nullptr) *pinned = got;
  });
}

FDKV_API int fdkv_host_pin_threads(void) { return fdkv::HostPinThreads(); }

FDKV_API int fdkv_swap_layers(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptrs,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path) {
  return Guard([&] {
    const LayerArgs a = PrepareLayers(op, "swap_all_layers", dev_ptrs, num_dev_blocks, block_bytes, num_tensors,
                                      host_ptrs, stream, sync, path);
    fdkv::SwapLayers(a.name, a.tensors, a.hosts, num_host_blocks, fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                     fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, a.target,
                     fdkv::CapiArgNames("host_ptrs"));
  });
}

FDKV_API int fdkv_swap_layer_groups(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                                    const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptrs,
                                    int64_t num_host_blocks, int64_t group_size, const int64_t* dev_ids,
                                    int64_t num_dev_ids, const int64_t* host_ids, int64_t num_host_ids, int mode,
                                    void* stream, void* const* events, int64_t num_events, void* progress,
                                    int sync, int path) {
  return Guard([&] {
    const LayerArgs a = PrepareLayers(op, "swap_layer_groups", dev_ptrs, num_dev_blocks, block_bytes, num_tensors,
                                      host_ptrs, stream, sync, path);
    fdkv::SwapLayerGroups(a.name, a.tensors, a.hosts, num_host_blocks, group_size,
                          fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                          fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, a.target, events, num_events,
                          static_cast<fdkv::GroupProgress*>(progress), fdkv::CapiArgNames("host_ptrs"));
  });
}

FDKV_API int fdkv_launch_layer_groups(void* launcher, const char* op, void* const* dev_ptrs,
                                      const int64_t* num_dev_blocks, const int64_t* block_bytes, int64_t num_tensors,
                                      void* const* host_ptrs, int64_t num_host_blocks, int64_t group_size,
                                      const int64_t* dev_ids, int64_t num_dev_ids, const int64_t* host_ids,
                                      int64_t num_host_ids, int mode, void* stream, void* const* events,
                                      int64_t num_events, void* progress, void* const* waits, int64_t num_waits,
                                      void* start_event, void* done_event, int path, int64_t inline_groups) {
  return Guard([&] {
    const char* name = (op != nullptr && *op != '\0') ? op : "launch_layer_groups";
    if (num_waits < 0 || (num_waits > 0 && waits == nullptr)) {
      throw fdkv::InvalidArgument(name, "waits", -1, " is a null pointer or num_waits = " + std::to_string(num_waits) +
                                                         " is negative");
    }
    const LayerArgs a = PrepareLayers(op, "launch_layer_groups", dev_ptrs, num_dev_blocks, block_bytes, num_tensors,
                                      host_ptrs, stream, 0, path);
    fdkv::StackFences fences;
    if (num_waits > 0) fences.waits.assign(waits, waits + num_waits);
    fences.start_event = start_event;
    fences.done_event = done_event;
    fdkv::LaunchLayerStack(static_cast<fdkv::StackLauncher*>(launcher), a.name, a.tensors, a.hosts, num_host_blocks,
                           group_size, fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                           fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, a.target, events, num_events,
                           static_cast<fdkv::GroupProgress*>(progress), fences, inline_groups,
                           fdkv::CapiArgNames("host_ptrs"));
  });
}

FDKV_API int fdkv_launcher_create(void** out) {
  if (out == nullptr) return FailInvalid(fdkv::InvalidArgument("launcher_create", "out", -1, " is a null pointer"));
  *out = nullptr;
  return Guard([&] { *out = fdkv::NewStackLauncher(); });
}

FDKV_API int fdkv_launcher_destroy(void* launcher) {
  return Guard([&] { fdkv::DeleteStackLauncher(static_cast<fdkv::StackLauncher*>(launcher)); });
}

FDKV_API int fdkv_launcher_wait_idle(void* launcher, int64_t timeout_us, int* idle) {
  if (launcher == nullptr || idle == nullptr) {
    return FailInvalid(fdkv::InvalidArgument("launcher_wait_idle", launcher == nullptr ? "launcher" : "idle", -1,
                                             " is a null pointer"));
  }
  return Guard([&] { *idle = fdkv::StackLauncherWaitIdle(static_cast<fdkv::StackLauncher*>(launcher), timeout_us); });
}

FDKV_API int fdkv_progress_create(void** out) {
  if (out == nullptr) return FailInvalid(fdkv::InvalidArgument("progress_create", "out", -1, " is a null pointer"));
  *out = nullptr;
  return Guard([&] { *out = new fdkv::GroupProgress(); });
}

FDKV_API int fdkv_progress_destroy(void* progress) {
  return Guard([&] { fdkv::GroupProgress::Unref(static_cast<fdkv::GroupProgress*>(progress)); });
}

FDKV_API int fdkv_progress_wait(void* progress, int64_t at_least, int64_t timeout_us, int64_t* done) {
  if (progress == nullptr) {
    return FailInvalid(fdkv::InvalidArgument("progress_wait", "progress", -1, " is a null pointer"));
  }
  if (done == nullptr) return FailInvalid(fdkv::InvalidArgument("progress_wait", "done", -1, " is a null pointer"));
  return Guard([&] { *done = static_cast<fdkv::GroupProgress*>(progress)->Wait(at_least, timeout_us); });
}

FDKV_API int fdkv_progress_wait_closed(void* progress, int64_t timeout_us, int* closed) {
  if (progress == nullptr || closed == nullptr) {
    return FailInvalid(fdkv::InvalidArgument("progress_wait_closed", progress == nullptr ? "progress" : "closed", -1,
                                             " is a null pointer"));
  }
  return Guard([&] { *closed = static_cast<fdkv::GroupProgress*>(progress)->WaitClosed(timeout_us) ? 1 : 0; });
}

FDKV_API int fdkv_progress_state(void* progress, int64_t* done, int* failed, int* closed, int* paths,
                                 int64_t* failed_group) {
  if (progress == nullptr) {
    return FailInvalid(fdkv::InvalidArgument("progress_state", "progress", -1, " is a null pointer"));
  }
  return Guard([&] {
    const fdkv::GroupProgress::State st = static_cast<fdkv::GroupProgress*>(progress)->Get();
    if (done != nullptr) *done = st.done;
    if (failed != nullptr) *failed = st.failed ? 1 : 0;
    if (closed != nullptr) *closed = st.closed ? 1 : 0;
    if (paths != nullptr) *paths = st.paths;
    if (failed_group != nullptr) *failed_group = st.failed_group;
  });
}

FDKV_API const char* fdkv_progress_error(void* progress) {
  return progress == nullptr ? "" : static_cast<fdkv::GroupProgress*>(progress)->Error();
}

FDKV_API int fdkv_progress_abandon(void* progress, const char* error) {
  if (progress == nullptr) {
    return FailInvalid(fdkv::InvalidArgument("progress_abandon", "progress", -1, " is a null pointer"));
  }
  return Guard([&] {
    auto* p = static_cast<fdkv::GroupProgress*>(progress);
    if (p->Get().closed) return;  // the call ran: its own outcome stands
    p->Fail(-1, error != nullptr ? error : "abandoned before launch");
    p->Close(0);
  });
}

FDKV_API int fdkv_swap_layout(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptr,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path) {
  return Guard([&] {
    const char* name = (op != nullptr && *op != '\0') ? op : "swap_layout";
    CheckArrays(name, num_tensors, dev_ptrs, num_dev_blocks, block_bytes, host_ptr);
    std::vector<fdkv::TensorDesc> tensors = Tensors(dev_ptrs, num_dev_blocks, block_bytes, num_tensors);
    fdkv::ExecTarget target{fdkv::BuiltWithCuda(), stream, sync != 0, path};
    fdkv::SwapLayout(name, tensors, host_ptr[0], num_host_blocks,
                     fdkv::IdSpan{dev_ids, num_dev_ids, "dev_ids"},
                     fdkv::IdSpan{host_ids, num_host_ids, "host_ids"}, mode, target,
                     fdkv::CapiArgNames("host_ptr"));
  });
}

FDKV_API int fdkv_set_option(const char* name, int64_t value) {
  return Guard([&] {
    if (name == nullptr || !fdkv::SetOption(name, value)) {
      throw fdkv::InvalidArgument("set_option", "name", -1,
                                  " = '" + std::string(name ? name : "") + "' is unknown or value " +
                                      std::to_string(value) + " is out of its range");
    }
  });
}

FDKV_API int fdkv_get_option(const char* name, int64_t* value) {
  return Guard([&] {
    if (name == nullptr || value == nullptr || !fdkv::GetOption(name, value)) {
      throw fdkv::InvalidArgument("get_option", "name", -1, " = '" + std::string(name ? name : "") + "' is unknown");
    }
  });
}

FDKV_API int fdkv_read_files(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                             void* headers, int64_t header_bytes, int64_t* got) {
  return Guard([&] { fdkv::ReadFiles(paths, n, dsts, dst_bytes, headers, header_bytes, got); });
}

FDKV_API int fdkv_read_files_hashed(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                                    void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes,
                                    int64_t* got, uint64_t* digests, int32_t* hashed) {
  return Guard([&] {
    fdkv::ReadFilesHashed(paths, n, dsts, dst_bytes, headers, header_bytes, piece_bytes, step_bytes, got, digests,
                          hashed);
  });
}

FDKV_API int fdkv_has_hashed_read(void) { return fdkv::HaveHashedRead() ? 1 : 0; }

FDKV_API int fdkv_read_objects(const char* path_blob, int64_t blob_bytes, int64_t n, void* const* segs,
                               const int64_t* seg_bytes, int64_t segs_per_object, int32_t shared_lengths,
                               void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes,
                               int32_t check_version, int32_t size_first, int64_t* got, uint64_t* digests,
                               int32_t* states) {
  return Guard([&] {
    fdkv::ReadObjects(path_blob, blob_bytes, n, segs, seg_bytes, segs_per_object, shared_lengths, headers,
                      header_bytes, piece_bytes, step_bytes, check_version, size_first, got, digests, states);
  });
}

FDKV_API int fdkv_files_exist(const char* path_blob, int64_t blob_bytes, int64_t n, int64_t* count) {
  return Guard([&] {
    if (count == nullptr) throw fdkv::InvalidArgument("files_exist", "count", -1, " is a null pointer");
    *count = fdkv::FilesExist(path_blob, blob_bytes, n);
  });
}

FDKV_API int fdkv_pointer_location(const void* ptr, int32_t* location) {
  return Guard([&] {
    if (location == nullptr) throw fdkv::InvalidArgument("pointer_location", "location", -1, " is a null pointer");
    *location = fdkv::PointerLocation(ptr);
  });
}

FDKV_API int fdkv_last_path(void) { return fdkv::LastPath(); }

FDKV_API int fdkv_stream_synchronize(void* stream) {
  return Guard([&] { fdkv::StreamSynchronize(stream); });
}

}  // extern "C"
