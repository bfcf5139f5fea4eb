// Staged copy path: device-side gather/scatter through a bounded device staging ring,
// plus one contiguous DMA per host run (split at chunk boundaries).
//
// Why: a DMA per block per layer pays ~1 us per copy in the copy engines and ~1 us of host
// time per copy to submit, and a zero-copy kernel holds SMs for the whole transfer and
// reaches only ~0.73 of the link in both directions at once.  Here the scattered side
// (device blocks) is handled by a short kernel at HBM speed, and the link only ever sees
// large contiguous copies, one per run of consecutive host blocks of one tensor (or of
// all tensors at once for the block-major layout op).
//
// Pipeline (a "virtual" byte stream in host order is cut into chunks, one ring slot each):
//   D2H: gather chunk c into slot (side stream) -> event -> DMA slot -> host (caller's
//        stream) -> slot-free event.  Chunk 0 runs entirely on the caller's stream so the
//        link does not wait for a cross-stream hop at the start of a call.
//   H2D: DMA host -> slot (caller's stream) -> event -> scatter slot -> device blocks (side
//        stream) -> slot-free event.  The last chunk is scattered on the caller's stream,
//        and the caller's stream joins the side stream before the call returns, so work
//        queued after the op on that stream sees every byte (the ops' stream contract).
// Chunk sizes ramp (256 KiB, 1 MiB, 4 MiB, then the configured chunk; reversed for H2D)
// so the part of a call that cannot overlap is small.
//
// The ring is per device and per direction: one cudaMalloc at first use, reused by every
// call; a slot is rewritten only after the event recorded behind its last reader, so
// concurrent callers on other streams are safe (a mutex orders their submissions).
// Host submit cost: O(host runs x tensors + chunks) copies/launches, O(n log n) to sort.
//
// Included by swap_cuda.cu (single translation unit); uses its WarpCopy, FDKV_CUDA_CHECK,
// ScratchRing and LaunchDmaBatch.

#include <functional>
#include <iterator>
#include <type_traits>

namespace fdkv {
namespace staged {

constexpr int kStThreads = 512;            // 16 warps per CTA
constexpr int64_t kPiece = 8192;           // one warp work item: an 8 KiB slice of a block
constexpr int kMaxSmemLanes = 1000;        // lane table in shared memory up to 48 KB
constexpr int64_t kChunkAlign = 4096;      // chunk boundaries (keeps 16-byte vectors aligned)
constexpr int kMaxSlots = 64;              // ring slots at most (events made up front)
constexpr int kMaxSpares = 16;             // ring buffers set aside by resizes at most

// Device-side lane (tensor) table entry.
struct SLane {
  char* dev;           // device base of the tensor
  int64_t dev_stride;  // bytes between device blocks
  int64_t bytes;       // bytes per block
  int64_t pieces;      // ceil(bytes / kPiece)
  int64_t pp;          // pieces per item of the lanes before this one
  int64_t boff;        // block bytes of the lanes before this one
};

struct Geometry {
  int num_lanes;
  int64_t n;            // blocks (pairs) per lane
  int block_major;      // 1: staging order [block][lane], 0: [lane][block]
  int64_t sum_bytes;    // sum of lane block bytes
  int64_t sum_pieces;   // sum of lane pieces
};

// Largest lane l with key(l) <= x; key strictly increasing, key(0) == 0.
__device__ __forceinline__ int FindLane(const SLane* lanes, int num_lanes, int64_t x, int64_t mul) {
  int lo = 0, hi = num_lanes - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (lanes[mid].pp * mul <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Small calls (a per-layer load: a few lanes, up to a few hundred ids) pass their tables
// inside the kernel parameters (__grid_constant__: read in place, no per-thread copy), so
// they need no table copy and no scratch slot: two fewer API calls on the hot path.
constexpr int kInlineLanes = 4;
constexpr int kInlineIds = 224;  // with the lanes: ~2 KB of the 4 KB parameter space
struct InlineTables {
  SLane lanes[kInlineLanes];
  int64_t ids[kInlineIds];
};
struct TablePtrs {
  const SLane* lanes;
  const int64_t* ids;
};
__device__ __forceinline__ const SLane* LanesOf(const InlineTables& t) { return t.lanes; }
__device__ __forceinline__ const int64_t* IdsOf(const InlineTables& t) { return t.ids; }
__device__ __forceinline__ const SLane* LanesOf(const TablePtrs& t) { return t.lanes; }
__device__ __forceinline__ const int64_t* IdsOf(const TablePtrs& t) { return t.ids; }

// Copies the bytes of virtual range [v0, v1) between device blocks and the staging slot.
// Work items are pieces (8 KiB slices of one block of one lane) in virtual order; piece q0
// holds v0 and q1 holds v1 - 1.
template <typename V, bool kToStaging, typename Tables>
__global__ void __launch_bounds__(kStThreads)
StagedCopyKernel(const __grid_constant__ Tables tables, Geometry geo, char* __restrict__ staging, int64_t v0,
                 int64_t v1, int64_t q0, int64_t q1, int lanes_in_smem) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SLane* lanes = LanesOf(tables);
  const int64_t* dev_ids = IdsOf(tables);
  if (lanes_in_smem) {
    SLane* s = reinterpret_cast<SLane*>(smem_raw);
    for (int i = threadIdx.x; i < geo.num_lanes; i += blockDim.x) s[i] = lanes[i];
    __syncthreads();
    lanes = s;
  }
  const int lane_id = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t q = q0 + warp; q <= q1; q += num_warps) {
    int l;
    int64_t k, p, voff;
    if (geo.block_major) {
      k = q / geo.sum_pieces;
      const int64_t r = q - k * geo.sum_pieces;
      l = FindLane(lanes, geo.num_lanes, r, 1);
      p = r - lanes[l].pp;
      voff = k * geo.sum_bytes + lanes[l].boff + p * kPiece;
    } else {
      l = FindLane(lanes, geo.num_lanes, q, geo.n);
      const int64_t r = q - geo.n * lanes[l].pp;
      k = r / lanes[l].pieces;
      p = r - k * lanes[l].pieces;
      voff = geo.n * lanes[l].boff + k * lanes[l].bytes + p * kPiece;
    }
    const int64_t len = min(kPiece, lanes[l].bytes - p * kPiece);
    const int64_t begin = max(voff, v0);
    const int64_t end = min(voff + len, v1);
    if (begin >= end) continue;
    char* d = lanes[l].dev + dev_ids[k] * lanes[l].dev_stride + p * kPiece + (begin - voff);
    char* s = staging + (begin - v0);
    const int64_t nv = (end - begin) / static_cast<int64_t>(sizeof(V));
    if (kToStaging) {
      WarpCopy<V, kWarpStreaming>(reinterpret_cast<const V*>(d), reinterpret_cast<V*>(s), nv, lane_id);
    } else {
      WarpCopy<V, kWarpStreaming>(reinterpret_cast<const V*>(s), reinterpret_cast<V*>(d), nv, lane_id);
    }
  }
}

// ------------------------------------------------------------------------ the ring
struct StagingRing {
  std::mutex mu;
  char* buf = nullptr;
  int64_t ring_bytes = 0;
  int64_t slot_bytes = 0;
  int slots = 0;
  int cursor = 0;
  std::vector<cudaEvent_t> slot_free;    // recorded behind the slot's last reader
  std::vector<cudaStream_t> freed_on;    // the stream slot_free was last recorded on
  std::vector<cudaEvent_t> slot_ready;   // recorded behind the slot's producer
  cudaStream_t side = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t side_done = nullptr;
  // cudaMalloc'd rings set aside by a resize, by size: reused when that size comes back.
  // NOTE: never cudaFree'd: cudaFree synchronizes the whole device, which would stall every
  // stream (and deadlock behind a stream that waits on the host).  Only option changes
  // (tests, benchmarks) resize, so this holds a handful of buffers at most.
  struct Spare {
    char* buf;
    size_t bytes;
    cudaEvent_t idle;  // recorded on the side stream behind the buffer's last users
  };
  std::vector<Spare> spares;
  std::vector<cudaEvent_t> idle_events;  // unused spare events (all made at first use)

  // (Re)size to want_ring bytes in slots of at most want_chunk bytes.  Called with mu held.
  // NOTE: a resize never synchronizes the device or the host: the old buffer is set aside
  // behind every slot's last user (an event on the side stream), and each slot's free event
  // is re-recorded on the side stream behind the new one.
  void Ensure(int64_t want_ring, int64_t want_chunk) {
    // At most kMaxSlots slots: a smaller chunk request gets ring / kMaxSlots bytes.
    int64_t slot = std::max(std::min(want_chunk, want_ring / 2), (want_ring + kMaxSlots - 1) / kMaxSlots);
    slot = std::max<int64_t>(kChunkAlign, (slot + kChunkAlign - 1) / kChunkAlign * kChunkAlign);
    const int count = static_cast<int>(std::max<int64_t>(2, std::min<int64_t>(kMaxSlots, want_ring / slot)));
    if (buf != nullptr && slot == slot_bytes && count == slots) return;
    if (side == nullptr) {
      // NOTE: every event the ring will ever use is created here, at first use, so no call
      // after the first creates CUDA objects (a bounded ring: kMaxSlots slots).
      FDKV_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
      FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&side_done, cudaEventDisableTiming));
      for (int i = 0; i < kMaxSlots; ++i) {
        cudaEvent_t f, r;
        FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&f, cudaEventDisableTiming));
        FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&r, cudaEventDisableTiming));
        slot_free.push_back(f);
        slot_ready.push_back(r);
        freed_on.push_back(nullptr);
      }
      for (int i = 0; i < kMaxSpares; ++i) {
        cudaEvent_t e;
        FDKV_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        idle_events.push_back(e);
      }
    }
    if (buf != nullptr) {
      for (cudaEvent_t e : slot_free) FDKV_CUDA_CHECK(cudaStreamWaitEvent(side, e, 0));
      if (idle_events.empty()) throw CudaFailure("fdkv: staging ring resized too many times (spare buffers)");
      cudaEvent_t idle = idle_events.back();
      idle_events.pop_back();
      FDKV_CUDA_CHECK(cudaEventRecord(idle, side));
      spares.push_back(Spare{buf, static_cast<size_t>(ring_bytes), idle});
      buf = nullptr;
    }
    const size_t bytes = static_cast<size_t>(slot * count);
    for (size_t i = 0; i < spares.size() && buf == nullptr; ++i) {
      if (spares[i].bytes == bytes) {
        buf = spares[i].buf;
        FDKV_CUDA_CHECK(cudaStreamWaitEvent(side, spares[i].idle, 0));
        idle_events.push_back(spares[i].idle);
        spares.erase(spares.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    if (buf == nullptr) FDKV_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), bytes));
    for (size_t i = 0; i < slot_free.size(); ++i) {
      FDKV_CUDA_CHECK(cudaEventRecord(slot_free[i], side));
      freed_on[i] = side;
    }
    slot_bytes = slot;
    slots = count;
    ring_bytes = slot * count;
    cursor = 0;
  }

  // Make `stream` wait until slot i is free (skipped when it was freed on `stream` itself:
  // stream order already covers it).
  void WaitFree(int i, cudaStream_t stream) {
    if (freed_on[static_cast<size_t>(i)] != stream) {
      FDKV_CUDA_CHECK(cudaStreamWaitEvent(stream, slot_free[static_cast<size_t>(i)], 0));
    }
  }
  void MarkFree(int i, cudaStream_t stream) {
    FDKV_CUDA_CHECK(cudaEventRecord(slot_free[static_cast<size_t>(i)], stream));
    freed_on[static_cast<size_t>(i)] = stream;
  }
};

StagingRing& RingFor(int mode) {
  constexpr int kMaxDevices = 64;
  static StagingRing* rings[kMaxDevices][2] = {};
  static std::mutex mu;
  int dev = 0;
  FDKV_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) throw CudaFailure("fdkv: device ordinal out of range");
  std::lock_guard<std::mutex> lock(mu);
  // NOTE: like the scratch ring, never destroyed (no CUDA calls from static destructors).
  StagingRing*& r = rings[dev][mode == kDeviceToHost ? 0 : 1];
  if (r == nullptr) r = new StagingRing();
  return *r;
}

// ------------------------------------------------------------------------ planning
struct Seg {
  char* host;
  int64_t voff;
  int64_t bytes;
};

struct Plan {
  Geometry geo{};
  std::vector<SLane> lanes;
  std::vector<int64_t> dev_ids;  // device id of item k (host order)
  std::vector<Seg> segs;         // contiguous host ranges in virtual order
  int64_t total = 0;
  int width = 16;

  // Piece index holding virtual byte v (v < total).
  int64_t PieceAt(int64_t v) const {
    const int L = geo.num_lanes;
    if (geo.block_major) {
      const int64_t k = v / geo.sum_bytes;
      const int64_t r = v - k * geo.sum_bytes;
      int l = 0;
      while (l + 1 < L && lanes[l + 1].boff <= r) ++l;
      return k * geo.sum_pieces + lanes[l].pp + (r - lanes[l].boff) / kPiece;
    }
    int lo = 0, hi = L - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (geo.n * lanes[mid].boff <= v) lo = mid;
      else hi = mid - 1;
    }
    const SLane& s = lanes[lo];
    const int64_t r = v - geo.n * s.boff;
    const int64_t k = r / s.bytes;
    return geo.n * s.pp + k * s.pieces + (r - k * s.bytes) / kPiece;
  }
};

// A lane's host side: its base and block stride.
inline char* HostBase(const LaneDesc& d, bool d2h) { return d2h ? d.dst : const_cast<char*>(d.src); }
inline int64_t HostStride(const LaneDesc& d, bool d2h) { return d2h ? d.dst_stride : d.src_stride; }

// Block-major host layout (the layout op): lane l of host block h sits at
// base + h * sum_bytes + (bytes of the lanes before l), so a run of host blocks is
// contiguous across lanes.
bool HostIsBlockMajor(const std::vector<LaneDesc>& lanes, bool d2h) {
  const size_t L = lanes.size();
  if (L <= 1) return false;
  int64_t sum = 0;
  for (const LaneDesc& d : lanes) sum += d.bytes;
  int64_t boff = 0;
  for (const LaneDesc& d : lanes) {
    if (HostStride(d, d2h) != sum || HostBase(d, d2h) != HostBase(lanes.front(), d2h) + boff) return false;
    boff += d.bytes;
  }
  return true;
}

// A call's pairs in host-id order (`order`, stable) and the runs of consecutive host ids
// in that order as (first k, length).  Made once per call (SortHostIds) and read by both
// auto's segment count and the plan, which used to sort the ids once each.
struct HostOrder {
  std::vector<int64_t> order;
  std::vector<std::pair<int64_t, int64_t>> runs;
};

// The host side's ids of (src_ids, dst_ids) in `mode`.
inline const int64_t* HostIdsOf(const int64_t* src_ids, const int64_t* dst_ids, int mode) {
  return mode == kDeviceToHost ? dst_ids : src_ids;
}

void SortHostIds(const int64_t* host_ids, int64_t n, HostOrder* out) {
  std::vector<int64_t>& order = out->order;
  order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  bool sorted = true;
  for (int64_t i = 1; i < n && sorted; ++i) sorted = host_ids[i - 1] <= host_ids[i];
  if (!sorted) {
    std::stable_sort(order.begin(), order.end(), [host_ids](int64_t a, int64_t b) { return host_ids[a] < host_ids[b]; });
  }
  out->runs.clear();
  int64_t prev = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t h = host_ids[order[static_cast<size_t>(k)]];
    if (!out->runs.empty() && prev + 1 == h) {
      ++out->runs.back().second;
    } else {
      out->runs.emplace_back(k, 1);
    }
    prev = h;
  }
}

// The number of host segments BuildPlan would make for these pairs, without making them:
// auto's staged rule needs only the count, and a call it turns down (fully scattered host
// ids: a segment per block per lane) spent ~0.1-0.2 ms of its submit building the segments
// of a plan it then dropped (docs/ops.md, "auto").
int64_t CountSegments(const std::vector<LaneDesc>& lanes, const HostOrder& host_order, int64_t n, int mode) {
  const bool d2h = mode == kDeviceToHost;
  const int64_t num_runs = static_cast<int64_t>(host_order.runs.size());
  if (HostIsBlockMajor(lanes, d2h)) return num_runs;
  int64_t segs = 0;
  for (const LaneDesc& d : lanes) segs += HostStride(d, d2h) == d.bytes ? num_runs : n;
  return segs;
}

// Builds the plan: sorts pairs by host id (longest runs), finds the host runs and the
// contiguous host segments.  Lanes use the device side as "dev" and the host side as host.
// `host_order`: SortHostIds of these pairs' host ids.
void BuildPlan(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids, int64_t n,
               int mode, const HostOrder& host_order, Plan* plan) {
  const bool d2h = mode == kDeviceToHost;
  const int64_t* dev_ids = d2h ? src_ids : dst_ids;
  const int64_t* host_ids = HostIdsOf(src_ids, dst_ids, mode);
  const std::vector<int64_t>& order = host_order.order;
  const std::vector<std::pair<int64_t, int64_t>>& runs = host_order.runs;
  plan->dev_ids.resize(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) plan->dev_ids[static_cast<size_t>(k)] = dev_ids[order[static_cast<size_t>(k)]];

  const int L = static_cast<int>(lanes.size());
  plan->lanes.resize(lanes.size());
  int64_t pp = 0, boff = 0;
  uint64_t bits = 0;
  for (int l = 0; l < L; ++l) {
    const LaneDesc& d = lanes[static_cast<size_t>(l)];
    char* dev = d2h ? const_cast<char*>(d.src) : d.dst;
    const int64_t dev_stride = d2h ? d.src_stride : d.dst_stride;
    const int64_t pieces = (d.bytes + kPiece - 1) / kPiece;
    plan->lanes[static_cast<size_t>(l)] = SLane{dev, dev_stride, d.bytes, pieces, pp, boff};
    bits |= reinterpret_cast<uintptr_t>(dev) | static_cast<uint64_t>(dev_stride) | static_cast<uint64_t>(d.bytes);
    pp += pieces;
    boff += d.bytes;
  }
  plan->width = 1;
  for (int w : {16, 8, 4, 2}) {
    if ((bits & static_cast<uint64_t>(w - 1)) == 0) {
      plan->width = w;
      break;
    }
  }
  const bool block_major = HostIsBlockMajor(lanes, d2h);
  plan->geo = Geometry{L, n, block_major ? 1 : 0, boff, pp};
  plan->total = boff * n;

  plan->segs.clear();
  if (block_major) {
    for (const auto& r : runs) {
      const int64_t h = host_ids[order[static_cast<size_t>(r.first)]];
      plan->segs.push_back(Seg{HostBase(lanes.front(), d2h) + h * boff, r.first * boff, r.second * boff});
    }
  } else {
    for (int l = 0; l < L; ++l) {
      const LaneDesc& d = lanes[static_cast<size_t>(l)];
      const SLane& s = plan->lanes[static_cast<size_t>(l)];
      const int64_t stride = HostStride(d, d2h);
      for (const auto& r : runs) {
        if (stride == s.bytes) {
          const int64_t h = host_ids[order[static_cast<size_t>(r.first)]];
          plan->segs.push_back(Seg{HostBase(d, d2h) + h * s.bytes, n * s.boff + r.first * s.bytes, r.second * s.bytes});
        } else {
          for (int64_t j = 0; j < r.second; ++j) {
            const int64_t h = host_ids[order[static_cast<size_t>(r.first + j)]];
            plan->segs.push_back(Seg{HostBase(d, d2h) + h * stride, n * s.boff + (r.first + j) * s.bytes, s.bytes});
          }
        }
      }
    }
  }
}

template <bool kToStaging, typename Tables>
void LaunchChunk(const Plan& plan, const Tables& tables, char* slot, int64_t v0, int64_t v1, int64_t grid_cap,
                 cudaStream_t stream) {
  const int64_t q0 = plan.PieceAt(v0);
  const int64_t q1 = plan.PieceAt(v1 - 1);
  const int64_t warps = q1 - q0 + 1;
  const int64_t per_cta = kStThreads / 32;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(grid_cap, (warps + per_cta - 1) / per_cta)));
  constexpr bool kInline = std::is_same<Tables, InlineTables>::value;
  const int in_smem = (!kInline && plan.geo.num_lanes <= kMaxSmemLanes) ? 1 : 0;
  const size_t smem = in_smem ? static_cast<size_t>(plan.geo.num_lanes) * sizeof(SLane) : 0;
  const Geometry g = plan.geo;
  switch (plan.width) {
    case 16: StagedCopyKernel<int4, kToStaging, Tables><<<grid, kStThreads, smem, stream>>>(tables, g, slot, v0, v1, q0, q1, in_smem); break;
    case 8: StagedCopyKernel<long long, kToStaging, Tables><<<grid, kStThreads, smem, stream>>>(tables, g, slot, v0, v1, q0, q1, in_smem); break;
    case 4: StagedCopyKernel<int, kToStaging, Tables><<<grid, kStThreads, smem, stream>>>(tables, g, slot, v0, v1, q0, q1, in_smem); break;
    case 2: StagedCopyKernel<short, kToStaging, Tables><<<grid, kStThreads, smem, stream>>>(tables, g, slot, v0, v1, q0, q1, in_smem); break;
    default: StagedCopyKernel<char, kToStaging, Tables><<<grid, kStThreads, smem, stream>>>(tables, g, slot, v0, v1, q0, q1, in_smem); break;
  }
  FDKV_CUDA_CHECK(cudaGetLastError());
}

// The DMA copies of chunk [v0, v1): every segment part inside it.  `si` walks forward.
void IssueChunkDma(const Plan& plan, size_t* si, char* slot, int64_t v0, int64_t v1, int mode,
                   cudaStream_t stream, bool batch) {
  thread_local std::vector<Copy> copies;
  copies.clear();
  size_t i = *si;
  while (i < plan.segs.size() && plan.segs[i].voff < v1) {
    const Seg& s = plan.segs[i];
    const int64_t begin = std::max(v0, s.voff);
    const int64_t end = std::min(v1, s.voff + s.bytes);
    if (begin < end) {
      char* host = s.host + (begin - s.voff);
      char* st = slot + (begin - v0);
      if (mode == kDeviceToHost) copies.push_back(Copy{host, st, static_cast<size_t>(end - begin)});
      else copies.push_back(Copy{st, host, static_cast<size_t>(end - begin)});
    }
    if (s.voff + s.bytes <= v1) ++i;
    else break;  // the segment continues in the next chunk
  }
  *si = i;
  // NOTE: cudaMemcpyBatchAsync even for one copy: measured on H100 (docs/ops.md, "Measured costs"),
  // 4 MiB copies back to back reached 0.96 of the link through the batch API against 0.93
  // as separate cudaMemcpyAsync calls.  The legacy default stream cannot take a batch.
  if (!batch || !DmaBatchAvailable(stream)) {
    for (const Copy& c : copies) {
      FDKV_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream));
    }
  } else {
    LaunchDmaBatch(copies, mode, stream, ~static_cast<size_t>(0) >> 1);
  }
}

// Chunk boundaries.  The end of the pipeline that cannot overlap (the first gather for D2H,
// the last scatter for H2D) gets a small chunk, and sizes grow 4x from there up to a slot:
// the next chunk's gather (at HBM speed, >10x the link) is ready before the current
// chunk's DMA ends.  A call of one chunk runs on the caller's stream alone.
void PlanChunks(int64_t total, int64_t slot, int mode, std::vector<int64_t>* bounds,
                const std::vector<int64_t>* cuts = nullptr) {
  thread_local std::vector<int64_t> sizes;
  sizes.clear();
  int64_t left = total;
  int64_t next = std::min<int64_t>(slot, int64_t(1) << 20);
  while (left > 0) {
    const int64_t s = std::min(left, next);
    sizes.push_back(s);
    left -= s;
    next = std::min(slot, next * 4);
  }
  if (mode == kHostToDevice) std::reverse(sizes.begin(), sizes.end());
  bounds->clear();
  bounds->push_back(0);
  for (int64_t s : sizes) bounds->push_back(bounds->back() + s);
  if (cuts != nullptr && !cuts->empty()) {
    // A layer stack: no chunk straddles a span's end (GroupMarks::cuts), so each group's
    // event follows the chunk that completes it, at most a span later.  (Group ends are
    // multiples of every lane's block size, so the vector width still divides every
    // boundary.)
    thread_local std::vector<int64_t> merged;
    merged.clear();
    std::merge(bounds->begin(), bounds->end(), cuts->begin(), cuts->end(), std::back_inserter(merged));
    merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
    while (!merged.empty() && merged.back() > total) merged.pop_back();
    bounds->swap(merged);
  }
}

// A layer stack's group ends (virtual offsets, ascending; the last is the total), the ends
// its chunks must stop at (`cuts`: span ends, a subset of `ends` holding the total), and
// what to do once a group's last chunk is enqueued: `done(g, stream)` records group g's
// event on the stream that ran the step of the chunk that completes the group.
struct GroupMarks {
  std::vector<int64_t> ends;
  std::vector<int64_t> cuts;
  std::function<void(int64_t, cudaStream_t)> done;
};

}  // namespace staged

// Staged execution of a plan (staged::BuildPlan) on `stream` (see the file comment).
// Returns kPathStaged.
int ExecuteStaged(const staged::Plan& plan, int64_t n, int mode, cudaStream_t stream, const Options& opts,
                  const staged::GroupMarks* marks = nullptr) {
  using namespace staged;
  if (plan.total <= 0) {
    if (marks != nullptr) {
      for (size_t g = 0; g < marks->ends.size(); ++g) marks->done(static_cast<int64_t>(g), stream);
    }
    return kPathStaged;
  }

  StagingRing& ring = RingFor(mode);
  std::lock_guard<std::mutex> ring_lock(ring.mu);
  int64_t staging_mode = 0;
  GetOption("staging_mode", &staging_mode);
  const bool batch = (staging_mode & 1) == 0;
  ring.Ensure(opts.staging_bytes, opts.staging_chunk_bytes);
  // Chunk boundaries must keep 16-byte vectors aligned: slot sizes are 4 KiB multiples.
  thread_local std::vector<int64_t> bounds;
  PlanChunks(plan.total, ring.slot_bytes, mode, &bounds, marks != nullptr ? &marks->cuts : nullptr);
  const size_t num_chunks = bounds.size() - 1;

  const bool use_side = num_chunks > 1;
  const bool d2h = mode == kDeviceToHost;
  const int64_t grid = opts.staging_grid;
  cudaStream_t side = ring.side;

  // Runs the pipeline with `near` tables (read by kernels on the caller's stream) and `far`
  // tables (kernels on the side stream).
  auto pipeline = [&](const auto& near, const auto& far) {
    if (use_side && d2h) {  // gathers read device blocks: after the stream's earlier work
      FDKV_CUDA_CHECK(cudaEventRecord(ring.start, stream));
      FDKV_CUDA_CHECK(cudaStreamWaitEvent(side, ring.start, 0));
    }
    size_t si = 0;
    size_t next_group = 0;
    // Group events behind the chunk that completes each group (layer stacks only).
    auto mark_groups = [&](int64_t v1, cudaStream_t s) {
      if (marks == nullptr) return;
      while (next_group < marks->ends.size() && marks->ends[next_group] <= v1) {
        marks->done(static_cast<int64_t>(next_group), s);
        ++next_group;
      }
    };
    for (size_t c = 0; c < num_chunks; ++c) {
      const int64_t v0 = bounds[c], v1 = bounds[c + 1];
      const int slot_idx = ring.cursor;
      ring.cursor = (ring.cursor + 1) % ring.slots;
      char* slot = ring.buf + static_cast<int64_t>(slot_idx) * ring.slot_bytes;
      cudaEvent_t slot_ready = ring.slot_ready[static_cast<size_t>(slot_idx)];
      if (d2h) {
        if (c == 0) {  // gather on the caller's stream: no hop before the first DMA
          ring.WaitFree(slot_idx, stream);
          LaunchChunk<true>(plan, near, slot, v0, v1, grid, stream);
        } else {
          ring.WaitFree(slot_idx, side);
          LaunchChunk<true>(plan, far, slot, v0, v1, grid, side);
          FDKV_CUDA_CHECK(cudaEventRecord(slot_ready, side));
          FDKV_CUDA_CHECK(cudaStreamWaitEvent(stream, slot_ready, 0));
        }
        IssueChunkDma(plan, &si, slot, v0, v1, mode, stream, batch);
        ring.MarkFree(slot_idx, stream);
        mark_groups(v1, stream);
      } else {
        ring.WaitFree(slot_idx, stream);
        IssueChunkDma(plan, &si, slot, v0, v1, mode, stream, batch);
        if (c + 1 == num_chunks) {  // the last scatter on the caller's stream: no hop at the end
          LaunchChunk<false>(plan, near, slot, v0, v1, grid, stream);
          ring.MarkFree(slot_idx, stream);
          if (marks != nullptr && use_side) {
            // The groups this chunk completes may have earlier chunks scattered on the side
            // stream: their events must cover those too.
            FDKV_CUDA_CHECK(cudaEventRecord(ring.side_done, side));
            FDKV_CUDA_CHECK(cudaStreamWaitEvent(stream, ring.side_done, 0));
          }
          mark_groups(v1, stream);
        } else {
          FDKV_CUDA_CHECK(cudaEventRecord(slot_ready, stream));
          FDKV_CUDA_CHECK(cudaStreamWaitEvent(side, slot_ready, 0));
          LaunchChunk<false>(plan, far, slot, v0, v1, grid, side);
          ring.MarkFree(slot_idx, side);
          mark_groups(v1, side);
        }
      }
    }
    // H2D: work queued on `stream` after the op must see every scatter, so the caller's
    // stream joins the side stream.  (D2H needs no join: each DMA on `stream` already
    // waited for its gather.)
    if (use_side && !d2h) {
      FDKV_CUDA_CHECK(cudaEventRecord(ring.side_done, side));
      FDKV_CUDA_CHECK(cudaStreamWaitEvent(stream, ring.side_done, 0));
    }
  };

  if (plan.lanes.size() <= static_cast<size_t>(kInlineLanes) && n <= kInlineIds) {
    InlineTables t;
    std::memset(&t, 0, sizeof(t));
    std::copy(plan.lanes.begin(), plan.lanes.end(), t.lanes);
    std::copy(plan.dev_ids.begin(), plan.dev_ids.end(), t.ids);
    pipeline(t, t);
    return kPathStaged;
  }

  // Larger tables: lane table + device ids in a pinned scratch slot.  Kernels on the
  // caller's stream read them there (zero copy: no extra copy ahead of them on the critical
  // stream); kernels on the side stream read a device copy made on the side stream.
  const size_t lane_bytes = AlignUp(plan.lanes.size() * sizeof(SLane), 16);
  const size_t ids_bytes = static_cast<size_t>(n) * sizeof(int64_t);
  const size_t table_bytes = lane_bytes + AlignUp(ids_bytes, 16);
  ScratchRing& scratch = RingForCurrentDevice();
  ScratchSlot* tables = scratch.Acquire(table_bytes);
  try {
    std::memcpy(tables->host, plan.lanes.data(), plan.lanes.size() * sizeof(SLane));
    std::memcpy(tables->host + lane_bytes, plan.dev_ids.data(), ids_bytes);
    const TablePtrs near{reinterpret_cast<const SLane*>(tables->host),
                         reinterpret_cast<const int64_t*>(tables->host + lane_bytes)};
    const TablePtrs far{reinterpret_cast<const SLane*>(tables->dev),
                        reinterpret_cast<const int64_t*>(tables->dev + lane_bytes)};
    if (use_side) {
      FDKV_CUDA_CHECK(cudaMemcpyAsync(tables->dev, tables->host, table_bytes, cudaMemcpyHostToDevice, side));
    }
    pipeline(near, far);
    if (use_side && d2h) {  // the scratch slot's release below is recorded on `stream`
      FDKV_CUDA_CHECK(cudaEventRecord(ring.side_done, side));
      FDKV_CUDA_CHECK(cudaStreamWaitEvent(stream, ring.side_done, 0));
    }
  } catch (...) {
    scratch.Release(tables, stream);
    throw;
  }
  scratch.Release(tables, stream);
  return kPathStaged;
}

}  // namespace fdkv
