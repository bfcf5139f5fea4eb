// Framework-neutral core of the KV swap ops: options, validation, run planning, the CPU
// implementation, and dispatch to the CUDA launchers (swap_cuda.cu).  See swap_core.h.
#include "swap_core.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <iterator>
#include <map>
#include <vector>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_set>

#include <sys/mman.h>
#include <unistd.h>

namespace fdkv {

// ------------------------------------------------------------------------ options
namespace {

constexpr int64_t kInt64Max = INT64_MAX;

// Defaults.  NOTE: set from measurements on an H100 (PCIe Gen5): docs/ops.md, "Options"
// and "Measured costs".  Every option is set through SetOption (the C ABI's
// fdkv_set_option, CApi.set_option in Python); the process environment is not read.
struct OptionSpec {
  const char* option;  // set_option / get_option name
  int64_t def;
  int64_t lo;
  int64_t hi;
};
constexpr int kNumOptions = 20;
const OptionSpec kSpecs[kNumOptions] = {
    {"copy_grid", 8, 1, 65535},
    {"copy_path", kCopyAuto, kCopyAuto, kCopyStaged},
    {"dma_min_bytes", 64 << 10, 0, kInt64Max},
    {"merge_min_bytes", 1 << 20, 0, kInt64Max},
    {"copy_kernel", 0, 0, 3},
    {"dma_slice_bytes", 16 << 20, 1, kInt64Max},
    {"kernel_tables", 1, 0, 1},
    // Staged path (swap_staged.cu).
    {"staging_bytes", 256 << 20, 1 << 20, kInt64Max},
    {"staging_chunk_bytes", 64 << 20, 64 << 10, kInt64Max},
    // 64: a load's scatter kernels overlapped a cuBLAS forward pass best at 64 CTAs (16 KiB
    // blocks hid 0.922-0.927 of the load against 0.901-0.916 at 16; docs/ops.md,
    // "Measured costs"), and the copy alone moves the same at 16, 64 or 132.
    {"staging_grid", 64, 1, 65535},
    {"staged_min_bytes", 64 << 10, 0, kInt64Max},
    // 1: the DMAs as one cudaMemcpyAsync each, 0: one cudaMemcpyBatchAsync per chunk (faster).
    // For measurements and the GPU tests; read with GetOption.
    {"staging_mode", 0, 0, 1},
    // DMA rows (swap_cuda.cu, LanesAtOnePitch): the fewest tensors at one pitch that go as
    // one 2D copy per run.  For measurements and tests; read with GetOption.
    {"dma_rows_min_lanes", 16, 1, 1 << 20},
    // Auto keeps device-to-host copies at one pitch on DMA rows only from this row width;
    // narrower rows go staged where the call is large enough (swap_cuda.cu, ExecuteCuda).
    // 256 KiB: 128 KiB rows wrote host memory at 0.927-0.944 of the link where staged moved
    // 0.961-0.985, 256 KiB rows 0.950-0.967 against 0.962-0.964, 512 KiB rows as fast
    // (docs/ops.md, "auto").  Read with GetOption.
    {"rows_d2h_min_bytes", 256 << 10, 0, kInt64Max},
    // A layer stack's groups go in spans of at least this many bytes (one DMA batch or one
    // copy-kernel launch, or one staged chunk boundary, per span; every group's event
    // follows its span): each batch call costs the link ~2.5 us (a layer of 4 MiB per call
    // moved 0.96 of the link, 16 MiB 0.99; docs/ops.md, "Spans").  16 MiB: a load's stack
    // of 4 MiB layers moved ~1% more than in 8 MiB spans (0.970-0.974 against
    // 0.961-0.965), and TTFT at 1k-2k prefixes read the same.  0: a span per group.  Read
    // with GetOption.
    {"stack_span_min_bytes", 16 << 20, 0, kInt64Max},
    // The launcher thread (LaunchLayerStack) enqueues a stack's next group only while the
    // groups it has enqueued and that have not landed yet hold at most this many bytes
    // (swap_core.cc, PaceLaunch, says why).  64 MiB is ~1.2 ms of a PCIe Gen5 link: far more
    // than the ~0.2 ms it takes to enqueue a group.  0: the whole stack at once.
    {"launch_lead_bytes", 64 << 20, 0, kInt64Max},
    // Tests only: a layer stack (SwapLayerGroups, LaunchLayerStack) fails as a CUDA failure
    // would when it reaches this group (-1: never), so the failure path of an asynchronous
    // launch can be exercised.  Read with GetOption.
    {"stack_fail_group", -1, -1, 1 << 20},
    // A load's layer stack that auto stages (swap_cuda.cu, ExecuteCudaGroups) starts its
    // pipeline at this group; the groups before it go one by one through the copy kernel (a
    // forced staged path, or a device-to-host stack, stages them all).  1: the first layer
    // does not wait for the stack's staged plan and pipeline start (~0.2 ms of host time for
    // 48 layers of 512 blocks on an H100 host), which the forward pass would.
    {"staged_stack_from_group", 1, 0, 1 << 20},
    // File reads (file_io.cc, ReadFilesHashed): most threads one batch read is spread over
    // (the calling thread is one of them; 1 reads on the caller alone).  The default is
    // half the online CPUs, 1 to 4, set in InitDefaults: on a 2-core VM shared with another
    // job a second thread made warm 64 KiB reads slower in the median (it waits for a core,
    // and the call for its last object) though cold reads gained from two in flight.
    {"read_threads", 4, 1, 256},
    // Each thread, the caller's included, needs this many payload bytes of the batch:
    // starting one costs ~20-30 us, and on the 2-core VM a 2 MiB batch read no faster on
    // two threads (4 MiB did).  0: split any batch (tests).
    {"read_thread_min_bytes", 2 << 20, 0, kInt64Max},
};

std::atomic<int64_t> g_values[kNumOptions];
std::once_flag g_defaults_once;
thread_local int t_last_path = 0;

const OptionSpec* SpecByOption(const std::string& name) {
  for (const OptionSpec& s : kSpecs) if (name == s.option) return &s;
  return nullptr;
}

void InitDefaults() {
  std::call_once(g_defaults_once, [] {
    for (int i = 0; i < kNumOptions; ++i) g_values[i].store(kSpecs[i].def);
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    const OptionSpec* rt = SpecByOption("read_threads");
    g_values[rt - kSpecs].store(std::max<int64_t>(1, std::min<int64_t>(rt->def, cpus / 2)));
  });
}

int64_t Value(int i) { return g_values[i].load(std::memory_order_relaxed); }

}  // namespace

Options GetOptions() {
  InitDefaults();
  return Options{Value(0), Value(1), Value(2), Value(3), Value(4), Value(5), Value(6),
                 Value(7), Value(8), Value(9), Value(10)};
}

bool SetOption(const std::string& name, int64_t value) {
  InitDefaults();
  const OptionSpec* spec = SpecByOption(name);
  if (spec == nullptr || value < spec->lo || value > spec->hi) return false;
  g_values[spec - kSpecs].store(value);
  return true;
}

bool GetOption(const std::string& name, int64_t* value) {
  InitDefaults();
  const OptionSpec* spec = SpecByOption(name);
  if (spec == nullptr) return false;
  *value = Value(static_cast<int>(spec - kSpecs));
  return true;
}

int LastPath() { return t_last_path; }

bool BuiltWithCuda() { return FDKV_WITH_CUDA != 0; }

// ------------------------------------------------------------------------ validation
namespace {

[[noreturn]] void Fail(const char* op, const std::string& argument, int64_t index, const std::string& detail) {
  throw InvalidArgument(op, argument, index, detail);
}

void CheckRange(const char* op, IdSpan ids, int64_t limit, const char* what) {
  for (int64_t i = 0; i < ids.size; ++i) {
    const int64_t v = ids.data[i];
    if (v < 0 || v >= limit) {
      Fail(op, ids.name, i, " = " + std::to_string(v) + " is out of range [0, " + std::to_string(limit) + ") (" +
                                what + ")");
    }
  }
}

// Destination ids must be unique: two sources written to one block would leave which
// one wins up to scheduling.  A bitset over the id range keeps this O(n).
void CheckUnique(const char* op, IdSpan ids) {
  if (ids.size < 2) return;
  int64_t max_id = *std::max_element(ids.data, ids.data + ids.size);
  constexpr int64_t kBitsetLimit = int64_t(1) << 28;
  auto repeat = [&](int64_t i) {
    const int64_t v = ids.data[i];
    const int64_t j = std::find(ids.data, ids.data + i, v) - ids.data;
    Fail(op, ids.name, i, " = " + std::to_string(v) + " repeats index " + std::to_string(j) +
                              "; destination block ids must be unique");
  };
  if (max_id < kBitsetLimit) {
    thread_local std::vector<uint64_t> seen;
    const size_t words = static_cast<size_t>(max_id / 64 + 1);
    seen.assign(words, 0);
    for (int64_t i = 0; i < ids.size; ++i) {
      const int64_t v = ids.data[i];
      uint64_t& w = seen[static_cast<size_t>(v >> 6)];
      const uint64_t bit = uint64_t(1) << (v & 63);
      if (w & bit) repeat(i);
      w |= bit;
    }
    return;
  }
  std::unordered_set<int64_t> set;
  set.reserve(static_cast<size_t>(ids.size) * 2);
  for (int64_t i = 0; i < ids.size; ++i) {
    if (!set.insert(ids.data[i]).second) repeat(i);
  }
}

}  // namespace

void CheckCopyPath(const char* op, int64_t copy_path) {
  if (copy_path < kCopyProcess || copy_path > kCopyStaged) {
    Fail(op, "path", -1, " = " + std::to_string(copy_path) +
                 " must be -1 (the process-wide copy_path option), 0 (auto), 1 (kernel), 2 (dma) or 3 (staged)");
  }
}

void ValidateIds(const char* op, IdSpan dev_ids, int64_t num_dev_blocks, IdSpan host_ids,
                 int64_t num_host_blocks, int mode) {
  if (mode != kDeviceToHost && mode != kHostToDevice) {
    Fail(op, "mode", -1, " = " + std::to_string(mode) + " must be 0 (device to host) or 1 (host to device)");
  }
  if (dev_ids.size < 0 || host_ids.size < 0) {
    Fail(op, dev_ids.size < 0 ? dev_ids.name : host_ids.name, -1, " has a negative length");
  }
  if (dev_ids.size != host_ids.size) {
    const bool dev_short = dev_ids.size < host_ids.size;
    const IdSpan& longer = dev_short ? host_ids : dev_ids;
    const IdSpan& shorter = dev_short ? dev_ids : host_ids;
    Fail(op, longer.name, shorter.size, " has no partner: " + std::string(longer.name) + " has " +
                 std::to_string(longer.size) + " ids but " + shorter.name + " has " +
                 std::to_string(shorter.size) + " (lengths must be equal)");
  }
  if ((dev_ids.size > 0 && dev_ids.data == nullptr) || (host_ids.size > 0 && host_ids.data == nullptr)) {
    Fail(op, dev_ids.data == nullptr ? dev_ids.name : host_ids.name, -1, " is a null pointer");
  }
  CheckRange(op, dev_ids, num_dev_blocks, "device blocks");
  CheckRange(op, host_ids, num_host_blocks, "host blocks");
  CheckUnique(op, mode == kDeviceToHost ? host_ids : dev_ids);
}

// ------------------------------------------------------------------------ planning
std::vector<Run> PlanRuns(const int64_t* src_ids, const int64_t* dst_ids, int64_t n) {
  std::vector<Run> runs;
  if (n <= 0) return runs;
  runs.push_back(Run{src_ids[0], dst_ids[0], 1});
  for (int64_t i = 1; i < n; ++i) {
    Run& last = runs.back();
    if (src_ids[i] == last.src_id + last.count && dst_ids[i] == last.dst_id + last.count) {
      ++last.count;
    } else {
      runs.push_back(Run{src_ids[i], dst_ids[i], 1});
    }
  }
  return runs;
}

// ------------------------------------------------------------------------ execution
namespace {

bool LanesMergeable(const std::vector<LaneDesc>& lanes) {
  for (const LaneDesc& l : lanes) {
    if (l.src_stride != l.bytes || l.dst_stride != l.bytes) return false;
  }
  return true;
}

void ExecuteCpu(const std::vector<LaneDesc>& lanes, const int64_t* src_ids,
                const int64_t* dst_ids, int64_t n) {
  if (LanesMergeable(lanes)) {
    const std::vector<Run> runs = PlanRuns(src_ids, dst_ids, n);
    for (const LaneDesc& l : lanes) {
      for (const Run& r : runs) {
        std::memcpy(l.dst + r.dst_id * l.dst_stride, l.src + r.src_id * l.src_stride,
                    static_cast<size_t>(r.count * l.bytes));
      }
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (const LaneDesc& l : lanes) {
      std::memcpy(l.dst + dst_ids[i] * l.dst_stride, l.src + src_ids[i] * l.src_stride,
                  static_cast<size_t>(l.bytes));
    }
  }
}

void Execute(const std::vector<LaneDesc>& lanes, IdSpan dev_ids, IdSpan host_ids, int mode,
             const ExecTarget& target) {
  const int64_t n = dev_ids.size;
  const int64_t* src_ids = mode == kDeviceToHost ? dev_ids.data : host_ids.data;
  const int64_t* dst_ids = mode == kDeviceToHost ? host_ids.data : dev_ids.data;
  t_last_path = 0;
  if (n > 0) {
    if (target.cuda) {
#if FDKV_WITH_CUDA
      t_last_path = ExecuteCuda(lanes, src_ids, dst_ids, n, LanesMergeable(lanes), mode, target);
#else
      throw CudaFailure("fdkv: CUDA execution requested but the library was built without CUDA");
#endif
    } else {
      // NOTE: target.copy_path is ignored here: the CPU implementation has one path.
      ExecuteCpu(lanes, src_ids, dst_ids, n);
      t_last_path = kPathCpu;
    }
  }
  if (target.cuda && target.sync) StreamSynchronize(target.stream);
}

void CheckTensors(const char* op, const std::vector<TensorDesc>& tensors, const ArgNames& names) {
  if (tensors.empty()) Fail(op, names.tensors, -1, " is empty; pass at least one cache tensor");
  auto name = [&](const char* specific) { return specific != nullptr ? specific : names.tensors; };
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorDesc& d = tensors[t];
    const int64_t i = names.index_tensors ? static_cast<int64_t>(t) : -1;
    if (d.dev == nullptr) Fail(op, name(names.tensor_ptrs), i, " has a null data pointer");
    if (d.block_bytes <= 0) {
      Fail(op, name(names.tensor_bytes), i, " is a block size of " + std::to_string(d.block_bytes) +
                                                " bytes; prod(shape[1:]) * itemsize must be > 0");
    }
    if (d.num_blocks < 0) Fail(op, name(names.tensor_blocks), i, " is a negative block count");
  }
}

int64_t MinBlocks(const std::vector<TensorDesc>& tensors) {
  int64_t m = tensors.front().num_blocks;
  for (const TensorDesc& d : tensors) m = std::min(m, d.num_blocks);
  return m;
}

// The number of host blocks the ids are checked against.  `host_block_bytes[t]` is the
// size of one host block at host_ptrs[t].  NOTE: the recorded size of a HostAlloc buffer
// is the ground truth when there is one, so a count larger than the buffer is refused
// rather than trusted; memory from elsewhere (numpy, CuPy pinned) has only the count.
int64_t HostBlockLimit(const char* op, const std::vector<void*>& host_ptrs,
                       const std::vector<int64_t>& host_block_bytes, int64_t num_host_blocks,
                       const ArgNames& names) {
  const bool indexed_ptrs = names.index_host_ptr;
  if (num_host_blocks < -1) {
    Fail(op, names.host_count, -1, " = " + std::to_string(num_host_blocks) +
                                  " must be >= 0, or -1 for the size cuda_host_alloc recorded");
  }
  int64_t limit = num_host_blocks;
  for (size_t t = 0; t < host_ptrs.size(); ++t) {
    const int64_t i = indexed_ptrs ? static_cast<int64_t>(t) : -1;
    const int64_t avail = HostBytesFrom(host_ptrs[t]);
    if (avail < 0) {
      if (num_host_blocks == -1) {
        Fail(op, names.host_ptr, i, " is not memory from cuda_host_alloc, so its size is unknown; pass " +
                                        std::string(names.host_count) + " (the buffer's block count)");
      }
      continue;
    }
    const int64_t fits = avail / host_block_bytes[t];
    if (num_host_blocks == -1) {
      limit = limit < 0 ? fits : std::min(limit, fits);
    } else if (num_host_blocks > fits) {
      Fail(op, names.host_count, -1, " = " + std::to_string(num_host_blocks) + " blocks of " +
                                         std::to_string(host_block_bytes[t]) + " bytes do not fit in " +
                                         names.host_ptr + (indexed_ptrs ? "[" + std::to_string(t) + "]" : "") +
                                    " (" + std::to_string(avail) + " bytes from cuda_host_alloc: " +
                                    std::to_string(fits) + " blocks)");
    }
  }
  return limit;
}

}  // namespace

ArgNames PaddleArgNames(const char* tensors, const char* host_ptr) {
  ArgNames n;
  n.tensors = tensors;
  n.index_tensors = std::string(tensors) != "cache_gpu";
  n.host_ptr = host_ptr;
  n.index_host_ptr = std::string(host_ptr) != "cache_cpu_ptr";
  n.host_count = "max_block_num_cpu";
  return n;
}

ArgNames CapiArgNames(const char* host_ptr) {
  ArgNames n;
  n.tensors = "dev_ptrs";
  n.tensor_ptrs = "dev_ptrs";
  n.tensor_blocks = "num_dev_blocks";
  n.tensor_bytes = "block_bytes";
  n.host_ptr = host_ptr;
  n.index_host_ptr = std::string(host_ptr) != "host_ptr";
  n.host_count = "num_host_blocks";
  return n;
}

namespace {

// Checks a per-tensor swap's arguments (everything SwapLayers and SwapLayerGroups take in
// common) and returns its lanes.  Throws before any byte moves.
std::vector<LaneDesc> LayerLanes(const char* op, const std::vector<TensorDesc>& tensors,
                                 const std::vector<void*>& host_ptrs, int64_t num_host_blocks, IdSpan dev_ids,
                                 IdSpan host_ids, int mode, const ExecTarget& target, const ArgNames& names) {
  CheckTensors(op, tensors, names);
  if (host_ptrs.size() != tensors.size()) {
    Fail(op, names.host_ptr, -1, " has " + std::to_string(host_ptrs.size()) + " pointers but there are " +
                                     std::to_string(tensors.size()) + " cache tensors");
  }
  for (size_t t = 0; t < host_ptrs.size(); ++t) {
    if (host_ptrs[t] == nullptr) {
      Fail(op, names.host_ptr, names.index_host_ptr ? static_cast<int64_t>(t) : -1, " is a null pointer");
    }
  }
  CheckCopyPath(op, target.copy_path);
  std::vector<int64_t> host_bb(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) host_bb[t] = tensors[t].block_bytes;
  const int64_t host_limit = HostBlockLimit(op, host_ptrs, host_bb, num_host_blocks, names);
  ValidateIds(op, dev_ids, MinBlocks(tensors), host_ids, host_limit, mode);

  std::vector<LaneDesc> lanes;
  lanes.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    char* dev = static_cast<char*>(tensors[t].dev);
    char* host = static_cast<char*>(host_ptrs[t]);
    const int64_t bb = tensors[t].block_bytes;
    if (mode == kDeviceToHost) lanes.push_back(LaneDesc{dev, host, bb, bb, bb});
    else lanes.push_back(LaneDesc{host, dev, bb, bb, bb});
  }
  return lanes;
}

}  // namespace

void SwapLayers(const char* op, const std::vector<TensorDesc>& tensors,
                const std::vector<void*>& host_ptrs, int64_t num_host_blocks, IdSpan dev_ids,
                IdSpan host_ids, int mode, const ExecTarget& target, const ArgNames& names) {
  const std::vector<LaneDesc> lanes =
      LayerLanes(op, tensors, host_ptrs, num_host_blocks, dev_ids, host_ids, mode, target, names);
  Execute(lanes, dev_ids, host_ids, mode, target);
}

namespace {

// Checks a layer stack's arguments (all of SwapLayerGroups') and copies them into a job.
// Throws InvalidArgument before anything is enqueued.
std::unique_ptr<StackJob> PrepareStackJob(const char* op, const std::vector<TensorDesc>& tensors,
                                          const std::vector<void*>& host_ptrs, int64_t num_host_blocks,
                                          int64_t group_size, IdSpan dev_ids, IdSpan host_ids, int mode,
                                          const ExecTarget& target, void* const* events, int64_t num_events,
                                          const StackFences& fences, const ArgNames& names) {
  if (group_size <= 0) Fail(op, "group_size", -1, " = " + std::to_string(group_size) + " must be > 0");
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  if (num_tensors % group_size != 0) {
    Fail(op, "group_size", -1, " = " + std::to_string(group_size) + " does not divide the " +
                                   std::to_string(num_tensors) + " cache tensors into whole groups");
  }
  const int64_t num_groups = num_tensors / group_size;
  if (events != nullptr) {
    if (num_events != num_groups) {
      Fail(op, "events", -1, " has " + std::to_string(num_events) + " entries but there are " +
                                 std::to_string(num_groups) + " groups (one event per group)");
    }
    for (int64_t g = 0; g < num_events; ++g) {
      if (events[g] != nullptr && !target.cuda) {
        Fail(op, "events", g, " is an event, but this call runs on the CPU (a library built without CUDA): "
                              "pass no events");
      }
    }
  } else if (num_events != 0) {
    Fail(op, "events", -1, " is a null pointer but num_events = " + std::to_string(num_events));
  }
  if (!target.cuda) {
    for (size_t w = 0; w < fences.waits.size(); ++w) {
      if (fences.waits[w] != nullptr) {
        Fail(op, "waits", static_cast<int64_t>(w), " is an event, but this call runs on the CPU: pass no events");
      }
    }
    if (fences.start_event != nullptr || fences.done_event != nullptr) {
      Fail(op, fences.start_event != nullptr ? "start_event" : "done_event", -1,
           " is an event, but this call runs on the CPU: pass no events");
    }
  }
  auto job = std::make_unique<StackJob>();
  job->lanes = LayerLanes(op, tensors, host_ptrs, num_host_blocks, dev_ids, host_ids, mode, target, names);
  job->op = op;
  const IdSpan& src = mode == kDeviceToHost ? dev_ids : host_ids;
  const IdSpan& dst = mode == kDeviceToHost ? host_ids : dev_ids;
  job->src_ids.assign(src.data, src.data + src.size);
  job->dst_ids.assign(dst.data, dst.data + dst.size);
  job->mode = mode;
  job->target = target;
  job->target.sync = false;
  job->group_size = group_size;
  if (events != nullptr) job->events.assign(events, events + num_events);
  job->fences = fences;
#if FDKV_WITH_CUDA
  if (target.cuda) {
    job->device = CudaCurrentDevice();
    job->may_stage = StackMayStage(job->lanes, job->src_ids.data(), job->dst_ids.data(),
                                   static_cast<int64_t>(job->src_ids.size()), target.copy_path);
    GetOption("staged_stack_from_group", &job->staged_from);
    // A forced staged path stages every group; the kernel-first split is auto's choice, and
    // a load's: nothing waits for the first group of a device-to-host stack.
    const int64_t path = ResolveCopyPath(target.copy_path, GetOptions());
    if (path == kCopyStaged || mode != kHostToDevice) job->staged_from = 0;
  }
#endif
  return job;
}

// PrepareStackJob with its progress: a refused stack fails and closes `progress` (no waiter
// may wait for groups that never come); an accepted one holds a reference to it.
std::unique_ptr<StackJob> PrepareReportingJob(const char* op, const std::vector<TensorDesc>& tensors,
                                              const std::vector<void*>& host_ptrs, int64_t num_host_blocks,
                                              int64_t group_size, IdSpan dev_ids, IdSpan host_ids, int mode,
                                              const ExecTarget& target, void* const* events, int64_t num_events,
                                              const StackFences& fences, GroupProgress* progress,
                                              const ArgNames& names) {
  std::unique_ptr<StackJob> job;
  try {
    job = PrepareStackJob(op, tensors, host_ptrs, num_host_blocks, group_size, dev_ids, host_ids, mode, target,
                          events, num_events, fences, names);
  } catch (const std::exception& e) {
    if (progress != nullptr) {
      progress->Fail(-1, e.what());
      progress->Close(0);
    }
    throw;
  }
  if (progress != nullptr) progress->Ref();
  job->progress = progress;
  return job;
}

}  // namespace

#if FDKV_WITH_CUDA
namespace {

// Holds the launcher until the groups enqueued ahead of group `g` and not yet landed carry at
// most `lead_bytes` (option launch_lead_bytes).  Every copy call takes the CUDA driver's
// context lock that the forward pass's kernel launches need too: a stack enqueued all at
// once (thousands of copies for an 8k-token prefix) slowed the first layers' launches about
// fivefold, so their compute ended milliseconds after their loads had landed.  Paced, the
// launcher stays just far enough ahead to keep the copy engines busy.  Polls the groups'
// events (a spin-free wait: cudaEventSynchronize on a default event spins a core).
void PaceLaunch(StackJob& job, int64_t g, int64_t lead_bytes) {
  for (;;) {
    int64_t ahead = 0;
    for (int64_t k = job.landed; k < g; ++k) ahead += job.GroupBytes(k);
    if (ahead <= lead_bytes) return;
    void* ev = job.events.empty() ? nullptr : job.events[static_cast<size_t>(job.landed)];
    if (ev == nullptr) return;  // no event to read progress from: no pacing
    if (CudaEventDone(ev)) {
      ++job.landed;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace
#endif

bool RunStackJob(StackJob& job, int64_t max_groups, bool rethrow, bool pace) {
  const int64_t num_groups = static_cast<int64_t>(job.lanes.size()) / job.group_size;
  const int64_t n = static_cast<int64_t>(job.src_ids.size());
  void* stream = job.target.stream;
  // Group g's copies are enqueued on `s`: its event, then the progress.
  auto group_done = [&](int64_t g, void* s) {
#if FDKV_WITH_CUDA
    if (!job.events.empty() && job.events[static_cast<size_t>(g)] != nullptr) {
      CudaEventRecord(job.events[static_cast<size_t>(g)], s);
    }
#else
    (void)s;
#endif
    if (job.progress != nullptr) job.progress->Advance(g + 1);
  };
  try {
#if FDKV_WITH_CUDA
    if (job.target.cuda && job.device >= 0) {
      // NOTE: the launcher thread runs on the device the stack was launched from (a new
      // thread starts on device 0), and sets it once even where cudaGetDevice reports it
      // already: cudaSetDevice binds the device's primary context to the thread.
      thread_local int bound_device = -1;
      if (bound_device != job.device || CudaCurrentDevice() != job.device) {
        CudaSetDevice(job.device);
        bound_device = job.device;
      }
    }
    if (!job.started) {
      for (void* w : job.fences.waits) {
        if (w != nullptr) CudaStreamWaitEvent(stream, w);
      }
      if (job.fences.start_event != nullptr) CudaEventRecord(job.fences.start_event, stream);
      job.started = true;
    }
#else
    job.started = true;
#endif
    int64_t fail_group = -1;
    GetOption("stack_fail_group", &fail_group);
    if (fail_group >= 0) job.may_stage = false;  // an injected failure goes group by group
    int64_t span_min_bytes = 0;
    GetOption("stack_span_min_bytes", &span_min_bytes);
    int64_t lead_bytes = 0;
    if (pace) GetOption("launch_lead_bytes", &lead_bytes);
    ExecTarget each = job.target;
    const IdSpan dev_span{job.mode == kDeviceToHost ? job.src_ids.data() : job.dst_ids.data(), n, "dev_ids"};
    const IdSpan host_span{job.mode == kDeviceToHost ? job.dst_ids.data() : job.src_ids.data(), n, "host_ids"};
    // Whether this part's last Execute ended with a copy kernel (ExecTarget::after_own_kernel).
    // Per part: between parts the stream may take other work.
    bool last_was_kernel = false;
    for (int64_t budget = max_groups; job.next_group < num_groups;) {
      const int64_t g = job.next_group;
#if FDKV_WITH_CUDA
      if (job.may_stage && g >= job.staged_from) {
        // The remaining groups as one staged pipeline (or group by group if the rest of
        // auto's rule says so), in one part: only a part that may finish the stack runs it.
        if (budget < num_groups - g) return false;
        job.may_stage = false;
        const std::vector<LaneDesc> rest(job.lanes.begin() + g * job.group_size, job.lanes.end());
        const int paths = ExecuteCudaGroups(rest, job.src_ids.data(), job.dst_ids.data(), n, job.mode, stream,
                                            job.target.copy_path, job.group_size, g == 0,
                                            [&](int64_t r, void* s) { group_done(g + r, s); });
        if (paths != 0) {
          job.paths |= paths;
          job.next_group = num_groups;
          break;
        }
      }
#endif
      if (budget <= 0) break;
      if (g == fail_group) throw CudaFailure("injected failure (option stack_fail_group)");
      // The span [g, end): one group, or, once a group on the call's own path went as a
      // plain DMA batch or one copy-kernel launch, the groups after it until the span holds
      // stack_span_min_bytes (within the budget, short of an injected failure), as one
      // batch or one launch (option stack_span_min_bytes says why).  Every group's event
      // follows its span.
      int64_t limit = std::min(num_groups, g + budget);
      if (fail_group > g) limit = std::min(limit, fail_group);
      const int64_t end = job.span_path == kCopyProcess
                              ? g + 1
                              : SpanEnd(g, limit, span_min_bytes, [&job](int64_t k) { return job.GroupBytes(k); });
      const std::vector<LaneDesc> span(job.lanes.begin() + g * job.group_size,
                                       job.lanes.begin() + end * job.group_size);
      each.ramp = g == 0;
#if FDKV_WITH_CUDA
      if (lead_bytes > 0 && job.target.cuda) PaceLaunch(job, g, lead_bytes);
#endif
      // Groups ahead of a staged rest take the copy kernel: one launch, where the per-call
      // rule would build a staged plan (or a DMA batch of a copy per block) for them; the
      // SMs are free then, since the forward pass waits for the first layer.  (A rest that
      // did not stage after all goes on the call's own path.)  A span of several groups
      // takes the path the deciding group took, never 2D rows.
      const bool ahead_of_staged_rest = job.may_stage;
      each.copy_path = ahead_of_staged_rest ? static_cast<int>(kCopyKernel)
                                            : (end - g > 1 ? job.span_path : job.target.copy_path);
      each.rows = end - g == 1;
      each.after_own_kernel = last_was_kernel;
      Execute(span, dev_span, host_span, job.mode, each);
      last_was_kernel = (t_last_path & kPathKernel) != 0;
      job.paths |= t_last_path;
      // The first group on the call's own path decides: spans where it went as a plain DMA
      // batch or one kernel launch (not rows, staged, or memcpys per run).
      if (!job.span_decided && !ahead_of_staged_rest) {
        job.span_decided = true;
        if (span_min_bytes > 0 && t_last_path == kPathDma) job.span_path = kCopyDma;
        if (span_min_bytes > 0 && t_last_path == kPathKernel) job.span_path = kCopyKernel;
      }
      for (int64_t k = g; k < end; ++k) group_done(k, stream);
      job.next_group = end;
      budget -= end - g;
    }
    if (job.next_group < num_groups) return false;
#if FDKV_WITH_CUDA
    if (job.fences.done_event != nullptr) CudaEventRecord(job.fences.done_event, stream);
#endif
    if (job.progress != nullptr) job.progress->Close(job.paths);
    return true;
  } catch (const std::exception& e) {
    const std::string what = job.op + ": group " + std::to_string(job.next_group) + " of " +
                             std::to_string(num_groups) + ": " + e.what();
#if FDKV_WITH_CUDA
    // Groups before next_group are enqueued and their events recorded; the rest are not.
    // The done event is still recorded (if the stream takes it), so a fence on it is valid.
    if (job.started && job.fences.done_event != nullptr) {
      try {
        CudaEventRecord(job.fences.done_event, stream);
      } catch (const std::exception&) {
      }
    }
#endif
    if (job.progress != nullptr) {
      job.progress->Fail(job.next_group, what);
      job.progress->Close(job.paths);
    }
    if (rethrow) {
      if (dynamic_cast<const CudaFailure*>(&e) != nullptr) throw CudaFailure(what);
      throw;
    }
    return true;
  }
}

void SwapLayerGroups(const char* op, const std::vector<TensorDesc>& tensors,
                     const std::vector<void*>& host_ptrs, int64_t num_host_blocks, int64_t group_size,
                     IdSpan dev_ids, IdSpan host_ids, int mode, const ExecTarget& target,
                     void* const* events, int64_t num_events, GroupProgress* progress,
                     const ArgNames& names) {
  std::unique_ptr<StackJob> job =
      PrepareReportingJob(op, tensors, host_ptrs, num_host_blocks, group_size, dev_ids, host_ids, mode, target,
                          events, num_events, StackFences{}, progress, names);
  try {
    RunStackJob(*job, INT64_MAX, true);
  } catch (...) {
    t_last_path = job->paths;  // the groups enqueued before the failure
    throw;
  }
  t_last_path = job->paths;
  if (target.cuda && target.sync) StreamSynchronize(target.stream);
}

void LaunchLayerStack(StackLauncher* launcher, const char* op, const std::vector<TensorDesc>& tensors,
                      const std::vector<void*>& host_ptrs, int64_t num_host_blocks, int64_t group_size,
                      IdSpan dev_ids, IdSpan host_ids, int mode, const ExecTarget& target, void* const* events,
                      int64_t num_events, GroupProgress* progress, const StackFences& fences,
                      int64_t inline_groups, const ArgNames& names) {
  if (progress == nullptr) Fail(op, "progress", -1, " is a null pointer; a launched stack reports through it");
  std::unique_ptr<StackJob> job = PrepareReportingJob(op, tensors, host_ptrs, num_host_blocks, group_size, dev_ids,
                                                      host_ids, mode, target, events, num_events, fences, progress,
                                                      names);
  if (launcher == nullptr) {
    RunStackJob(*job, INT64_MAX, false);
    return;
  }
  LauncherEnqueue(launcher, std::move(job), inline_groups);
}

void SwapLayout(const char* op, const std::vector<TensorDesc>& tensors, void* host_ptr,
                int64_t num_host_blocks, IdSpan dev_ids, IdSpan host_ids, int mode,
                const ExecTarget& target, const ArgNames& names) {
  CheckTensors(op, tensors, names);
  if (host_ptr == nullptr) Fail(op, names.host_ptr, -1, " is a null pointer");
  CheckCopyPath(op, target.copy_path);
  int64_t host_block_bytes = 0;
  for (const TensorDesc& d : tensors) host_block_bytes += d.block_bytes;
  const int64_t host_limit = HostBlockLimit(op, {host_ptr}, {host_block_bytes}, num_host_blocks, names);
  ValidateIds(op, dev_ids, MinBlocks(tensors), host_ids, host_limit, mode);

  std::vector<LaneDesc> lanes;
  lanes.reserve(tensors.size());
  int64_t offset = 0;
  for (const TensorDesc& d : tensors) {
    char* dev = static_cast<char*>(d.dev);
    char* host = static_cast<char*>(host_ptr) + offset;
    if (mode == kDeviceToHost) lanes.push_back(LaneDesc{dev, host, d.block_bytes, host_block_bytes, d.block_bytes});
    else lanes.push_back(LaneDesc{host, dev, host_block_bytes, d.block_bytes, d.block_bytes});
    offset += d.block_bytes;
  }
  Execute(lanes, dev_ids, host_ids, mode, target);
}

// ------------------------------------------------------------------------ memory
namespace {

constexpr size_t kPage = 4096;

// One live HostAlloc / HostReserve allocation.
struct HostRegion {
  size_t nbytes = 0;   // the size the caller asked for (HostBytesFrom bounds ids by it)
  size_t mapped = 0;   // bytes of the anonymous mapping (whole pages); 0: cudaHostAlloc memory
  // Page ranges [begin, end) already made resident (and, with CUDA, registered): each is
  // one cudaHostRegister, undone by HostFree.  Disjoint; a page is touched only once.
  std::map<uintptr_t, uintptr_t> pinned;
};

// Live allocations by base address (ordered, so the allocation holding an interior
// pointer is one upper_bound away).
std::mutex g_host_mu;
std::map<uintptr_t, HostRegion>& HostRegistry() {
  // NOTE: leaked on purpose: pinned buffers may be freed from static destructors of
  // other libraries after this one's statics are gone.
  static auto* registry = new std::map<uintptr_t, HostRegion>();
  return *registry;
}

size_t PageCeil(size_t n) { return (n + kPage - 1) / kPage * kPage; }

void CheckHostSize(const char* op, size_t nbytes) {
  // NOTE: a size_t argument cannot be negative, but a negative Python int or int64 wraps
  // to a huge one: anything above INT64_MAX is a caller's mistake, not a request.
  if (nbytes == 0 || nbytes > static_cast<size_t>(INT64_MAX) - kPage) {
    throw InvalidArgument(op, "nbytes", -1,
                          " = " + std::to_string(nbytes) + " must be > 0 and <= " +
                              std::to_string(static_cast<size_t>(INT64_MAX) - kPage));
  }
}

// Address space for nbytes of zero pages, none resident yet (so reserving is instant).
void* MapAnonymous(size_t nbytes) {
  void* p = mmap(nullptr, PageCeil(nbytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14; older kernels answer EINVAL (then we touch)
#endif

// Make the pages of [begin, end) resident, split over `threads` threads.  Each thread asks
// the kernel to fault its share in (MADV_POPULATE_WRITE: no user-space fault per page), or
// writes one zero byte per page where the kernel cannot.  NOTE: the pages are fresh zero
// pages no block lives in yet (the caller's bookkeeping guarantees it), so the zero write
// changes nothing.  Why threads: one thread faults ~1.5-3 GiB/s (the kernel zeroes each
// page); page faults of disjoint ranges run in parallel.
void TouchPages(uintptr_t begin, uintptr_t end, int threads) {
  if (end <= begin) return;
  if (threads <= 0) threads = HostPinThreads();
  const size_t pages = (end - begin) / kPage;
  const size_t n = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), pages));
  auto work = [](uintptr_t b, uintptr_t e) {
    if (e <= b) return;
    if (madvise(reinterpret_cast<void*>(b), e - b, MADV_POPULATE_WRITE) == 0) return;
    for (uintptr_t a = b; a < e; a += kPage) *reinterpret_cast<volatile char*>(a) = 0;
  };
  if (n == 1) {
    work(begin, end);
    return;
  }
  const size_t per = (pages + n - 1) / n * kPage;
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (size_t t = 1; t < n; ++t) {
    const uintptr_t b = begin + t * per;
    pool.emplace_back(work, std::min(b, end), std::min(b + per, end));
  }
  work(begin, std::min(begin + per, end));
  for (auto& th : pool) th.join();
}

// Page ranges of [begin, end) (rounded out to pages) that `pinned` does not cover yet.
void AddUncovered(const std::map<uintptr_t, uintptr_t>& pinned, uintptr_t begin, uintptr_t end,
                  std::vector<std::pair<uintptr_t, uintptr_t>>* out) {
  begin = begin / kPage * kPage;
  end = PageCeil(end);
  auto it = pinned.upper_bound(begin);
  if (it != pinned.begin()) {
    auto prev = std::prev(it);
    if (prev->second > begin) begin = prev->second;
  }
  while (begin < end) {
    if (it != pinned.end() && it->first < end) {
      if (it->first > begin) out->emplace_back(begin, it->first);
      begin = std::max(begin, it->second);
      ++it;
    } else {
      out->emplace_back(begin, end);
      break;
    }
  }
}

#if FDKV_WITH_CUDA
// cudaHostAlloc's flags as cudaHostRegister's: portable and mapped as cudaHostAlloc's memory
// is with unified addressing (the copy kernel reads host blocks through their host address).
unsigned RegisterFlags(unsigned alloc_flags) {
  (void)alloc_flags;
  return cudaHostRegisterPortable | cudaHostRegisterMapped;
}
constexpr unsigned kWriteCombined = 4;  // cudaHostAllocWriteCombined: no register twin
#endif

}  // namespace

int HostPinThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::max(1u, std::min(hw == 0 ? 1u : hw, 16u)));
}

int64_t HostBytesFrom(const void* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_host_mu);
  const auto& reg = HostRegistry();
  auto it = reg.upper_bound(addr);
  if (it == reg.begin()) return -1;
  --it;
  if (addr - it->first >= it->second.nbytes) return -1;
  return static_cast<int64_t>(it->second.nbytes - (addr - it->first));
}

void* HostReserve(size_t nbytes) {
  CheckHostSize("cuda_host_reserve", nbytes);
  void* p = MapAnonymous(nbytes);
  HostRegion region;
  region.nbytes = nbytes;
  region.mapped = PageCeil(nbytes);
  std::lock_guard<std::mutex> lock(g_host_mu);
  HostRegistry()[reinterpret_cast<uintptr_t>(p)] = std::move(region);
  return p;
}

int64_t HostPinRanges(void* base, const int64_t* offsets, const int64_t* lengths, int64_t n, int threads,
                      int device) {
  const char* op = "cuda_host_pin";
  if (n < 0) throw InvalidArgument(op, "n", -1, " = " + std::to_string(n) + " must be >= 0");
  if (n > 0 && (offsets == nullptr || lengths == nullptr)) throw InvalidArgument(op, "offsets", -1, " is a null pointer");
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  std::vector<std::pair<uintptr_t, uintptr_t>> todo;
  {
    std::lock_guard<std::mutex> lock(g_host_mu);
    auto& reg = HostRegistry();
    auto it = reg.find(b);
    if (it == reg.end() || it->second.mapped == 0) {
      throw InvalidArgument(op, "base", -1,
                            " = " + std::to_string(b) + " is not a live allocation of cuda_host_reserve / cuda_host_alloc");
    }
    const HostRegion& region = it->second;
    std::vector<std::pair<uintptr_t, uintptr_t>> want;
    for (int64_t i = 0; i < n; ++i) {
      if (offsets[i] < 0 || lengths[i] < 0 || static_cast<uint64_t>(offsets[i]) > region.nbytes ||
          static_cast<uint64_t>(lengths[i]) > region.nbytes - static_cast<uint64_t>(offsets[i])) {
        throw InvalidArgument(op, "offsets", i,
                              ": [" + std::to_string(offsets[i]) + ", +" + std::to_string(lengths[i]) +
                                  ") is not inside the allocation's " + std::to_string(region.nbytes) + " bytes");
      }
      if (lengths[i] > 0) want.emplace_back(b + offsets[i], b + offsets[i] + lengths[i]);
    }
    std::sort(want.begin(), want.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (const auto& r : want) {  // page-rounded and merged, so no page is listed twice
      const uintptr_t lo = r.first / kPage * kPage, hi = PageCeil(r.second);
      if (!merged.empty() && lo <= merged.back().second) merged.back().second = std::max(merged.back().second, hi);
      else merged.emplace_back(lo, hi);
    }
    for (const auto& r : merged) AddUncovered(region.pinned, r.first, r.second, &todo);
  }
  // NOTE: touching and registering run without the registry lock (seconds per GiB at
  // worst): a HostFree of this allocation meanwhile is the caller's bug, as any free of
  // memory still in use.
  int64_t done = 0;
#if FDKV_WITH_CUDA
  if (device >= 0 && !todo.empty()) CudaSetDevice(device);
#else
  (void)device;
#endif
  for (const auto& r : todo) {
    TouchPages(r.first, r.second, threads);
#if FDKV_WITH_CUDA
    CudaHostRegister(reinterpret_cast<void*>(r.first), r.second - r.first, RegisterFlags(0));
#endif
    std::lock_guard<std::mutex> lock(g_host_mu);
    auto it = HostRegistry().find(b);
    if (it != HostRegistry().end()) it->second.pinned[r.first] = r.second;
    done += static_cast<int64_t>(r.second - r.first);
  }
  return done;
}

void* HostAlloc(size_t nbytes, unsigned flags, int threads) {
  CheckHostSize("cuda_host_alloc", nbytes);
#if FDKV_WITH_CUDA
  if (flags & kWriteCombined) {
    void* p = nullptr;
    CudaHostAlloc(&p, nbytes, flags);
    HostRegion region;
    region.nbytes = nbytes;
    std::lock_guard<std::mutex> lock(g_host_mu);
    HostRegistry()[reinterpret_cast<uintptr_t>(p)] = std::move(region);
    return p;
  }
#else
  (void)flags;
#endif
  // NOTE: not cudaHostAlloc: it faults and pins page by page on one thread (8 GiB in 5.7 s
  // on an H200 host).  Mapping anonymous pages, faulting them in from several threads and
  // registering the resident range once is the same pinned, mapped memory for a fraction
  // of that (the register itself: 0.31 s per 8 GiB there).  Without CUDA the pages are
  // made resident all the same: malloc'd pages fault on first touch, and on the CI VM a
  // first write of 8 MiB into fresh host blocks cost a storage prefetch ~6 ms of page
  // faults (against 1.5 ms for the copy).  Anonymous pages read as zero either way.
  void* p = HostReserve(nbytes);
  try {
    const int64_t off = 0, len = static_cast<int64_t>(nbytes);
    HostPinRanges(p, &off, &len, 1, threads, -1);
  } catch (...) {
    HostFree(p);
    throw;
  }
  return p;
}

void* HostAlloc(size_t nbytes, unsigned flags) { return HostAlloc(nbytes, flags, 0); }

namespace {

// Drop ``ptr`` from the registry; returns what HostAlloc / HostReserve recorded for it.
HostRegion UnregisterHost(void* ptr) {
  std::lock_guard<std::mutex> lock(g_host_mu);
  auto& reg = HostRegistry();
  auto it = reg.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == reg.end()) {
    throw InvalidArgument("cuda_host_free", "ptr", -1,
                          " = " + std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                              " is not a live allocation of this library's cuda_host_alloc (freed twice?)");
  }
  HostRegion region = std::move(it->second);
  reg.erase(it);
  return region;
}

}  // namespace

void HostFree(void* ptr) {
  if (ptr == nullptr) return;
  const HostRegion region = UnregisterHost(ptr);
#if FDKV_WITH_CUDA
  if (region.mapped == 0) {
    CudaHostFree(ptr);
    return;
  }
  // Every range is unregistered and the mapping goes even if one unregister fails (the
  // pages are unreachable either way); the first failure is reported after.
  std::exception_ptr first;
  for (const auto& r : region.pinned) {
    try {
      CudaHostUnregister(reinterpret_cast<void*>(r.first));
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  munmap(ptr, region.mapped);
  if (first) std::rethrow_exception(first);
#else
  munmap(ptr, region.mapped);
#endif
}

void StreamSynchronize(void* stream) {
#if FDKV_WITH_CUDA
  CudaStreamSynchronize(stream);
#else
  (void)stream;
#endif
}

int PointerLocation(const void* p) {
#if FDKV_WITH_CUDA
  return CudaPointerLocation(p);
#else
  (void)p;
  return kPointerHost;
#endif
}

}  // namespace fdkv
