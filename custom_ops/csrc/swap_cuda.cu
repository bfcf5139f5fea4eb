// CUDA execution of a planned swap: merged cudaMemcpyAsync runs, a small-grid vectorized
// copy kernel for scattered blocks, a cudaMemcpyBatchAsync DMA batch, and the staged path
// (device-side gather/scatter + pipelined contiguous DMA, swap_staged.cu).
//
// Validation happened in swap_core.cc before anything here runs; this file only plans
// the path and launches.  Nothing on this path calls cudaMalloc per call: id and lane
// tables travel through a grow-only ring of (pinned staging, device buffer, event)
// slots per device, reused once the event says the previous user is done.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <string>
#include <vector>

#include "swap_core.h"

namespace fdkv {

#define FDKV_CUDA_CHECK(call)                                                          \
  do {                                                                                 \
    cudaError_t _e = (call);                                                           \
    if (_e != cudaSuccess) {                                                           \
      throw CudaFailure(std::string("fdkv: ") + #call + " failed: " +                  \
                        cudaGetErrorName(_e) + " (" + cudaGetErrorString(_e) + ")");   \
    }                                                                                  \
  } while (0)

// ------------------------------------------------------------------------ kernels
namespace {

constexpr int kThreads = 512;           // 16 warps per CTA
constexpr int kUnroll = 8;              // vectors in flight per lane
constexpr int64_t kChunkBytes = 8192;   // one warp work item (a block or a slice of one)

// Bulk-copy (TMA) pipeline: one thread per CTA streams chunks through shared memory.
constexpr int kTmaStages = 8;
constexpr int64_t kTmaChunkBytes = 16384;
constexpr int kTmaSmemBytes = kTmaStages * static_cast<int>(kTmaChunkBytes);

// Kernel variants (option "copy_kernel"): how the scattered-block kernel moves bytes.
enum KernelVariant : int {
  kWarpStreaming = 0,  // warp per chunk, ld.global.cs / st.global.cs
  kWarpNcL2Prefetch = 1,  // warp per chunk, ld.global.nc.L1::no_allocate.L2::256B / st.global.cs
  kWarpDefault = 2,    // warp per chunk, default-cached ld / st
  kBulkTma = 3,        // cp.async.bulk global->shared->global pipeline, one thread per CTA
};

struct KLane {
  const char* src;
  char* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t bytes;
};

template <typename V, int kVariant>
__device__ __forceinline__ V LoadV(const V* p) {
  if constexpr (kVariant == kWarpStreaming) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

template <>
__device__ __forceinline__ int4 LoadV<int4, kWarpNcL2Prefetch>(const int4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return __ldg(p);  // the L2 prefetch-size hint needs sm_80
#endif
}

template <typename V, int kVariant>
__device__ __forceinline__ void StoreV(V* p, V v) {
  if constexpr (kVariant == kWarpDefault) {
    *p = v;
  } else {
    __stcs(p, v);
  }
}

// Copy `nv` vectors of type V with one warp; kUnroll loads are issued before the first
// store so each lane keeps kUnroll * sizeof(V) bytes in flight (PCIe latency is ~1-2 us).
template <typename V, int kVariant>
__device__ __forceinline__ void WarpCopy(const V* __restrict__ src, V* __restrict__ dst,
                                         int64_t nv, int lane) {
  for (int64_t base = 0; base < nv; base += 32 * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < nv) r[u] = LoadV<V, kVariant>(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < nv) StoreV<V, kVariant>(dst + i, r[u]);
    }
  }
}

// Walks work items (lane l, pair p, chunk c), flattened lane-major, in increasing order;
// since a caller's items only grow, the lane cursor only moves forward.
template <int64_t kChunk>
struct ItemCursor {
  const KLane* lanes;
  int num_lanes;
  int64_t n;
  int l = 0;
  KLane cur;
  int64_t chunks = 1;
  int64_t begin = 0;
  int64_t end = 0;

  __device__ ItemCursor(const KLane* lanes_, int num_lanes_, int64_t n_)
      : lanes(lanes_), num_lanes(num_lanes_), n(n_) {
    cur = lanes[0];
    chunks = (cur.bytes + kChunk - 1) / kChunk;
    end = n * chunks;
  }

  // Source, destination and length of item g.
  __device__ __forceinline__ void Locate(int64_t g, const int64_t* __restrict__ src_ids,
                                         const int64_t* __restrict__ dst_ids, const char** s, char** d,
                                         int64_t* len) {
    while (g >= end && l + 1 < num_lanes) {
      ++l;
      cur = lanes[l];
      begin = end;
      chunks = (cur.bytes + kChunk - 1) / kChunk;
      end += n * chunks;
    }
    const int64_t local = g - begin;
    const int64_t pair = local / chunks;
    const int64_t off = (local - pair * chunks) * kChunk;
    *len = min(kChunk, cur.bytes - off);
    *s = cur.src + src_ids[pair] * cur.src_stride + off;
    *d = cur.dst + dst_ids[pair] * cur.dst_stride + off;
  }
};

// griddepcontrol.launch_dependents: a kernel launched after this one with programmatic
// stream serialization may start once every thread of this grid has called it or exited.
// A no-op before sm_90 and for launches without dependents.
__device__ __forceinline__ void TriggerDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename V, int kVariant>
__global__ void __launch_bounds__(kThreads)
SwapCopyKernel(const KLane* __restrict__ lanes, int num_lanes, const int64_t* __restrict__ src_ids,
               const int64_t* __restrict__ dst_ids, int64_t n, int64_t total_items) {
  const int lane_id = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  ItemCursor<kChunkBytes> cursor(lanes, num_lanes, n);
  for (int64_t g = warp; g < total_items; g += num_warps) {
    // At its last item a thread lets a dependent launch begin (LaunchWarpKernel's
    // `overlap`): once every thread has, the next span's kernel fills the link while this
    // one's last items drain.
    if (g + num_warps >= total_items) TriggerDependentLaunch();
    const char* s;
    char* d;
    int64_t len;
    cursor.Locate(g, src_ids, dst_ids, &s, &d, &len);
    WarpCopy<V, kVariant>(reinterpret_cast<const V*>(s), reinterpret_cast<V*>(d),
                          len / static_cast<int64_t>(sizeof(V)), lane_id);
  }
}

// ---- bulk-copy (TMA) pipeline.  Needs 16-byte aligned addresses and sizes.
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread per CTA: kTmaStages chunks in flight from source to shared memory, each
// drained by a bulk store to the destination as soon as it lands.  Few threads, deep
// pipeline: the bytes in flight come from the copy engine, not from registers.
__global__ void __launch_bounds__(32)
SwapCopyKernelTma(const KLane* __restrict__ lanes, int num_lanes, const int64_t* __restrict__ src_ids,
                  const int64_t* __restrict__ dst_ids, int64_t n, int64_t total_items) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[kTmaStages];
  __shared__ char* st_dst[kTmaStages];
  __shared__ uint32_t st_len[kTmaStages];
  if (threadIdx.x != 0) return;
  for (int i = 0; i < kTmaStages; ++i) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(&bars[i])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

  ItemCursor<kTmaChunkBytes> cursor(lanes, num_lanes, n);
  const int64_t first = blockIdx.x;
  const int64_t step = gridDim.x;
  const int64_t count = first < total_items ? (total_items - first + step - 1) / step : 0;
  uint32_t phase_bits = 0;

  auto issue_load = [&](int64_t k) {
    const int stage = static_cast<int>(k % kTmaStages);
    const char* s;
    char* d;
    int64_t len;
    cursor.Locate(first + k * step, src_ids, dst_ids, &s, &d, &len);
    st_dst[stage] = d;
    st_len[stage] = static_cast<uint32_t>(len);
    const uint32_t bar = SmemAddr(&bars[stage]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(static_cast<uint32_t>(len))
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            SmemAddr(smem + stage * kTmaChunkBytes)),
        "l"(s), "r"(static_cast<uint32_t>(len)), "r"(bar)
        : "memory");
  };

  const int64_t prologue = count < kTmaStages ? count : kTmaStages;
  for (int64_t k = 0; k < prologue; ++k) issue_load(k);
  for (int64_t k = 0; k < count; ++k) {
    const int stage = static_cast<int>(k % kTmaStages);
    const uint32_t bar = SmemAddr(&bars[stage]);
    const uint32_t parity = (phase_bits >> stage) & 1u;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
    phase_bits ^= 1u << stage;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(st_dst[stage]),
                 "r"(SmemAddr(smem + stage * kTmaChunkBytes)), "r"(st_len[stage])
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Refill the previous stage once its store has finished reading shared memory.
    if (k >= 1 && k - 1 + kTmaStages < count) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(k - 1 + kTmaStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
  (void)lanes; (void)num_lanes; (void)src_ids; (void)dst_ids; (void)n; (void)total_items;
  __trap();  // launcher never selects this variant below sm_90
#endif
}

// Widest access (16, 8, 4, 2 or 1 bytes) that every base, stride and size allows.  Block
// sizes that are not a multiple of 16 bytes take a narrower, still correct, width.
int VectorWidth(const std::vector<LaneDesc>& lanes) {
  uint64_t bits = 0;
  for (const LaneDesc& l : lanes) {
    bits |= reinterpret_cast<uintptr_t>(l.src) | reinterpret_cast<uintptr_t>(l.dst) |
            static_cast<uint64_t>(l.src_stride) | static_cast<uint64_t>(l.dst_stride) |
            static_cast<uint64_t>(l.bytes);
  }
  for (int w : {16, 8, 4, 2}) {
    if ((bits & static_cast<uint64_t>(w - 1)) == 0) return w;
  }
  return 1;
}

// ------------------------------------------------------------------------ scratch ring
// NOTE: a slot is reused only after its event (recorded after the kernel that reads it)
// has completed, so calls on different streams never overwrite each other's tables.  When
// every slot is still in flight the ring grows instead of blocking the host; it is
// bounded (kMaxSlots) and only then waits.  After warm-up the hot path allocates nothing.
struct ScratchSlot {
  char* host = nullptr;   // pinned staging
  char* dev = nullptr;    // device copy read by the kernel
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
  bool busy = false;      // between Acquire and Release (host side)
};

class ScratchRing {
 public:
  static constexpr size_t kMaxSlots = 256;
  static constexpr size_t kMinBytes = 64 << 10;

  ScratchSlot* Acquire(size_t bytes) {
    ScratchSlot* slot = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < slots_.size() && slot == nullptr; ++k) {
        ScratchSlot* s = slots_[(next_ + k) % slots_.size()].get();
        if (!s->busy && cudaEventQuery(s->done) == cudaSuccess) slot = s;
      }
      if (slot == nullptr && slots_.size() < kMaxSlots) {
        slots_.emplace_back(new ScratchSlot());
        slot = slots_.back().get();
        FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming));
      }
      if (slot == nullptr) {  // ring full and all in flight: wait for the oldest
        for (size_t k = 0; k < slots_.size() && slot == nullptr; ++k) {
          ScratchSlot* s = slots_[(next_ + k) % slots_.size()].get();
          if (!s->busy) slot = s;
        }
        if (slot == nullptr) throw CudaFailure("fdkv: scratch ring exhausted by concurrent callers");
        FDKV_CUDA_CHECK(cudaEventSynchronize(slot->done));
      }
      slot->busy = true;
      next_ = (next_ + 1) % slots_.size();
    }
    if (slot->capacity < bytes) {
      try {
        Grow(slot, bytes);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        slot->busy = false;
        throw;
      }
    }
    return slot;
  }

  void Release(ScratchSlot* slot, cudaStream_t stream) {
    cudaError_t e = cudaEventRecord(slot->done, stream);
    std::lock_guard<std::mutex> lock(mu_);
    slot->busy = false;
    if (e != cudaSuccess) {
      throw CudaFailure(std::string("fdkv: cudaEventRecord failed: ") + cudaGetErrorString(e));
    }
  }

 private:
  static void Grow(ScratchSlot* slot, size_t bytes) {
    size_t cap = std::max({bytes, slot->capacity * 2, kMinBytes});
    // The slot's event has completed, so its old buffers are idle.  cudaFree syncs the
    // device, which is acceptable on this rare (warm-up) path.
    if (slot->host != nullptr) FDKV_CUDA_CHECK(cudaFreeHost(slot->host));
    if (slot->dev != nullptr) FDKV_CUDA_CHECK(cudaFree(slot->dev));
    slot->host = nullptr;
    slot->dev = nullptr;
    slot->capacity = 0;
    FDKV_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&slot->host), cap, cudaHostAllocDefault));
    FDKV_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slot->dev), cap));
    slot->capacity = cap;
  }

  std::mutex mu_;
  std::vector<std::unique_ptr<ScratchSlot>> slots_;
  size_t next_ = 0;
};

ScratchRing& RingForCurrentDevice() {
  constexpr int kMaxDevices = 64;
  static ScratchRing* rings[kMaxDevices] = {};
  static std::mutex mu;
  int dev = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) throw CudaFailure("fdkv: device ordinal out of range");
  std::lock_guard<std::mutex> lock(mu);
  // NOTE: rings live for the whole process (never destroyed): freeing CUDA memory from a
  // static destructor after the runtime has shut down is undefined.
  if (rings[dev] == nullptr) rings[dev] = new ScratchRing();
  return *rings[dev];
}

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// ------------------------------------------------------------------------ launchers
// What the current device supports, worked out once per device: the bulk-copy (TMA)
// kernel and programmatic dependent launch both need sm_90.
struct DeviceFeatures {
  bool tma = false;
  bool programmatic_launch = false;
};

const DeviceFeatures& FeaturesOfCurrentDevice() {
  static DeviceFeatures features[64];
  static bool known[64] = {};
  static std::mutex mu;
  int dev = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  DeviceFeatures& f = features[dev & 63];
  if (!known[dev & 63]) {
    int major = 0;
    FDKV_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    f.programmatic_launch = major >= 9;
    if (major >= 9) {
      f.tma = cudaFuncSetAttribute(SwapCopyKernelTma, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaSmemBytes) ==
              cudaSuccess;
      (void)cudaGetLastError();
    }
    known[dev & 63] = true;
  }
  return f;
}

// `overlap`: launch with programmatic stream serialization, so the grid may start while
// the kernel ahead of it on the stream drains its last items (it triggers at its last
// item, TriggerDependentLaunch).  The grid never waits for that kernel's results
// (cudaGridDependencySynchronize): the caller vouches that it touches none of its bytes
// (ExecTarget::after_own_kernel).  Work queued after this grid still follows both.
template <typename V, int kVariant>
void LaunchWarpKernelAs(int grid, cudaStream_t stream, bool overlap, const KLane* d_lanes, int nl,
                        const int64_t* d_src, const int64_t* d_dst, int64_t n, int64_t items) {
  if (!overlap) {
    SwapCopyKernel<V, kVariant><<<grid, kThreads, 0, stream>>>(d_lanes, nl, d_src, d_dst, n, items);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  FDKV_CUDA_CHECK(cudaLaunchKernelEx(&config, SwapCopyKernel<V, kVariant>, d_lanes, nl, d_src, d_dst, n, items));
}

template <int kVariant>
void LaunchWarpKernel(int width, int grid, cudaStream_t stream, bool overlap, const KLane* d_lanes, int nl,
                      const int64_t* d_src, const int64_t* d_dst, int64_t n, int64_t items) {
  switch (width) {
    case 16: LaunchWarpKernelAs<int4, kVariant>(grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items); break;
    case 8: LaunchWarpKernelAs<long long, kVariant>(grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items); break;
    case 4: LaunchWarpKernelAs<int, kVariant>(grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items); break;
    case 2: LaunchWarpKernelAs<short, kVariant>(grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items); break;
    default: LaunchWarpKernelAs<char, kVariant>(grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items); break;
  }
}

int64_t CountItems(const std::vector<LaneDesc>& lanes, int64_t n, int64_t chunk) {
  int64_t items = 0;
  for (const LaneDesc& l : lanes) items += n * ((l.bytes + chunk - 1) / chunk);
  return items;
}

void LaunchKernel(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids,
                  int64_t n, cudaStream_t stream, int64_t grid_cap, int64_t variant, bool tables_in_host,
                  bool after_own_kernel) {
  const size_t lane_bytes = AlignUp(lanes.size() * sizeof(KLane), 16);
  const size_t ids_bytes = static_cast<size_t>(n) * sizeof(int64_t);
  const size_t total = lane_bytes + 2 * AlignUp(ids_bytes, 16);
  const int width = VectorWidth(lanes);
  // NOTE: the bulk-copy variant needs 16-byte granularity and sm_90; anything else takes
  // the warp kernel, which handles every width.
  if (variant == kBulkTma && (width != 16 || !FeaturesOfCurrentDevice().tma)) variant = kWarpStreaming;

  ScratchRing& ring = RingForCurrentDevice();
  ScratchSlot* slot = ring.Acquire(total);
  KLane* h_lanes = reinterpret_cast<KLane*>(slot->host);
  for (size_t i = 0; i < lanes.size(); ++i) {
    const LaneDesc& l = lanes[i];
    h_lanes[i] = KLane{l.src, l.dst, l.src_stride, l.dst_stride, l.bytes};
  }
  char* h_src = slot->host + lane_bytes;
  char* h_dst = h_src + AlignUp(ids_bytes, 16);
  std::memcpy(h_src, src_ids, ids_bytes);
  std::memcpy(h_dst, dst_ids, ids_bytes);

  try {
    // The kernel reads its lane and id tables either from a device copy (one extra small
    // cudaMemcpyAsync ahead of it on the stream) or straight from the pinned staging
    // buffer (no copy: each warp pays one PCIe round trip per item for its ids).
    const char* tables = slot->host;
    if (!tables_in_host) {
      FDKV_CUDA_CHECK(cudaMemcpyAsync(slot->dev, slot->host, total, cudaMemcpyHostToDevice, stream));
      tables = slot->dev;
    }
    const KLane* d_lanes = reinterpret_cast<const KLane*>(tables);
    const int64_t* d_src = reinterpret_cast<const int64_t*>(tables + lane_bytes);
    const int64_t* d_dst = reinterpret_cast<const int64_t*>(tables + lane_bytes + AlignUp(ids_bytes, 16));
    const int nl = static_cast<int>(lanes.size());
    if (variant == kBulkTma) {
      const int64_t items = CountItems(lanes, n, kTmaChunkBytes);
      const int grid = static_cast<int>(std::max<int64_t>(1, std::min(grid_cap, items)));
      SwapCopyKernelTma<<<grid, 32, kTmaSmemBytes, stream>>>(d_lanes, nl, d_src, d_dst, n, items);
    } else {
      const int64_t items = CountItems(lanes, n, kChunkBytes);
      const int64_t warps_per_cta = kThreads / 32;
      const int grid = static_cast<int>(
          std::max<int64_t>(1, std::min(grid_cap, (items + warps_per_cta - 1) / warps_per_cta)));
      // A table upload (kernel_tables 0) lands between the two kernels: no overlap then.
      const bool overlap = after_own_kernel && tables_in_host && FeaturesOfCurrentDevice().programmatic_launch;
      if (variant == kWarpNcL2Prefetch) {
        LaunchWarpKernel<kWarpNcL2Prefetch>(width, grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items);
      } else if (variant == kWarpDefault) {
        LaunchWarpKernel<kWarpDefault>(width, grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items);
      } else {
        LaunchWarpKernel<kWarpStreaming>(width, grid, stream, overlap, d_lanes, nl, d_src, d_dst, n, items);
      }
    }
    FDKV_CUDA_CHECK(cudaGetLastError());
  } catch (...) {
    ring.Release(slot, stream);
    throw;
  }
  ring.Release(slot, stream);
}

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

bool DmaBatchAvailable(cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  // The batch API rejects the legacy default stream.
  return stream != nullptr && stream != cudaStreamLegacy;
#else
  (void)stream;
  return false;
#endif
}

// `first_slice_bytes` (0: none): the first slice is at most that large and each next one
// twice the last, up to `slice_bytes`: the copy engines start once a call returns, so a
// load's first layer no longer waits for the whole layer's batch to be submitted (~110 us
// for 128 copies on an H100 host) before its first byte moves.
void LaunchDmaBatch(const std::vector<Copy>& copies, int mode, cudaStream_t stream, size_t slice_bytes,
                    size_t first_slice_bytes = 0) {
#if CUDART_VERSION >= 12080
  thread_local std::vector<void*> dsts;
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<size_t> sizes;
  int dev = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  cudaMemLocation host_loc = {};
  host_loc.type = cudaMemLocationTypeHost;
  cudaMemLocation dev_loc = {};
  dev_loc.type = cudaMemLocationTypeDevice;
  dev_loc.id = dev;
  attr.srcLocHint = mode == kDeviceToHost ? dev_loc : host_loc;
  attr.dstLocHint = mode == kDeviceToHost ? host_loc : dev_loc;
  size_t attr_idx = 0;
  // NOTE: the batch is issued in slices of about slice_bytes: the copy engines start on
  // one slice while the driver still processes the next, instead of idling through one
  // huge call.  Measured on H100 PCIe (docs/ops.md, "Measured costs"): ~16 MiB slices beat both
  // 1-4 MiB (per-call overhead shows) and one call for everything (no overlap).
  size_t total_bytes = 0;
  for (const Copy& c : copies) total_bytes += c.bytes;
  const size_t avg = std::max<size_t>(1, total_bytes / std::max<size_t>(1, copies.size()));
  size_t slice_cap = first_slice_bytes > 0 ? std::min(first_slice_bytes, slice_bytes) : slice_bytes;
  for (size_t begin = 0, count = 0; begin < copies.size(); begin += count) {
    const size_t slice = std::min<size_t>(8192, std::max<size_t>(1, slice_cap / avg));
    count = std::min(slice, copies.size() - begin);
    slice_cap = std::min(slice_bytes, slice_cap * 2);
    dsts.resize(count);
    srcs.resize(count);
    sizes.resize(count);
    for (size_t i = 0; i < count; ++i) {
      dsts[i] = copies[begin + i].dst;
      srcs[i] = copies[begin + i].src;
      sizes[i] = copies[begin + i].bytes;
    }
#if CUDART_VERSION >= 13000
    FDKV_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), count, &attr,
                                         &attr_idx, 1, stream));
#else
    size_t fail_idx = 0;
    FDKV_CUDA_CHECK(cudaMemcpyBatchAsync(const_cast<void**>(dsts.data()), const_cast<void**>(srcs.data()),
                                         sizes.data(), count, &attr, &attr_idx, 1, &fail_idx, stream));
#endif
  }
#else
  (void)copies;
  (void)mode;
  (void)stream;
  (void)slice_bytes;
  throw CudaFailure("fdkv: cudaMemcpyBatchAsync needs CUDA >= 12.8");
#endif
}

}  // namespace

}  // namespace fdkv

#include "swap_staged.cu"

namespace fdkv {

// The copy kernel dereferences host memory from the GPU, which works only for pinned
// (page-locked, mapped) memory; pageable memory would fault and poison the context.
// Known-good bases are cached, so the check costs a hash lookup per tensor per call.
bool HostSideIsPinned(const std::vector<LaneDesc>& lanes, int mode) {
  // NOTE: on a thread that has made no CUDA runtime call yet (a Python loader thread that
  // only passes stream handles) no context is current, and cudaPointerGetAttributes then
  // reports pinned memory as unregistered: such calls fell back to per-run cudaMemcpyAsync.
  // Making the current device's primary context current once per thread fixes that.
  thread_local bool context_current = false;
  if (!context_current) {
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaSetDevice(dev) == cudaSuccess) context_current = true;
    (void)cudaGetLastError();
  }
  static std::mutex mu;
  static std::unordered_set<uintptr_t> pinned;
  std::lock_guard<std::mutex> lock(mu);
  for (const LaneDesc& l : lanes) {
    const void* host = mode == kDeviceToHost ? static_cast<const void*>(l.dst) : static_cast<const void*>(l.src);
    const uintptr_t key = reinterpret_cast<uintptr_t>(host);
    if (pinned.count(key) != 0) continue;
    cudaPointerAttributes attr = {};
    if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (attr.type != cudaMemoryTypeHost || attr.devicePointer != host) return false;
    // NOTE: bounded: a process that cycles through many host buffers re-checks them.
    if (pinned.size() > 65536) pinned.clear();
    pinned.insert(key);
  }
  return true;
}

// ------------------------------------------------------------------------ lanes at one pitch
// The widest pitch cudaMemcpy2DAsync takes on the current device (cudaDevAttrMaxPitch).
int64_t MaxPitch() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cached[kMaxDevices] = {};
  int dev = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return 0;
  int64_t v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int pitch = 0;
    FDKV_CUDA_CHECK(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, dev));
    v = std::max<int64_t>(1, pitch);
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether the lanes sit at one pitch on each side: every lane has lane 0's block size and
// strides, and lane l starts l * pitch bytes after lane 0 (a cache allocated as one slab,
// as the worker does).  Then a run of blocks is one 2D copy over all lanes (width: the
// run's bytes, height: the lane count), where the DMA batch needs a copy per lane.
// Measured on H100 (docs/ops.md, "Lanes at one pitch"): ~2.5 us of host time per 2D copy
// against ~0.85 us per lane in the batch, but the copy engines take longer per row than per
// batch entry: 128 KiB rows moved at 0.73-0.78 of the link with 3-4 lanes, 0.85-0.91 with
// 8-16, 0.89-0.96 with 32-96 (the batch: 0.95-0.97); 2 MiB rows at 0.97-0.99 at any count;
// 16 KiB rows at 0.56-0.66.  Hence 16 lanes at least by default (option
// dma_rows_min_lanes): an all-layer call of any real model, where the batch pays ~1 ms of
// submissions per 256 MiB and holds up every other thread's CUDA calls meanwhile.
bool LanesAtOnePitch(const std::vector<LaneDesc>& lanes, int64_t* src_pitch, int64_t* dst_pitch) {
  int64_t min_lanes = 16;
  GetOption("dma_rows_min_lanes", &min_lanes);
  if (lanes.size() < 2 || static_cast<int64_t>(lanes.size()) < min_lanes) return false;
  const LaneDesc& a = lanes.front();
  const int64_t sp = lanes[1].src - a.src;
  const int64_t dp = lanes[1].dst - a.dst;
  if (sp <= 0 || dp <= 0) return false;
  for (size_t l = 1; l < lanes.size(); ++l) {
    const LaneDesc& b = lanes[l];
    const int64_t i = static_cast<int64_t>(l);
    if (b.bytes != a.bytes || b.src_stride != a.src_stride || b.dst_stride != a.dst_stride ||
        b.src != a.src + i * sp || b.dst != a.dst + i * dp) {
      return false;
    }
  }
  const int64_t max_pitch = MaxPitch();
  if (sp > max_pitch || dp > max_pitch) return false;
  *src_pitch = sp;
  *dst_pitch = dp;
  return true;
}

// One cudaMemcpy2DAsync per run over every lane; false (nothing enqueued) if a run is wider
// than a pitch (its rows would overlap the next lane's).
bool LaunchLaneRows(const std::vector<LaneDesc>& lanes, const std::vector<Run>& runs, int64_t src_pitch,
                    int64_t dst_pitch, cudaStream_t stream) {
  const LaneDesc& l = lanes.front();
  for (const Run& r : runs) {
    if (r.count * l.bytes > std::min(src_pitch, dst_pitch)) return false;
  }
  for (const Run& r : runs) {
    FDKV_CUDA_CHECK(cudaMemcpy2DAsync(l.dst + r.dst_id * l.dst_stride, static_cast<size_t>(dst_pitch),
                                      l.src + r.src_id * l.src_stride, static_cast<size_t>(src_pitch),
                                      static_cast<size_t>(r.count * l.bytes), lanes.size(), cudaMemcpyDefault,
                                      stream));
  }
  return true;
}

// ------------------------------------------------------------------------ auto's staged rule
// Whether auto takes the staged path for a call (or a layer stack) of `total_bytes` whose
// copies both sides share average `avg_copy_bytes` and whose host side merges into
// `num_segs` contiguous ranges.  Staged wins where the alternatives are weak: copies below
// dma_min_bytes, where the DMA batch pays ~1 us per copy and the kernel holds SMs for the
// whole transfer and loses a third of the link in both directions at once, while the host
// side merges into runs (>= staged_min_bytes, and >= 2x the shared runs).  Such a call must
// be >= 16 MiB: each chunk costs ~15-20 us of link time at the DMA <-> kernel hand-offs,
// which a per-layer call of a few MiB cannot amortize.  Larger copies go staged only from
// `large_copy_min_bytes` (measured on H100: docs/ops.md, "auto" and "The staged
// pipeline").
// The part of the rule that needs no plan (the call's size): checked first, so that calls
// that cannot go staged (a per-layer load of big blocks) skip building the staged plan.
bool StagedCallSizeHolds(int64_t total_bytes, int64_t avg_copy_bytes, const Options& opts,
                         int64_t large_copy_min_bytes) {
  constexpr int64_t kStagedMinCallBytes = 16 << 20;
  const int64_t min_call = avg_copy_bytes < opts.dma_min_bytes ? kStagedMinCallBytes : large_copy_min_bytes;
  return total_bytes >= min_call;
}

bool StagedRuleHolds(int64_t total_bytes, int64_t avg_copy_bytes, int64_t num_segs, const Options& opts,
                     int64_t large_copy_min_bytes) {
  const int64_t avg_seg = total_bytes / std::max<int64_t>(1, num_segs);
  return avg_seg >= opts.staged_min_bytes && avg_seg >= 2 * avg_copy_bytes &&
         StagedCallSizeHolds(total_bytes, avg_copy_bytes, opts, large_copy_min_bytes);
}

// ------------------------------------------------------------------------ layer stacks
namespace {

// The checks of a stack's staged rule that need no plan: the call's path, and with auto the
// call's size (StagedCallSizeHolds); `total_bytes` and `avg_copy_bytes` are what the rest of
// auto's rule takes.
bool StackStagedCandidate(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids,
                          int64_t n, int copy_path, const Options& opts, int64_t* path, int64_t* total_bytes,
                          int64_t* avg_copy_bytes) {
  *path = ResolveCopyPath(copy_path, opts);
  *total_bytes = 0;
  *avg_copy_bytes = 0;
  if (n <= 0 || (*path != kCopyAuto && *path != kCopyStaged)) return false;
  if (*path == kCopyAuto) {
    const std::vector<Run> runs = PlanRuns(src_ids, dst_ids, n);
    for (const LaneDesc& l : lanes) *total_bytes += l.bytes * n;
    const int64_t num_copies = static_cast<int64_t>(runs.size() * lanes.size());
    *avg_copy_bytes = *total_bytes / std::max<int64_t>(1, num_copies);
    // Before the plan: the first layer of a load waits for this call's set-up.
    if (!StagedCallSizeHolds(*total_bytes, *avg_copy_bytes, opts, INT64_MAX)) return false;
  }
  return true;
}

}  // namespace

bool StackMayStage(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids, int64_t n,
                   int copy_path) {
  int64_t path = 0, total_bytes = 0, avg_copy_bytes = 0;
  return StackStagedCandidate(lanes, src_ids, dst_ids, n, copy_path, GetOptions(), &path, &total_bytes,
                              &avg_copy_bytes);
}

int ExecuteCudaGroups(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids,
                      int64_t n, int mode, void* stream_ptr, int copy_path, int64_t group_size, bool first_alone,
                      const std::function<void(int64_t, void*)>& on_group) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const Options opts = GetOptions();
  // The stack as one staged pipeline where its host side merges into runs (the rule of
  // ExecuteCuda's auto for a call of this size): a layer's chunks no longer pay the
  // pipeline's fill and drain, and the submit is O(chunks), not O(blocks x layers).
  // NOTE: only copies below dma_min_bytes (no large-copy threshold): there the alternative
  // per layer is the SM-holding kernel or a slow DMA batch, and the stack did better (16
  // KiB loads in bench_overlap: 0.88 hidden against 0.84-0.86).  With 128 KiB blocks the
  // per-layer DMA batch overlapped better (0.91-0.92 against 0.88; docs/ops.md, "Layer
  // groups").
  int64_t path = 0, total_bytes = 0, avg_copy_bytes = 0;
  if (!StackStagedCandidate(lanes, src_ids, dst_ids, n, copy_path, opts, &path, &total_bytes, &avg_copy_bytes) ||
      !DmaBatchAvailable(stream)) {
    return 0;
  }
  thread_local staged::HostOrder host_order;
  staged::SortHostIds(staged::HostIdsOf(src_ids, dst_ids, mode), n, &host_order);
  if (path == kCopyAuto &&
      !StagedRuleHolds(total_bytes, avg_copy_bytes, staged::CountSegments(lanes, host_order, n, mode), opts,
                       INT64_MAX)) {
    return 0;  // decided before the plan is built
  }
  thread_local staged::Plan plan;
  staged::BuildPlan(lanes, src_ids, dst_ids, n, mode, host_order, &plan);
  if (plan.geo.block_major) return 0;
  if (!HostSideIsPinned(lanes, mode)) return 0;
  staged::GroupMarks marks;
  const int64_t num_groups = static_cast<int64_t>(lanes.size()) / group_size;
  int64_t span_min_bytes = 0;
  GetOption("stack_span_min_bytes", &span_min_bytes);
  // Group g ends at virtual offset group_end(g) (the start of group g + 1's lanes).
  auto group_end = [&](int64_t g) {
    return g + 1 == num_groups ? plan.total : n * plan.lanes[static_cast<size_t>((g + 1) * group_size)].boff;
  };
  for (int64_t g = 0; g < num_groups; ++g) marks.ends.push_back(group_end(g));
  // A chunk ends at each span's end (SpanEnd), not at every group's: each chunk costs a DMA
  // batch call and a scatter launch.
  auto group_bytes = [&](int64_t g) { return group_end(g) - (g == 0 ? 0 : group_end(g - 1)); };
  for (int64_t g = 0; g < num_groups;) {
    g = g == 0 && first_alone ? 1 : SpanEnd(g, num_groups, span_min_bytes, group_bytes);
    marks.cuts.push_back(group_end(g - 1));
  }
  marks.done = [&](int64_t g, cudaStream_t s) { on_group(g, s); };
  return ExecuteStaged(plan, n, mode, stream, opts, &marks);
}

// ------------------------------------------------------------------------ planning
int ExecuteCuda(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids,
                int64_t n, bool mergeable, int mode, const ExecTarget& target) {
  cudaStream_t stream = static_cast<cudaStream_t>(target.stream);
  const Options opts = GetOptions();

  // Runs of consecutive ids: one copy each when every lane is contiguous across blocks.
  std::vector<Run> runs = mergeable ? PlanRuns(src_ids, dst_ids, n) : std::vector<Run>();
  if (!mergeable) {
    runs.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) runs.push_back(Run{src_ids[i], dst_ids[i], 1});
  }
  int64_t min_lane_bytes = lanes.front().bytes;
  int64_t total_bytes = 0;
  for (const LaneDesc& l : lanes) {
    min_lane_bytes = std::min(min_lane_bytes, l.bytes);
    total_bytes += l.bytes * n;
  }
  const int64_t num_copies = static_cast<int64_t>(runs.size() * lanes.size());
  const int64_t avg_copy_bytes = total_bytes / std::max<int64_t>(1, num_copies);

  // The call's own path wins over the process-wide option (see ExecTarget::copy_path).
  int64_t path = ResolveCopyPath(target.copy_path, opts);
  // Whether the DMA path (auto's or a forced one) can go as rows; worked out once.
  int64_t row_src_pitch = 0, row_dst_pitch = 0;
  const bool at_one_pitch =
      target.rows && (path == kCopyAuto || path == kCopyDma) && LanesAtOnePitch(lanes, &row_src_pitch, &row_dst_pitch);
  // The staged path's plan (host order, runs, segments): built only for a call that stages
  // (auto's rule counts the plan's segments without building it).
  thread_local staged::Plan plan;
  // NOTE: larger copies go staged only in calls >= 64 MiB (below).  Auto builds the staged
  // plan only where the call's size lets the rule hold: a per-layer load of big blocks is
  // planned for the DMA batch alone (the plan cost the first layer of each load).
  constexpr int64_t kStagedMinLargeCopyCallBytes = 64 << 20;
  // Device-to-host rows narrower than rows_d2h_min_bytes write host memory more slowly
  // than the staged path (one DMA per host run): auto lets such calls stage.
  int64_t rows_d2h_min_bytes = 0;
  GetOption("rows_d2h_min_bytes", &rows_d2h_min_bytes);
  const bool large_rows = at_one_pitch && avg_copy_bytes >= opts.dma_min_bytes &&
                          (mode != kDeviceToHost || avg_copy_bytes >= rows_d2h_min_bytes);
  const bool may_stage =
      path == kCopyStaged ||
      (path == kCopyAuto && !large_rows &&
       StagedCallSizeHolds(total_bytes, avg_copy_bytes, opts, kStagedMinLargeCopyCallBytes));
  if (path == kCopyAuto && !may_stage) path = avg_copy_bytes >= opts.dma_min_bytes ? kCopyDma : kCopyKernel;
  if (may_stage) {
    // Auto decides on the plan's segment count: a plan it would turn down is never built.
    // The host ids are sorted once, for the count and the plan.
    thread_local staged::HostOrder host_order;
    staged::SortHostIds(staged::HostIdsOf(src_ids, dst_ids, mode), n, &host_order);
    const bool stage =
        path == kCopyStaged || StagedRuleHolds(total_bytes, avg_copy_bytes,
                                               staged::CountSegments(lanes, host_order, n, mode), opts,
                                               kStagedMinLargeCopyCallBytes);
    if (stage) staged::BuildPlan(lanes, src_ids, dst_ids, n, mode, host_order, &plan);
    if (path == kCopyAuto) {
      // NOTE: larger copies go staged once a call is all-layer sized (>= 64 MiB): the DMA
      // batch pays ~0.5-1 us of host time per copy (a 128 KiB all-layer call: 1.1-1.5 ms
      // against 0.2-0.3 ms staged) and reached 0.94-0.95 one way and 0.87 both ways where
      // staged reached 0.96-0.98 and 1.0.  Per-layer calls of big blocks stay on the DMA
      // batch: each staged call pays its pipeline's fill and drain.  Lanes at one pitch
      // keep large copies on DMA rows at any call size (one 2D copy per run costs about
      // what the staged path's submit does), except device-to-host rows narrower than
      // rows_d2h_min_bytes, which the staged path outruns.  NOTE: the staged gathers cost a
      // forward pass 3-4% while evictions run at full rate; the worker's device-to-host
      // default is therefore `dma` (rows), not auto (docs/architecture.md, "Copy path per
      // direction").
      if (stage && HostSideIsPinned(lanes, mode)) {
        path = kCopyStaged;
      } else {
        path = avg_copy_bytes >= opts.dma_min_bytes ? kCopyDma : kCopyKernel;
      }
    }
  }
  if (path == kCopyDma && !DmaBatchAvailable(stream)) path = kCopyKernel;
  if (path == kCopyStaged) {
    if (HostSideIsPinned(lanes, mode)) return ExecuteStaged(plan, n, mode, stream, opts);
    path = kCopyKernel;  // pageable host memory: the memcpy-per-run fallback below
  }
  // Pageable host memory never reaches the kernel: one cudaMemcpyAsync per run instead
  // (staged by the driver; slow but correct).
  const bool kernel_ok = path != kCopyKernel || HostSideIsPinned(lanes, mode);

  if (path == kCopyDma) {
    if (at_one_pitch && LaunchLaneRows(lanes, runs, row_src_pitch, row_dst_pitch, stream)) {
      return kPathDma | kPathDmaRows;
    }
    thread_local std::vector<Copy> copies;
    copies.clear();
    copies.reserve(static_cast<size_t>(num_copies));
    for (const LaneDesc& l : lanes) {
      for (const Run& r : runs) {
        copies.push_back(Copy{l.dst + r.dst_id * l.dst_stride, l.src + r.src_id * l.src_stride,
                              static_cast<size_t>(r.count * l.bytes)});
      }
    }
    constexpr size_t kRampFirstSliceBytes = 1 << 20;
    LaunchDmaBatch(copies, mode, stream, static_cast<size_t>(opts.dma_slice_bytes), target.ramp ? kRampFirstSliceBytes : 0);
    return kPathDma;
  }

  // Kernel path: long merged runs go to cudaMemcpyAsync (copy engine at full speed, no
  // SMs); everything else is gathered into one kernel launch over all lanes.
  int used = 0;
  thread_local std::vector<int64_t> k_src, k_dst;
  k_src.clear();
  k_dst.clear();
  for (const Run& r : runs) {
    if (!kernel_ok || (mergeable && r.count * min_lane_bytes >= opts.merge_min_bytes)) {
      for (const LaneDesc& l : lanes) {
        FDKV_CUDA_CHECK(cudaMemcpyAsync(l.dst + r.dst_id * l.dst_stride, l.src + r.src_id * l.src_stride,
                                        static_cast<size_t>(r.count * l.bytes), cudaMemcpyDefault, stream));
      }
      used |= kPathMemcpy;
    } else {
      for (int64_t k = 0; k < r.count; ++k) {
        k_src.push_back(r.src_id + k);
        k_dst.push_back(r.dst_id + k);
      }
    }
  }
  if (!k_src.empty()) {
    // Overlapped only right behind the stack's previous kernel: not behind this call's own
    // memcpys of merged runs.
    LaunchKernel(lanes, k_src.data(), k_dst.data(), static_cast<int64_t>(k_src.size()), stream,
                 opts.copy_grid, opts.copy_kernel, opts.kernel_tables != 0,
                 target.after_own_kernel && used == 0);
    used |= kPathKernel;
  }
  return used;
}

void CudaHostAlloc(void** ptr, size_t nbytes, unsigned flags) {
  FDKV_CUDA_CHECK(cudaHostAlloc(ptr, nbytes, flags));
}

void CudaHostFree(void* ptr) { FDKV_CUDA_CHECK(cudaFreeHost(ptr)); }

void CudaHostRegister(void* ptr, size_t nbytes, unsigned flags) {
  FDKV_CUDA_CHECK(cudaHostRegister(ptr, nbytes, flags));
}

void CudaHostUnregister(void* ptr) { FDKV_CUDA_CHECK(cudaHostUnregister(ptr)); }

void CudaStreamSynchronize(void* stream) {
  FDKV_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

int CudaPointerLocation(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // an address CUDA does not know (older runtimes): plain host memory
    return kPointerHost;
  }
  switch (attr.type) {
    case cudaMemoryTypeHost: return kPointerPinnedHost;
    case cudaMemoryTypeDevice: return kPointerDevice;
    case cudaMemoryTypeManaged: return kPointerManaged;
    default: return kPointerHost;
  }
}

void CudaEventRecord(void* event, void* stream) {
  FDKV_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

bool CudaEventDone(void* event) {
  const cudaError_t st = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (st == cudaErrorNotReady) return false;
  if (st != cudaSuccess) (void)cudaGetLastError();  // clear it: the failed copy reports itself
  return true;
}

void CudaStreamWaitEvent(void* stream, void* event) {
  FDKV_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

int CudaCurrentDevice() {
  int device = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void CudaSetDevice(int device) { FDKV_CUDA_CHECK(cudaSetDevice(device)); }

}  // namespace fdkv
