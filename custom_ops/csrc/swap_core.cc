// Framework-neutral core of the KV swap ops: options, validation, run planning, the CPU
// implementation, and dispatch to the CUDA launchers (swap_cuda.cu).  See swap_core.h.
#include "swap_core.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace fdkv {

// ------------------------------------------------------------------------ options
namespace {

std::atomic<int64_t> g_copy_grid{-1};
std::atomic<int64_t> g_copy_path{-1};
std::atomic<int64_t> g_dma_min_bytes{-1};
std::atomic<int64_t> g_merge_min_bytes{-1};
std::atomic<int64_t> g_copy_kernel{-1};
std::atomic<int64_t> g_dma_slice_bytes{-1};
std::atomic<int64_t> g_kernel_tables{-1};
std::once_flag g_env_once;
thread_local int t_last_path = 0;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  char* end = nullptr;
  long long v = std::strtoll(raw, &end, 10);
  return (end != nullptr && *end == '\0') ? static_cast<int64_t>(v) : fallback;
}

int64_t ParseCopyPath(const char* raw) {
  if (raw == nullptr) return kCopyAuto;
  std::string s(raw);
  if (s == "kernel") return kCopyKernel;
  if (s == "dma") return kCopyDma;
  return kCopyAuto;
}

// Defaults.  NOTE: dma_min_bytes and merge_min_bytes were set from the measurements in
// docs/benchmarks.md (H100 PCIe Gen5); FDKV_* environment variables override them.
constexpr int64_t kDefaultGrid = 8;
constexpr int64_t kDefaultDmaMinBytes = 64 << 10;
constexpr int64_t kDefaultMergeMinBytes = 1 << 20;
constexpr int64_t kDefaultCopyKernel = 0;
constexpr int64_t kDefaultDmaSliceBytes = 16 << 20;
constexpr int64_t kDefaultKernelTables = 1;

void InitFromEnv() {
  std::call_once(g_env_once, [] {
    int64_t grid = EnvInt("FDKV_COPY_GRID", kDefaultGrid);
    g_copy_grid.store(grid > 0 ? grid : kDefaultGrid);
    g_copy_path.store(ParseCopyPath(std::getenv("FDKV_COPY_PATH")));
    int64_t dma = EnvInt("FDKV_DMA_MIN_BYTES", kDefaultDmaMinBytes);
    g_dma_min_bytes.store(dma >= 0 ? dma : kDefaultDmaMinBytes);
    int64_t merge = EnvInt("FDKV_MERGE_MIN_BYTES", kDefaultMergeMinBytes);
    g_merge_min_bytes.store(merge >= 0 ? merge : kDefaultMergeMinBytes);
    int64_t kernel = EnvInt("FDKV_COPY_KERNEL", kDefaultCopyKernel);
    g_copy_kernel.store(kernel >= 0 && kernel <= 3 ? kernel : kDefaultCopyKernel);
    int64_t slice = EnvInt("FDKV_DMA_SLICE_BYTES", kDefaultDmaSliceBytes);
    g_dma_slice_bytes.store(slice >= 1 ? slice : kDefaultDmaSliceBytes);
    int64_t tables = EnvInt("FDKV_KERNEL_TABLES", kDefaultKernelTables);
    g_kernel_tables.store(tables == 0 || tables == 1 ? tables : kDefaultKernelTables);
  });
}

}  // namespace

Options GetOptions() {
  InitFromEnv();
  return Options{g_copy_grid.load(), g_copy_path.load(), g_dma_min_bytes.load(),
                 g_merge_min_bytes.load(), g_copy_kernel.load(), g_dma_slice_bytes.load(), g_kernel_tables.load()};
}

bool SetOption(const std::string& name, int64_t value) {
  InitFromEnv();
  if (name == "copy_grid") {
    if (value < 1 || value > 65535) return false;
    g_copy_grid.store(value);
  } else if (name == "copy_path") {
    if (value < kCopyAuto || value > kCopyDma) return false;
    g_copy_path.store(value);
  } else if (name == "dma_min_bytes") {
    if (value < 0) return false;
    g_dma_min_bytes.store(value);
  } else if (name == "merge_min_bytes") {
    if (value < 0) return false;
    g_merge_min_bytes.store(value);
  } else if (name == "copy_kernel") {
    if (value < 0 || value > 3) return false;
    g_copy_kernel.store(value);
  } else if (name == "dma_slice_bytes") {
    if (value < 1) return false;
    g_dma_slice_bytes.store(value);
  } else if (name == "kernel_tables") {
    if (value != 0 && value != 1) return false;
    g_kernel_tables.store(value);
  } else {
    return false;
  }
  return true;
}

bool GetOption(const std::string& name, int64_t* value) {
  Options o = GetOptions();
  if (name == "copy_grid") *value = o.copy_grid;
  else if (name == "copy_path") *value = o.copy_path;
  else if (name == "dma_min_bytes") *value = o.dma_min_bytes;
  else if (name == "merge_min_bytes") *value = o.merge_min_bytes;
  else if (name == "copy_kernel") *value = o.copy_kernel;
  else if (name == "dma_slice_bytes") *value = o.dma_slice_bytes;
  else if (name == "kernel_tables") *value = o.kernel_tables;
  else return false;
  return true;
}

int LastPath() { return t_last_path; }

bool BuiltWithCuda() { return FDKV_WITH_CUDA != 0; }

// ------------------------------------------------------------------------ validation
namespace {

[[noreturn]] void Fail(const char* op, const std::string& what) {
  throw InvalidArgument(std::string(op) + ": " + what);
}

std::string Indexed(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void CheckRange(const char* op, IdSpan ids, int64_t limit, const char* what) {
  for (int64_t i = 0; i < ids.size; ++i) {
    const int64_t v = ids.data[i];
    if (v < 0 || (limit >= 0 && v >= limit)) {
      std::string range = limit >= 0 ? "[0, " + std::to_string(limit) + ")" : "[0, inf)";
      Fail(op, Indexed(ids.name, i) + " = " + std::to_string(v) + " is out of range " + range +
                   " (" + what + ")");
    }
  }
}

// Destination ids must be unique: two sources written to one block would leave which
// one wins up to scheduling.  A bitset over the id range keeps this O(n).
void CheckUnique(const char* op, IdSpan ids) {
  if (ids.size < 2) return;
  int64_t max_id = *std::max_element(ids.data, ids.data + ids.size);
  constexpr int64_t kBitsetLimit = int64_t(1) << 28;
  if (max_id < kBitsetLimit) {
    thread_local std::vector<uint64_t> seen;
    const size_t words = static_cast<size_t>(max_id / 64 + 1);
    seen.assign(words, 0);
    for (int64_t i = 0; i < ids.size; ++i) {
      const int64_t v = ids.data[i];
      uint64_t& w = seen[static_cast<size_t>(v >> 6)];
      const uint64_t bit = uint64_t(1) << (v & 63);
      if (w & bit) {
        int64_t j = std::find(ids.data, ids.data + i, v) - ids.data;
        Fail(op, Indexed(ids.name, i) + " = " + std::to_string(v) + " repeats index " +
                     std::to_string(j) + "; destination block ids must be unique");
      }
      w |= bit;
    }
    return;
  }
  std::unordered_set<int64_t> set;
  set.reserve(static_cast<size_t>(ids.size) * 2);
  for (int64_t i = 0; i < ids.size; ++i) {
    if (!set.insert(ids.data[i]).second) {
      int64_t j = std::find(ids.data, ids.data + i, ids.data[i]) - ids.data;
      Fail(op, Indexed(ids.name, i) + " = " + std::to_string(ids.data[i]) + " repeats index " +
                   std::to_string(j) + "; destination block ids must be unique");
    }
  }
}

}  // namespace

void CheckCopyPath(const char* op, int64_t copy_path) {
  if (copy_path < kCopyProcess || copy_path > kCopyDma) {
    Fail(op, "path = " + std::to_string(copy_path) +
                 " must be -1 (the process-wide copy_path option), 0 (auto), 1 (kernel) or 2 (dma)");
  }
}

void ValidateIds(const char* op, IdSpan dev_ids, int64_t num_dev_blocks, IdSpan host_ids,
                 int64_t num_host_blocks, int mode) {
  if (mode != kDeviceToHost && mode != kHostToDevice) {
    Fail(op, "mode = " + std::to_string(mode) +
                 " must be 0 (device to host) or 1 (host to device)");
  }
  if (dev_ids.size != host_ids.size) {
    const bool dev_short = dev_ids.size < host_ids.size;
    const IdSpan& longer = dev_short ? host_ids : dev_ids;
    const IdSpan& shorter = dev_short ? dev_ids : host_ids;
    Fail(op, Indexed(longer.name, shorter.size) + " has no partner: " + longer.name + " has " +
                 std::to_string(longer.size) + " ids but " + shorter.name + " has " +
                 std::to_string(shorter.size) + " (lengths must be equal)");
  }
  if ((dev_ids.size > 0 && dev_ids.data == nullptr) ||
      (host_ids.size > 0 && host_ids.data == nullptr)) {
    Fail(op, std::string(dev_ids.data == nullptr ? dev_ids.name : host_ids.name) +
                 " is a null pointer");
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
      t_last_path = ExecuteCuda(lanes, src_ids, dst_ids, n, LanesMergeable(lanes), mode, target.stream,
                                target.copy_path);
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

void CheckTensors(const char* op, const std::vector<TensorDesc>& tensors, const char* name) {
  if (tensors.empty()) Fail(op, std::string(name) + " is empty; pass at least one cache tensor");
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorDesc& d = tensors[t];
    if (d.dev == nullptr) Fail(op, Indexed(name, t) + " has a null data pointer");
    if (d.block_bytes <= 0) {
      Fail(op, Indexed(name, t) + " has block size " + std::to_string(d.block_bytes) +
                   " bytes; prod(shape[1:]) * itemsize must be > 0");
    }
    if (d.num_blocks < 0) Fail(op, Indexed(name, t) + " has a negative block count");
  }
}

int64_t MinBlocks(const std::vector<TensorDesc>& tensors) {
  int64_t m = tensors.front().num_blocks;
  for (const TensorDesc& d : tensors) m = std::min(m, d.num_blocks);
  return m;
}

}  // namespace

void SwapLayers(const char* op, const std::vector<TensorDesc>& tensors,
                const std::vector<void*>& host_ptrs, int64_t num_host_blocks, IdSpan dev_ids,
                IdSpan host_ids, int mode, const ExecTarget& target, const char* host_ptr_name) {
  CheckTensors(op, tensors, tensors.size() == 1 ? "cache_gpu" : "cache_gpu_tensors");
  if (host_ptrs.size() != tensors.size()) {
    Fail(op, std::string(host_ptr_name) + " has " + std::to_string(host_ptrs.size()) +
                 " pointers but there are " + std::to_string(tensors.size()) + " cache tensors");
  }
  for (size_t t = 0; t < host_ptrs.size(); ++t) {
    if (host_ptrs[t] == nullptr) Fail(op, Indexed(host_ptr_name, t) + " is a null pointer");
  }
  if (num_host_blocks < 0) {
    Fail(op, "max_block_num_cpu = " + std::to_string(num_host_blocks) + " must be >= 0");
  }
  CheckCopyPath(op, target.copy_path);
  ValidateIds(op, dev_ids, MinBlocks(tensors), host_ids, num_host_blocks, mode);

  std::vector<LaneDesc> lanes;
  lanes.reserve(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    char* dev = static_cast<char*>(tensors[t].dev);
    char* host = static_cast<char*>(host_ptrs[t]);
    const int64_t bb = tensors[t].block_bytes;
    if (mode == kDeviceToHost) lanes.push_back(LaneDesc{dev, host, bb, bb, bb});
    else lanes.push_back(LaneDesc{host, dev, bb, bb, bb});
  }
  Execute(lanes, dev_ids, host_ids, mode, target);
}

void SwapLayout(const char* op, const std::vector<TensorDesc>& tensors, void* host_ptr,
                int64_t num_host_blocks, IdSpan dev_ids, IdSpan host_ids, int mode,
                const ExecTarget& target) {
  CheckTensors(op, tensors, "cache_gpu_tensors");
  if (host_ptr == nullptr) Fail(op, "cache_cpu_ptr is a null pointer");
  CheckCopyPath(op, target.copy_path);
  ValidateIds(op, dev_ids, MinBlocks(tensors), host_ids, num_host_blocks, mode);

  int64_t host_block_bytes = 0;
  for (const TensorDesc& d : tensors) host_block_bytes += d.block_bytes;
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
void* HostAlloc(size_t nbytes, unsigned flags) {
  if (nbytes == 0) throw InvalidArgument("cuda_host_alloc: nbytes = 0 must be > 0");
#if FDKV_WITH_CUDA
  void* p = nullptr;
  CudaHostAlloc(&p, nbytes, flags);
  return p;
#else
  (void)flags;
  constexpr size_t kAlign = 4096;
  const size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return p;
#endif
}

void HostFree(void* ptr) {
  if (ptr == nullptr) return;
#if FDKV_WITH_CUDA
  CudaHostFree(ptr);
#else
  std::free(ptr);
#endif
}

void StreamSynchronize(void* stream) {
#if FDKV_WITH_CUDA
  CudaStreamSynchronize(stream);
#else
  (void)stream;
#endif
}

}  // namespace fdkv
