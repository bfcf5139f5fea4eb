// C ABI of the fastdeploy_kvcache swap ops (see docs/ops.md).  All pointers are raw
// addresses: device memory with the CUDA build, host memory with the CPU build.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define FDKV_API __attribute__((visibility("default")))

// Status codes.  On failure fdkv_last_error() returns the calling thread's message, and
// for FDKV_ERR_INVALID_ARGUMENT fdkv_last_error_fields() the op, argument and index as
// values (nothing was written).  Both stay valid until the thread's next fdkv_* call.
#define FDKV_OK 0
#define FDKV_ERR_INVALID_ARGUMENT 1
#define FDKV_ERR_CUDA 2
#define FDKV_ERR_OTHER 3
#define FDKV_ERR_NO_MEMORY 4

#ifdef __cplusplus
extern "C" {
#endif

FDKV_API const char* fdkv_last_error(void);
// The calling thread's last status code; *op / *argument (may be "") and *index (-1: not
// tied to a position) describe an FDKV_ERR_INVALID_ARGUMENT.  Any out pointer may be null.
FDKV_API int fdkv_last_error_fields(const char** op, const char** argument, int64_t* index);
// Reset the calling thread's last error to FDKV_OK (the Paddle ops report through it too).
FDKV_API void fdkv_clear_error(void);
FDKV_API int fdkv_is_cuda(void);
FDKV_API int fdkv_host_alloc(size_t nbytes, unsigned flags, void** out);
FDKV_API int fdkv_host_free(void* ptr);
// Address space for a host buffer that is pinned piece by piece (nothing resident yet);
// fdkv_host_free releases it.  The size is recorded as fdkv_host_alloc's is.
FDKV_API int fdkv_host_reserve(size_t nbytes, void** out);
// Make n byte ranges [base + offsets[i], + lengths[i]) of a reserved (or allocated) buffer
// resident and pinned, each rounded out to pages; already pinned pages are skipped.
// threads <= 0: fdkv_host_pin_threads(); device >= 0: cudaSetDevice on the calling thread
// first (CPU build: ignored).  *pinned (may be null): bytes newly pinned.
FDKV_API int fdkv_host_pin_ranges(void* base, const int64_t* offsets, const int64_t* lengths, int64_t n,
                                  int threads, int device, int64_t* pinned);
// Threads the pinning faults pages in with by default.
FDKV_API int fdkv_host_pin_threads(void);

// ABI version: 2 added the trailing `path` argument of the swap functions; 3 the error
// fields (fdkv_last_error_fields, fdkv_clear_error), FDKV_ERR_NO_MEMORY and
// num_host_blocks = -1 (the size fdkv_host_alloc recorded); 4 fdkv_read_files; 5 fdkv_swap_layer_groups;
// 6 fdkv_launch_layer_groups, the launcher and the progress state; 7 fdkv_host_reserve,
// fdkv_host_pin_ranges, fdkv_host_pin_threads (pinned memory is registered, not cudaHostAlloc'd).  fastdeploy_kvcache/ops
// checks it, so a library built from older sources fails loudly instead of misbehaving.
#define FDKV_ABI_VERSION 7
FDKV_API int fdkv_abi_version(void);

// Tensor t's block dev_ids[i] <-> host_ptrs[t]'s block host_ids[i], every tensor.
// num_host_blocks bounds host_ids; -1 takes it from the size fdkv_host_alloc recorded for
// the pointer (FDKV_ERR_INVALID_ARGUMENT for other memory), and a count larger than a
// recorded buffer is refused.
// mode 0: device -> host, 1: host -> device.  Enqueued on `stream`; sync != 0 waits.
// path: copy path of this call only: -1 the process-wide "copy_path" option, 0 auto,
// 1 kernel, 2 dma (anything else is FDKV_ERR_INVALID_ARGUMENT naming "path").  A forced
// dma falls back to the kernel on the legacy default stream or before CUDA 12.8.  The
// CPU build validates it and ignores it (one path: memcpy).
FDKV_API int fdkv_swap_layers(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptrs,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path);

// Layer by layer in one call: the num_tensors tensors are groups of group_size consecutive
// tensors (a layer's K, V, scales); each group moves the same ids as fdkv_swap_layers
// would, and events[g] (a cudaEvent_t, or null) is recorded on `stream` right after group
// g's copies.  events may be null with num_events 0; otherwise num_events must equal
// num_tensors / group_size.  The CPU build takes no events.  All arguments are checked
// before any copy; a CUDA failure names the group (earlier groups stay enqueued).
// progress (from fdkv_progress_create, or null) advances to g + 1 once group g's copies and
// event are enqueued, and is marked failed if the call fails: another thread waits on it
// with fdkv_progress_wait before it waits on events[g] (an unrecorded event is no fence).
FDKV_API int fdkv_swap_layer_groups(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                                    const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptrs,
                                    int64_t num_host_blocks, int64_t group_size, const int64_t* dev_ids,
                                    int64_t num_dev_ids, const int64_t* host_ids, int64_t num_host_ids, int mode,
                                    void* stream, void* const* events, int64_t num_events, void* progress,
                                    int sync, int path);

// One progress object per fdkv_swap_layer_groups call.  fdkv_progress_wait blocks (up to
// timeout_us) until at least `at_least` groups are enqueued or the call failed, then sets
// *done to the groups enqueued, or -1 if the call failed.
// fdkv_progress_destroy drops the caller's reference (a launched stack holds its own until
// it is closed).
FDKV_API int fdkv_progress_create(void** out);
FDKV_API int fdkv_progress_destroy(void* progress);
FDKV_API int fdkv_progress_wait(void* progress, int64_t at_least, int64_t timeout_us, int64_t* done);
// Closed: every stream operation of the call is enqueued (a launched stack's done event
// included), or it failed and nothing more will be.  Waits up to timeout_us.
FDKV_API int fdkv_progress_wait_closed(void* progress, int64_t timeout_us, int* closed);
// A snapshot: groups done, failed, closed, the PathBits its groups used, and the group that
// failed (-1: before any group).  Any out pointer may be null.
FDKV_API int fdkv_progress_state(void* progress, int64_t* done, int* failed, int* closed, int* paths,
                                 int64_t* failed_group);
// The failure's message ("" if none); valid while the progress object lives.
FDKV_API const char* fdkv_progress_error(void* progress);
// For a caller that will not launch the call after all: fails and closes the progress
// with `error`, unless it is closed already.
FDKV_API int fdkv_progress_abandon(void* progress, const char* error);

// A thread that enqueues launched layer stacks in launch order.  Destroy enqueues what is
// still queued first; fdkv_launcher_wait_idle waits up to timeout_us until every stack
// launched so far is wholly enqueued (*idle = 1) or the timeout passes (*idle = 0).
FDKV_API int fdkv_launcher_create(void** out);
FDKV_API int fdkv_launcher_destroy(void* launcher);
FDKV_API int fdkv_launcher_wait_idle(void* launcher, int64_t timeout_us, int* idle);

// fdkv_swap_layer_groups without waiting for the copies to be enqueued: everything is
// checked on the calling thread (a bad argument fails the call and the progress, nothing
// enqueued); then, on `stream` in launch order: a wait on each of waits[0..num_waits)
// (cudaEvent_t), start_event (null: none), the groups with events[g], done_event (null:
// none).  With an idle `launcher`, the calling thread enqueues the fences and the first
// inline_groups groups itself and the launcher's thread the rest; a busy launcher queues
// the whole stack; a null launcher enqueues everything on the calling thread.  progress is
// required: it advances per group and closes once done_event is recorded; a CUDA failure
// fails it (fdkv_progress_error names the group), records done_event still, and closes it.
// The ids and handles are copied, but the events themselves (waits, start, done, per group)
// must stay alive until the progress is closed: the launcher may enqueue them later.
// The CPU build takes no events and copies on the enqueuing thread.
FDKV_API int fdkv_launch_layer_groups(void* launcher, const char* op, void* const* dev_ptrs,
                                      const int64_t* num_dev_blocks, const int64_t* block_bytes, int64_t num_tensors,
                                      void* const* host_ptrs, int64_t num_host_blocks, int64_t group_size,
                                      const int64_t* dev_ids, int64_t num_dev_ids, const int64_t* host_ids,
                                      int64_t num_host_ids, int mode, void* stream, void* const* events,
                                      int64_t num_events, void* progress, void* const* waits, int64_t num_waits,
                                      void* start_event, void* done_event, int path, int64_t inline_groups);

// Block-major host buffer host_ptr[0]: host block h = [tensor 0 block | tensor 1 block | ...].
FDKV_API int fdkv_swap_layout(const char* op, void* const* dev_ptrs, const int64_t* num_dev_blocks,
                              const int64_t* block_bytes, int64_t num_tensors, void* const* host_ptr,
                              int64_t num_host_blocks, const int64_t* dev_ids, int64_t num_dev_ids,
                              const int64_t* host_ids, int64_t num_host_ids, int mode, void* stream,
                              int sync, int path);

// Options (docs/ops.md, "Options"): "copy_grid", "copy_path" (0 auto, 1 kernel, 2 dma,
// 3 staged), "dma_min_bytes", "merge_min_bytes", "dma_slice_bytes", "copy_kernel",
// "kernel_tables", the staged path's, the layer stacks'.  Process-wide, from their defaults;
// the only way to change one (the environment is not read).  A swap call's `path`
// argument overrides "copy_path" for that call.
FDKV_API int fdkv_set_option(const char* name, int64_t value);
FDKV_API int fdkv_get_option(const char* name, int64_t* value);
// Batch file read for the file storage backend: file i's first header_bytes bytes go to
// headers + i * header_bytes, the next dst_bytes[i] to dsts[i]; got[i] is the bytes read
// (header_bytes + dst_bytes[i] + 1 means the file is longer than both) or -errno (the
// file could not be opened or read).  Holds no lock of the caller's (ctypes drops the GIL).
FDKV_API int fdkv_read_files(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                             void* headers, int64_t header_bytes, int64_t* got);
// fdkv_read_files that also checksums each payload while reading it, step_bytes at a time:
// digests[i] = xxh3-64 chained over piece_bytes pieces of dsts[i] (piece k seeded with piece
// k-1's hash, the first with 0), hashed[i] = 1 where the whole buffer was filled, else 0.
// The objects are read on up to the read_threads option's threads, the caller's among them
// (each with at least read_thread_min_bytes of payload); it returns when all are done.
// Where fdkv_has_hashed_read() == 0 (built without xxHash's header, or a CPU without
// AVX-512 F and BW) it fails with FDKV_ERR_OTHER.  Neither function is covered by FDKV_ABI_VERSION: look both up by name.
FDKV_API int fdkv_read_files_hashed(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                                    void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes,
                                    int64_t* got, uint64_t* digests, int32_t* hashed);
FDKV_API int fdkv_has_hashed_read(void);
// The hashed read with its payloads scattered: the n paths are NUL-terminated strings back
// to back in path_blob (blob_bytes long: one buffer, no array of pointers to build); object
// i's payload goes to segs_per_object segments, segment k at segs[i * segs_per_object + k]
// of seg_bytes[k] bytes (shared_lengths != 0: the same lengths for every object) or of
// seg_bytes[i * segs_per_object + k], filled in order with preadv iovecs.  The checksum is
// the same as fdkv_read_files_hashed's over the concatenated segments (pieces may span
// segments).  states[i] = 0 where the payload was not filled, 1 filled and hashed, 2 that
// and the header is the file backend's object header (magic "FDKV", u16 version ==
// check_version, u16 header bytes == header_bytes, u64 payload bytes == the segments'
// total, u64 checksum == digests[i]) with nothing past the payload; check_version 0 checks
// nothing (never 2).  size_first != 0 fstats each file first and reads nothing from one that
// is not a regular file of header_bytes + the payload's size: states[i] = 3, got[i] = 0,
// the segments untouched (an fstat per object).  Same threads and failure as
// fdkv_read_files_hashed.  Look it up by name.
FDKV_API int fdkv_read_objects(const char* path_blob, int64_t blob_bytes, int64_t n, void* const* segs,
                               const int64_t* seg_bytes, int64_t segs_per_object, int32_t shared_lengths,
                               void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes,
                               int32_t check_version, int32_t size_first, int64_t* got, uint64_t* digests,
                               int32_t* states);
// *count = how many of the n paths in path_blob (as fdkv_read_objects), from the first, are
// regular files (stat, so a symlink to a file counts; a directory or a missing path ends
// the count).  Holds no lock of the caller's.  Look it up by name.
FDKV_API int fdkv_files_exist(const char* path_blob, int64_t blob_bytes, int64_t n, int64_t* count);
// *location = where ptr points: 0 ordinary host memory (always, on the CPU build), 1 page-locked
// host memory (cudaHostAlloc / cudaHostRegister), 2 device memory, 3 managed memory.  The
// storage transfer checks its host tier with it before reading files straight into it (a
// file read cannot target device memory).  Look it up by name.
FDKV_API int fdkv_pointer_location(const void* ptr, int32_t* location);
// Bit mask of the paths the calling thread's last swap used: 1 memcpy, 2 kernel, 4 DMA, 8 CPU,
// 16 staged, 32 (with 4) DMA as 2D rows over tensors at one pitch.
FDKV_API int fdkv_last_path(void);
FDKV_API int fdkv_stream_synchronize(void* stream);

#ifdef __cplusplus
}
#endif
