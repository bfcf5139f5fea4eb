// Framework-neutral core of the KV swap ops.
//
// Everything Paddle- or ctypes-specific lives in the bindings (custom_ops/paddle,
// custom_ops/capi); this header is what both of them call.  The core:
//   * validates ids (range, equal lengths, unique destinations) before any byte moves,
//   * plans the copy (merges consecutive src/dst runs, picks a path),
//   * executes it on the CPU (memcpy) or on a CUDA stream (merged cudaMemcpyAsync,
//     a small-grid vectorized copy kernel, or one cudaMemcpyBatchAsync DMA batch).
//
// Build switches: FDKV_WITH_CUDA=1 compiles the CUDA paths (nvcc); without it only the
// CPU paths exist and "device" pointers are host memory.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef FDKV_WITH_CUDA
#define FDKV_WITH_CUDA 0
#endif

namespace fdkv {

enum Mode : int { kDeviceToHost = 0, kHostToDevice = 1 };

// Which copy paths a call used (bit mask; reported by LastPath() for tests/benchmarks).
// kPathDmaRows comes with kPathDma: the DMA path's copies went as one 2D copy per run over
// lanes at one pitch (swap_cuda.cu, LanesAtOnePitch) instead of a batch entry per lane.
enum PathBits : int { kPathMemcpy = 1, kPathKernel = 2, kPathDma = 4, kPathCpu = 8, kPathStaged = 16, kPathDmaRows = 32 };

// copy_path option values.  A per-call override (ExecTarget::copy_path) uses the same
// values, plus kCopyProcess: "use the process-wide copy_path option".
// kCopyStaged: device-side gather/scatter through a device staging ring plus one DMA per
// contiguous host run (swap_staged.cu).
enum CopyPath : int { kCopyProcess = -1, kCopyAuto = 0, kCopyKernel = 1, kCopyDma = 2, kCopyStaged = 3 };

// Bad arguments.  The offending op, argument and index travel as fields (the C ABI hands
// them out as values, fdkv_last_error_fields), and the message repeats them for people:
// "<op>: <argument>[<index>]<detail>" (no "[index]" when index < 0, i.e. not tied to a
// position).  There is no message-only constructor: every bad argument has a name.
class InvalidArgument : public std::runtime_error {
 public:
  InvalidArgument(const std::string& op, const std::string& argument, int64_t index, const std::string& detail)
      : std::runtime_error(op + ": " + argument + (index >= 0 ? "[" + std::to_string(index) + "]" : "") + detail),
        op_(op),
        argument_(argument),
        index_(index) {}
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }
  int64_t index() const { return index_; }  // -1: not tied to a position

 private:
  std::string op_;
  std::string argument_;
  int64_t index_ = -1;
};

// A CUDA runtime call failed (message names the call and the CUDA error string).
class CudaFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One cache tensor: one layer's K or V cache, or a scale cache.  dim 0 is the block.
struct TensorDesc {
  void* dev = nullptr;         // device base (host memory for CPU execution)
  int64_t num_blocks = 0;      // dim 0 of the tensor
  int64_t block_bytes = 0;     // prod(shape[1:]) * itemsize
};

// A list of block ids plus the argument name used in error messages.
struct IdSpan {
  const int64_t* data = nullptr;
  int64_t size = 0;
  const char* name = "";
};

// Where and how to run.
struct ExecTarget {
  bool cuda = false;       // false: CPU memcpy (CPU tensors, or a build without CUDA)
  void* stream = nullptr;  // cudaStream_t when cuda
  bool sync = false;       // synchronize the stream before returning
  // Per-call copy path (CopyPath): kCopyProcess follows the process-wide option, the
  // others override it for this call only.  NOTE: per call, not process-wide, because the
  // worker issues loads and evictions from two launcher threads at once and wants them on
  // different paths.  Validated (CheckCopyPath) with the other arguments; ignored by the
  // CPU implementation, which has one path.
  int copy_path = kCopyProcess;
  // Start a DMA batch with small slices, doubling (LaunchDmaBatch): the first group of a
  // layer stack, whose event the forward pass waits for before anything else runs.
  bool ramp = false;
  // Whether the DMA path may move lanes at one pitch as 2D rows.  false: one batch entry
  // per lane (a layer stack's span of several groups, RunStackJob: a few lanes per group,
  // where rows are slower than the batch).
  bool rows = true;
  // The stream's last work before this call is a copy kernel of the same layer stack (with
  // only group events recorded after it), whose bytes this call does not touch: a copy
  // kernel launched here may start while that one drains (programmatic dependent launch,
  // sm_90).  Set by RunStackJob for a span that follows a span on the kernel.
  bool after_own_kernel = false;
};

// Throws InvalidArgument ("<op>: path = <v> must be ...") unless -1 <= copy_path <= 3.
void CheckCopyPath(const char* op, int64_t copy_path);

// Process-wide tunables: defaults from measurements, set through the C ABI (fdkv_set_option;
// docs/ops.md, "Options").  The process environment is not read.
struct Options {
  int64_t copy_grid;        // max CTAs of the copy kernel
  int64_t copy_path;        // CopyPath
  int64_t dma_min_bytes;    // auto picks DMA when copies are >= this
  int64_t merge_min_bytes;  // merged runs >= this use cudaMemcpyAsync
  int64_t copy_kernel;      // kernel variant (0 streaming warp, 1 nc+L2 256B
                            // prefetch warp, 2 default-cached warp, 3 bulk-copy/TMA pipeline)
  int64_t dma_slice_bytes;  // bytes per cudaMemcpyBatchAsync call
  int64_t kernel_tables;    // 0 kernel reads id tables from a device
                            // copy, 1 straight from pinned host memory (no extra memcpy)
  // Staged path (swap_staged.cu).
  int64_t staging_bytes;        // device staging ring per direction
  int64_t staging_chunk_bytes;  // bytes per pipelined chunk (one ring slot)
  int64_t staging_grid;         // max CTAs of the gather/scatter kernel
  int64_t staged_min_bytes;     // auto picks staged when host runs average >= this
};
// The current values (the defaults until SetOption changes one).
Options GetOptions();
// The path a call's copy_path stands for: kCopyProcess resolves to the process-wide option.
inline int64_t ResolveCopyPath(int copy_path, const Options& opts) {
  return copy_path == kCopyProcess ? opts.copy_path : copy_path;
}
// Returns false if the name is unknown or the value out of the option's range.
bool SetOption(const std::string& name, int64_t value);
bool GetOption(const std::string& name, int64_t* value);

// Bit mask of PathBits used by the calling thread's last swap.
int LastPath();

// How a swap's arguments are named in errors: the Paddle ops and the C ABI name them
// differently, and an error must name the argument the caller actually passed.
struct ArgNames {
  const char* tensors = "cache_gpu_tensors";  // the cache tensors (Paddle)
  bool index_tensors = true;                  // false: the one tensor of a per-layer op
  // The C ABI passes a tensor as three arrays; a problem names the array it is in.  Null:
  // `tensors` for all three.
  const char* tensor_ptrs = nullptr;
  const char* tensor_blocks = nullptr;
  const char* tensor_bytes = nullptr;
  const char* host_ptr = "cache_cpu_ptrs";       // the host pointer(s)
  bool index_host_ptr = true;                    // false: one host pointer
  const char* host_count = "max_block_num_cpu";  // the host block count
};
// The Paddle ops' names: `tensors` is cache_gpu (per-layer, not indexed) or
// cache_gpu_tensors; `host_ptr` cache_cpu_ptr (not indexed) or cache_cpu_ptrs.
ArgNames PaddleArgNames(const char* tensors, const char* host_ptr);
// The C ABI's names: dev_ptrs / num_dev_blocks / block_bytes, `host_ptr` host_ptrs
// (indexed) or host_ptr, num_host_blocks.
ArgNames CapiArgNames(const char* host_ptr);

// Per-tensor block copy: tensor t's block dev_ids[i] <-> host_ptrs[t] block host_ids[i].
// mode kDeviceToHost copies device -> host, kHostToDevice the reverse.  Host block size
// of tensor t equals its device block size.
//
// num_host_blocks bounds the host ids.  -1 means "the size HostAlloc recorded for the
// pointer" (an error for memory HostAlloc did not make: nothing would bound the ids).  A
// count >= 0 is checked against that recorded size too when the pointer is known.
void SwapLayers(const char* op, const std::vector<TensorDesc>& tensors,
                const std::vector<void*>& host_ptrs, int64_t num_host_blocks,
                IdSpan dev_ids, IdSpan host_ids, int mode, const ExecTarget& target,
                const ArgNames& names = ArgNames{});

// How far a SwapLayerGroups call has got: the number of groups whose copies and event are
// enqueued, for a consumer on another thread that must not wait on an event before it is
// recorded (a wait on an unrecorded event is a no-op).  One object per call.
class GroupProgress {
 public:
  void Advance(int64_t done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = done;
    }
    cv_.notify_all();
  }
  // The call failed at `group` (-1: before any group); the first failure is kept.
  void Fail(int64_t group = -1, const std::string& error = std::string()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) {
        failed_ = true;
        failed_group_ = group;
        error_ = error;
      }
    }
    cv_.notify_all();
  }
  // Every stream operation of the call is enqueued (its done event included), or it failed
  // and nothing more will be; `paths` is the union of the PathBits its groups used.
  void Close(int paths) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      paths_ |= paths;
    }
    cv_.notify_all();
  }
  // Groups done, or -1 once the call failed; blocks until >= at_least, failure or timeout.
  int64_t Wait(int64_t at_least, int64_t timeout_us) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::microseconds(timeout_us < 0 ? 0 : timeout_us),
                 [&] { return failed_ || done_ >= at_least; });
    return failed_ ? -1 : done_;
  }
  // Whether the call is closed; blocks until it is or the timeout passes.
  bool WaitClosed(int64_t timeout_us) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::microseconds(timeout_us < 0 ? 0 : timeout_us), [&] { return closed_; });
  }
  struct State {
    int64_t done;
    bool failed;
    bool closed;
    int paths;
    int64_t failed_group;
  };
  State Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return State{done_, failed_, closed_, paths_, failed_group_};
  }
  // The failure's message ("" if none).  Stable once failed: the first failure is kept.
  const char* Error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_.c_str();
  }
  // Shared by its creator and an asynchronous launch (LaunchLayerStack) that advances it
  // after the creator may have let go.  Starts at one reference.
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  static void Unref(GroupProgress* p) {
    if (p != nullptr && p->refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete p;
  }

 private:
  std::atomic<int> refs_{1};
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t done_ = 0;
  bool failed_ = false;
  bool closed_ = false;
  int paths_ = 0;
  int64_t failed_group_ = -1;
  std::string error_;
};

// Layer-by-layer copy in one call: `tensors` are num_groups groups of `group_size`
// consecutive tensors (one layer's K, V and scale caches), every tensor moves the same ids,
// and after group g's copies are enqueued an event is recorded on the stream
// (events[g]; null: none).  Why one call: a per-layer loop from Python pays ctypes,
// validation and the GIL per layer, and a loader thread that shares the GIL with the
// forward pass's launches falls behind the link (docs/ops.md, "Layer groups").  Everything
// is validated before the first byte moves; a CUDA failure in group g names the group.
// `events` is null or holds num_events == num_groups entries (cudaEvent_t); a CPU target
// takes no events.  Which paths ran: LastPath(), the union over the groups.  `progress`
// (optional) advances after each group and fails if the call throws.
void SwapLayerGroups(const char* op, const std::vector<TensorDesc>& tensors,
                     const std::vector<void*>& host_ptrs, int64_t num_host_blocks, int64_t group_size,
                     IdSpan dev_ids, IdSpan host_ids, int mode, const ExecTarget& target,
                     void* const* events, int64_t num_events, GroupProgress* progress = nullptr,
                     const ArgNames& names = ArgNames{});

// The stream operations a launched layer stack (LaunchLayerStack) enqueues around its
// groups, in this order on the target stream: a wait on each of `waits`, `start_event`,
// the groups with their events, `done_event` (cudaEvent_t handles; null: none).
struct StackFences {
  std::vector<void*> waits;
  void* start_event = nullptr;
  void* done_event = nullptr;
};

// A thread that enqueues launched layer stacks in launch order (stack_launcher.cc).
class StackLauncher;
StackLauncher* NewStackLauncher();
// Enqueues what is still queued, then stops the thread.
void DeleteStackLauncher(StackLauncher* launcher);
// Whether every launched stack is wholly enqueued; waits up to timeout_us for it.
bool StackLauncherWaitIdle(StackLauncher* launcher, int64_t timeout_us);

// SwapLayerGroups with its fences, enqueued asynchronously.  Everything is checked on the
// calling thread first: a bad argument throws InvalidArgument with nothing enqueued (the
// progress then fails and closes).  Then, in launch order on target.stream: with a
// `launcher` that is idle, the fences and the first `inline_groups` groups are enqueued
// on the calling thread, the rest on the launcher's thread; a busy launcher takes the
// whole stack behind the stacks it holds; with no launcher the calling thread enqueues it
// all.  `progress` (required) advances per group and closes once done_event is recorded;
// a CUDA failure in group g fails it naming the group (later groups are not enqueued) and
// still records done_event, so a fence on it stays valid.
// Why: a load's first copy used to wait 0.5-0.9 ms for the Python side to hand the stack
// to a launcher thread and convert its arguments (docs/ops.md, "Measured costs"),
// and the forward pass waits for that first copy.
void LaunchLayerStack(StackLauncher* launcher, const char* op, const std::vector<TensorDesc>& tensors,
                      const std::vector<void*>& host_ptrs, int64_t num_host_blocks, int64_t group_size,
                      IdSpan dev_ids, IdSpan host_ids, int mode, const ExecTarget& target, void* const* events,
                      int64_t num_events, GroupProgress* progress, const StackFences& fences,
                      int64_t inline_groups, const ArgNames& names = ArgNames{});

// Block-major layout copy: host block h is one contiguous object holding every tensor's
// block in tensor order: [h][t][block_bytes[t]].  num_host_blocks: as in SwapLayers.
void SwapLayout(const char* op, const std::vector<TensorDesc>& tensors, void* host_ptr,
                int64_t num_host_blocks, IdSpan dev_ids, IdSpan host_ids, int mode,
                const ExecTarget& target,
                const ArgNames& names = PaddleArgNames("cache_gpu_tensors", "cache_cpu_ptr"));

// Reads file i (paths[i]) into headers[i * header_bytes ...] then dsts[i] (dst_bytes[i]
// bytes), for a storage object of a header and a payload; got[i] is the bytes read, up to
// header_bytes + dst_bytes[i] + 1 (one more: the file is longer than both), or -errno.
// Nothing is verified here (file_io.cc).
void ReadFiles(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
               void* headers, int64_t header_bytes, int64_t* got);
// ReadFiles that also hashes each payload as it lands, in reads of step_bytes: digests[i] is
// xxh3-64 chained over piece_bytes pieces of dsts[i] (each seeded with the previous piece's
// hash), hashed[i] 1 where the whole buffer was filled (else 0 and digests[i] unset).
// Throws (std::runtime_error) where built without xxHash (HaveHashedRead() false).
void ReadFilesHashed(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                     void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes, int64_t* got,
                     uint64_t* digests, int32_t* hashed);
bool HaveHashedRead();
// The hashed read over `n` NUL-terminated paths back to back in path_blob (blob_bytes
// long), each payload read straight into segs_per_object segments: object i's segment k is
// segs[i * segs_per_object + k], of seg_bytes[k] bytes (shared_lengths != 0) or
// seg_bytes[i * segs_per_object + k].  Hashes exactly as ReadFilesHashed over the
// concatenated segments.  states[i]: 0 not filled, 1 filled and hashed, 2 that and the
// header is the file backend's for this payload, version check_version, checksum equal
// (check_version 0: never 2), 3 (size_first != 0 only) the file is not a regular file of
// header_bytes + the payload's size (fstat): nothing read.  ReadFilesHashed is its one-segment case.
void ReadObjects(const char* path_blob, int64_t blob_bytes, int64_t n, void* const* segs, const int64_t* seg_bytes,
                 int64_t segs_per_object, int32_t shared_lengths, void* headers, int64_t header_bytes,
                 int64_t piece_bytes, int64_t step_bytes, int32_t check_version, int32_t size_first, int64_t* got,
                 uint64_t* digests, int32_t* states);
// How many of the n paths in path_blob (as ReadObjects), from the first, are regular files
// (stat: a symlink to one counts, a directory does not).
int64_t FilesExist(const char* path_blob, int64_t blob_bytes, int64_t n);

// Pinned host memory: anonymous pages faulted in by `threads` threads (<= 0: HostPinThreads)
// and, with CUDA, registered (cudaHostRegister) as one range; cudaHostAlloc only for
// write-combined memory.  Without CUDA, resident pages from mmap.  Every allocation's size
// is recorded (HostBytesFrom) so swaps can bound host ids; HostFree rejects a pointer it
// did not hand out (a double free is an error, not heap corruption).  Pages read as zero.
void* HostAlloc(size_t nbytes, unsigned flags);
void* HostAlloc(size_t nbytes, unsigned flags, int threads);
// Address space for nbytes (zero pages, none resident, nothing pinned): HostPinRanges pins
// parts of it while the rest waits, so one base pointer addresses a buffer pinned piecewise.
void* HostReserve(size_t nbytes);
// Make [base + offsets[i], + lengths[i]) resident and (CUDA) registered, each range rounded
// out to whole pages; pages pinned by an earlier call are skipped (never touched twice, so
// a page that already holds data is left alone).  `device` >= 0: the calling thread's CUDA
// device first.  Returns the bytes newly pinned.  HostFree unregisters every range.
int64_t HostPinRanges(void* base, const int64_t* offsets, const int64_t* lengths, int64_t n, int threads,
                      int device);
// Threads HostAlloc faults pages in with by default: the hardware threads, at most 16.
int HostPinThreads();
void HostFree(void* ptr);
// Bytes from `p` to the end of the HostAlloc allocation holding it; -1 if none holds it.
int64_t HostBytesFrom(const void* p);

bool BuiltWithCuda();
void StreamSynchronize(void* stream);
// Where `p` points, so that a caller about to hand an address to a file read (which only
// host memory can take) can check it: kPointerHost (ordinary host memory, or anything on a
// CPU build), kPointerPinnedHost (page-locked: cudaHostAlloc / cudaHostRegister),
// kPointerDevice, kPointerManaged.
enum PointerLocationKind { kPointerHost = 0, kPointerPinnedHost = 1, kPointerDevice = 2, kPointerManaged = 3 };
int PointerLocation(const void* p);

// ---------------------------------------------------------------- internals, exposed
// for the CUDA translation unit and unit-level reuse.

// One copy "lane": a tensor as seen from the source and destination side.  Block k of
// the source starts at src + k * src_stride; block k of the destination at
// dst + k * dst_stride; each copy moves `bytes`.
struct LaneDesc {
  const char* src;
  char* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t bytes;
};

// A maximal run of consecutive pairs: src_id..src_id+count-1 -> dst_id..dst_id+count-1.
struct Run {
  int64_t src_id;
  int64_t dst_id;
  int64_t count;
};

// The end (exclusive) of a layer stack's span that starts at group `g`: groups join it
// while it holds fewer than `span_min_bytes` (option stack_span_min_bytes) and the next is
// below `limit`.  One rule for both ways a stack goes: RunStackJob's batches or launches
// and ExecuteCudaGroups' staged chunk ends.  `group_bytes(k)`: the bytes group k moves.
template <typename GroupBytes>
int64_t SpanEnd(int64_t g, int64_t limit, int64_t span_min_bytes, const GroupBytes& group_bytes) {
  int64_t end = g + 1;
  for (int64_t bytes = group_bytes(g); end < limit && bytes < span_min_bytes; ++end) bytes += group_bytes(end);
  return end;
}

// One layer stack, checked and copied (ids, lanes, handles), ready to be enqueued in parts
// (RunStackJob): what LaunchLayerStack queues and SwapLayerGroups runs at once.
struct StackJob {
  std::string op;
  std::vector<LaneDesc> lanes;  // every group's, group-major
  std::vector<int64_t> src_ids, dst_ids;
  int mode = kHostToDevice;
  ExecTarget target;
  int64_t group_size = 1;
  int device = -1;  // the launching thread's CUDA device (the launcher thread takes it on)
  std::vector<void*> events;  // per group; empty: none
  GroupProgress* progress = nullptr;  // one reference held while queued
  StackFences fences;
  // The groups from `staged_from` on may go as one staged pipeline (enqueued in one part);
  // the ones before it go group by group (option staged_stack_from_group).
  bool may_stage = false;
  int64_t staged_from = 1;
  // The path of a span of several groups (RunStackJob): kCopyDma or kCopyKernel, the path
  // the first group on the call's own path took (span_decided once it ran); kCopyProcess:
  // a span per group.
  int span_path = kCopyProcess;
  bool span_decided = false;
  bool started = false;    // fences before the groups enqueued
  int64_t next_group = 0;  // groups enqueued so far
  int64_t landed = 0;      // groups whose event the launcher saw complete (launch_lead_bytes)
  int paths = 0;
  // Bytes group g moves.
  int64_t GroupBytes(int64_t g) const {
    int64_t b = 0;
    for (int64_t t = g * group_size; t < (g + 1) * group_size; ++t) b += lanes[static_cast<size_t>(t)].bytes;
    return b * static_cast<int64_t>(src_ids.size());
  }
  ~StackJob() { GroupProgress::Unref(progress); }
};
// Enqueues the job's next part: its leading fences, then up to `max_groups` groups, then (at
// the end) its done event.  Returns true once the job is finished (closed, or failed and
// closed).  With `rethrow` a failure is rethrown after the progress records it.  With `pace`
// (the launcher's own thread) a group is enqueued only while the groups enqueued ahead of it
// and not yet landed hold at most `launch_lead_bytes` (option; why: that option).
bool RunStackJob(StackJob& job, int64_t max_groups, bool rethrow, bool pace = false);
// Hands a job to a launcher (stack_launcher.cc): see LaunchLayerStack.
void LauncherEnqueue(StackLauncher* launcher, std::unique_ptr<StackJob> job, int64_t inline_groups);

// Merge consecutive (src, dst) pairs into runs.  O(n).
std::vector<Run> PlanRuns(const int64_t* src_ids, const int64_t* dst_ids, int64_t n);

// Validate ids; throws InvalidArgument naming op, argument and index.  O(n) time,
// O(num destination blocks / 8) scratch for the duplicate check.
void ValidateIds(const char* op, IdSpan dev_ids, int64_t num_dev_blocks, IdSpan host_ids,
                 int64_t num_host_blocks, int mode);

#if FDKV_WITH_CUDA
// Run a planned copy on a CUDA stream (swap_cuda.cu).  `mergeable` says whether a run of
// consecutive ids is contiguous on both sides for every lane (false for the layout op).
// The target's stream, copy_path, ramp, rows and after_own_kernel say where and how
// (ExecTarget).
int ExecuteCuda(const std::vector<LaneDesc>& lanes, const int64_t* src_ids,
                const int64_t* dst_ids, int64_t n, bool mergeable, int mode, const ExecTarget& target);
void CudaHostAlloc(void** ptr, size_t nbytes, unsigned flags);
void CudaHostFree(void* ptr);
void CudaHostRegister(void* ptr, size_t nbytes, unsigned flags);
void CudaHostUnregister(void* ptr);
void CudaStreamSynchronize(void* stream);
// PointerLocation on a CUDA build (cudaPointerGetAttributes; an address CUDA does not know
// is ordinary host memory).
int CudaPointerLocation(const void* p);
void CudaEventRecord(void* event, void* stream);
// Whether the event's work has completed (cudaEventQuery); an error also reads as done, so a
// caller polling it cannot spin forever (the copy that failed reports through its own path).
bool CudaEventDone(void* event);
void CudaStreamWaitEvent(void* stream, void* event);
int CudaCurrentDevice();
void CudaSetDevice(int device);
// Whether ExecuteCudaGroups might take a stack of this shape as one staged pipeline (its
// checks that need no plan); false: the stack goes group by group.
bool StackMayStage(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids, int64_t n,
                   int copy_path);
// A whole layer stack (SwapLayerGroups) as one staged pipeline, where the call's path is
// staged, or auto and the stack's host side merges into runs: every lane moves n blocks,
// lanes [g * group_size, (g + 1) * group_size) are group g, and on_group(g, stream) runs
// once group g's copies are enqueued (the stream to record its event on).  Chunks end at
// span ends (option stack_span_min_bytes; with `first_alone` the first group is a span of
// its own).  Returns the path bits, or 0 when the stack should go group by group instead
// (nothing enqueued).
int ExecuteCudaGroups(const std::vector<LaneDesc>& lanes, const int64_t* src_ids, const int64_t* dst_ids,
                      int64_t n, int mode, void* stream, int copy_path, int64_t group_size, bool first_alone,
                      const std::function<void(int64_t, void*)>& on_group);
#endif

}  // namespace fdkv
