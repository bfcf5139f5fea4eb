// Batch file reads for the storage tier's file backend (fdkv_read_files in the C ABI).
//
// Why native: a prefetch reads one file per KV block (64 KiB to a few MiB), and in Python
// each costs an open, a preadv and a close plus the interpreter's bookkeeping around them,
// all under the GIL between the syscalls.  Here a whole batch is one call that holds no
// Python lock, so the engine thread and the server's event loop keep running while a
// prefetch reads.  Verification (header, checksum) stays with the caller.
//
// ReadObjects also computes each payload's checksum (the file backend's format: xxh3-64
// chained over fixed pieces) while it reads, one step of the payload at a time, so each step
// is hashed right after it lands, while it is still in the CPU cache: hashing it later, from
// memory, costs several times as much.  Its destination is a list of segments per object
// (one for a contiguous buffer, one per layer tensor for a host-tier block, read without a
// staging copy), and it compares each header with what it read, so the caller handles only
// the failures.  ReadFilesHashed is its one-segment case; FilesExist is the existence check.  Built only where xxHash's header is installed
// (Debian: libxxhash-dev); without it the call reports FDKV_ERR_OTHER and the caller hashes.
//
// NOTE: xxh3 picks its vector code at compile time, and without -mavx2 that is SSE2, which
// hashed at about a third of the rate of python-xxhash's AVX2 code: slower than hashing in
// Python afterwards.  So on x86-64 the hashing code is compiled for AVX2 (a target pragma,
// not a build flag: the rest of the library keeps running anywhere), and HaveHashedRead()
// says no on a CPU without AVX2 (the caller then hashes in Python).  The CUDA build leaves
// it out (the file backend loads the CPU build for reads).
#if !defined(__CUDACC__) && defined(__has_include)
#if __has_include(<xxhash.h>)
#define FDKV_HAVE_XXHASH 1
#endif
#endif
#ifndef FDKV_HAVE_XXHASH
#define FDKV_HAVE_XXHASH 0
#endif
// Every system header comes before the target pragma below: a header first included inside
// it compiles its always-inline wrappers (glibc's _FORTIFY_SOURCE versions of open, memcpy,
// ...) for AVX-512, and then no ordinary function may call them ("target specific option
// mismatch"; Ubuntu's gcc turns _FORTIFY_SOURCE on by default).
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "swap_core.h"

#if FDKV_HAVE_XXHASH
#if defined(__x86_64__)
#include <immintrin.h>  // xxhash.h includes it only under -mavx2 / -mavx512f
#pragma GCC push_options
#pragma GCC diagnostic push
// GCC 12's AVX-512 intrinsics trip it on their own deliberately undefined operands.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx2")
#define FDKV_XXH_X86 1
#define XXH_VECTOR 3  // XXH_AVX512 (the pragma does not define __AVX512F__, which xxhash.h tests)
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

namespace fdkv {

namespace {

// One preadv at `offset`, retried on EINTR: bytes read, 0 at the end of the file, or -errno.
// *asked gets the bytes the iovecs ask for.
int64_t Preadv(int fd, const struct iovec* iov, int count, off_t offset, size_t* asked) {
  *asked = 0;
  for (int k = 0; k < count; ++k) *asked += iov[k].iov_len;
  for (;;) {
    const ssize_t r = preadv(fd, iov, count, offset);
    if (r >= 0) return r;
    if (errno != EINTR) return -static_cast<int64_t>(errno);
  }
}

// preadv until the iovecs are full or the file ends; returns bytes read or -errno.  A read
// that comes back short once at least `enough` bytes are in is taken as the end of the file:
// a regular file reads short only there, and asking again would cost every object a second
// preadv that returns 0 (a read short of `enough` is still confirmed that way).
int64_t ReadFully(int fd, struct iovec* iov, int count, int64_t enough) {
  int64_t total = 0;
  off_t offset = 0;
  while (count > 0) {
    size_t asked = 0;
    const int64_t r = Preadv(fd, iov, count, offset, &asked);
    if (r < 0) return r;
    if (r == 0) break;  // end of file
    total += r;
    offset += r;
    if (static_cast<size_t>(r) < asked && total >= enough) break;
    size_t left = static_cast<size_t>(r);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return total;
}

// Checks shared by both batch reads; throws InvalidArgument naming the bad argument.
void CheckReadArgs(const char* op, const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                   void* headers, int64_t header_bytes, int64_t* got) {
  if (n < 0) throw InvalidArgument(op, "n", -1, " = " + std::to_string(n) + " must be >= 0");
  if (header_bytes < 0) {
    throw InvalidArgument(op, "header_bytes", -1, " = " + std::to_string(header_bytes) + " must be >= 0");
  }
  if (n == 0) return;
  if (paths == nullptr) throw InvalidArgument(op, "paths", -1, " is a null pointer");
  if (dsts == nullptr) throw InvalidArgument(op, "dsts", -1, " is a null pointer");
  if (dst_bytes == nullptr) throw InvalidArgument(op, "dst_bytes", -1, " is a null pointer");
  if (got == nullptr) throw InvalidArgument(op, "got", -1, " is a null pointer");
  if (header_bytes > 0 && headers == nullptr) throw InvalidArgument(op, "headers", -1, " is a null pointer");
  for (int64_t i = 0; i < n; ++i) {
    if (paths[i] == nullptr) throw InvalidArgument(op, "paths", i, " is a null pointer");
    if (dst_bytes[i] < 0) {
      throw InvalidArgument(op, "dst_bytes", i, " = " + std::to_string(dst_bytes[i]) + " must be >= 0");
    }
    if (dst_bytes[i] > 0 && dsts[i] == nullptr) throw InvalidArgument(op, "dsts", i, " is a null pointer");
  }
}

// Where one object's payload goes: `count` segments, segs[k] of lens[k] bytes, filled in
// order (one segment: a contiguous buffer; several: the blocks of one layer-major host-tier
// block, each segment one layer's tensor).
struct ObjectDst {
  void* const* segs;
  const int64_t* lens;
  int64_t count;
  int64_t size;  // the segments' total
};

// A position in an ObjectDst's payload: segment `seg`, `off` bytes into it.  Kept on a
// segment with bytes left (or at `count`, the end), so Span() never yields an empty iovec.
struct SegCursor {
  int64_t seg = 0;
  int64_t off = 0;
  void Advance(const ObjectDst& d, int64_t bytes) {
    while (bytes > 0 && seg < d.count) {
      const int64_t left = d.lens[seg] - off;
      if (bytes < left) {
        off += bytes;
        return;
      }
      bytes -= left;
      ++seg;
      off = 0;
    }
  }
  char* At(const ObjectDst& d) const { return static_cast<char*>(d.segs[seg]) + off; }
  int64_t Left(const ObjectDst& d) const { return d.lens[seg] - off; }
};

// At most this many payload iovecs per preadv (IOV_MAX is 1024); a step spanning more
// segments is read in several preadvs.
constexpr int kMaxPayloadIov = 64;

#if FDKV_HAVE_XXHASH
// Reads one object (header, then the payload in steps of `step` bytes, then one byte past
// it) and hashes the payload as it lands: xxh3-64 over each `piece` bytes, each piece
// seeded with the previous one's hash (streamed xxh3 equals the one-call hash, so a piece
// that spans segments hashes as if contiguous).  Returns the bytes read or -errno;
// *digest is set only when the whole payload was filled.
int64_t ReadHashedOne(int fd, char* header, int64_t header_bytes, const ObjectDst& dst, int64_t piece,
                      int64_t step, XXH3_state_t* state, uint64_t* digest, int32_t* hashed) {
  const int64_t size = dst.size;
  char past_end = 0;
  int64_t off = 0;     // file bytes read so far (the next read's offset)
  int64_t done = 0;    // payload bytes in place
  int64_t fed = 0;     // payload bytes hashed
  int64_t in_piece = 0;
  SegCursor rd, hs;    // where `done` and `fed` are in the segments
  XXH64_hash_t seed = 0;
  XXH3_64bits_reset_withSeed(state, seed);
  *hashed = 0;
  for (;;) {
    struct iovec iov[kMaxPayloadIov + 2];
    int count = 0;
    if (off < header_bytes) iov[count++] = {header + off, static_cast<size_t>(header_bytes - off)};
    int64_t end = done;
    if (done < size) {
      const int64_t want = done + step < size ? done + step : size;
      SegCursor c = rd;
      for (int k = 0; k < kMaxPayloadIov && end < want; ++k) {
        const int64_t left = c.Left(dst);
        const int64_t take = want - end < left ? want - end : left;
        iov[count++] = {c.At(dst), static_cast<size_t>(take)};
        end += take;
        c.Advance(dst, take);
      }
    }
    if (end == size) iov[count++] = {&past_end, 1};
    size_t asked = 0;
    const int64_t r = Preadv(fd, iov, count, off, &asked);
    if (r < 0) return r;
    if (r == 0) break;  // end of file
    off += r;
    const int64_t now = off - header_bytes < 0 ? 0 : (off - header_bytes > size ? size : off - header_bytes);
    rd.Advance(dst, now - done);
    done = now;
    while (fed < done) {
      int64_t take = done - fed < piece - in_piece ? done - fed : piece - in_piece;
      if (take > hs.Left(dst)) take = hs.Left(dst);
      XXH3_64bits_update(state, hs.At(dst), static_cast<size_t>(take));
      hs.Advance(dst, take);
      fed += take;
      in_piece += take;
      if (in_piece == piece) {
        seed = XXH3_64bits_digest(state);
        XXH3_64bits_reset_withSeed(state, seed);
        in_piece = 0;
      }
    }
    // The byte past the payload came (a longer file), or the file ended right after the
    // payload: done.  A read short of the payload's end is confirmed by the next (0 bytes).
    if (off > header_bytes + size || (static_cast<size_t>(r) < asked && done == size)) break;
  }
  if (done == size) {
    if (in_piece > 0 || size == 0) seed = XXH3_64bits_digest(state);
    *digest = seed;
    *hashed = 1;
  }
  return off;
}
#if FDKV_XXH_X86
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
#endif

#if FDKV_HAVE_XXHASH
// Threads for one batch read: at most the read_threads option and one per object, each
// with at least read_thread_min_bytes of the batch's payload (starting a thread costs ~20-
// 30 us, and a batch of 2 MiB read no faster split over two threads), so a small batch
// stays on the caller.
int64_t ReadThreadsFor(int64_t n, const int64_t* dst_bytes) {
  int64_t threads = 1;
  int64_t min_bytes = 0;
  GetOption("read_threads", &threads);
  GetOption("read_thread_min_bytes", &min_bytes);
  if (threads > n) threads = n;
  if (threads <= 1 || min_bytes == 0) return threads < 1 ? 1 : threads;
  int64_t total = 0;
  for (int64_t i = 0; i < n && total / min_bytes < threads; ++i) total += dst_bytes[i];
  const int64_t by_bytes = total / min_bytes;
  return by_bytes < 1 ? 1 : (by_bytes < threads ? by_bytes : threads);
}
#endif

}  // namespace

bool HaveHashedRead() {
#if FDKV_HAVE_XXHASH && FDKV_XXH_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return FDKV_HAVE_XXHASH != 0;
#endif
}

namespace {

#if FDKV_HAVE_XXHASH
// Whether `h` is the file backend's object header for a payload of `size` bytes: magic
// "FDKV", u16 version == `version`, u16 header bytes, u64 payload bytes (then the u64
// checksum), little-endian (storage/file_backend.py).
bool HeaderNames(const char* h, int64_t header_bytes, int64_t size, int32_t version) {
  if (header_bytes < 24) return false;
  uint16_t v = 0, hb = 0;
  uint64_t payload = 0;
  std::memcpy(&v, h + 4, 2);
  std::memcpy(&hb, h + 6, 2);
  std::memcpy(&payload, h + 8, 8);
  return std::memcmp(h, "FDKV", 4) == 0 && v == version && hb == header_bytes && payload == static_cast<uint64_t>(size);
}

// Whether an object read whole (got == header + payload) carries that header and the
// recorded checksum equals `digest`.  Lets the caller look only at the objects that fail it.
bool HeaderMatches(const char* h, int64_t header_bytes, int64_t got, int64_t size, uint64_t digest, int32_t version) {
  if (got != header_bytes + size || !HeaderNames(h, header_bytes, size, version)) return false;
  uint64_t recorded = 0;
  std::memcpy(&recorded, h + 16, 8);
  return recorded == digest;
}
#endif

// The one reader behind both hashed reads: object i's payload goes to dst_of(i) (an
// ObjectDst), its header to headers + i * header_bytes.  states[i]: 0 the payload was not
// filled (digests[i] unset), 1 filled and hashed, 2 that and HeaderMatches (check_version
// > 0 only), 3 (size_first only) the file is not a regular file of header_bytes + the
// payload's size, so nothing was read (got[i] 0).  size_first costs an fstat per object (less
// than a second read), and then an object of another size leaves the destination untouched.
// Objects go to threads one at a time, each claimed by whichever thread is
// free (mixed sizes balance themselves); every object's results land in its own slots, so
// they are the same whatever thread read it.
template <typename DstOf>
void ReadObjectsCore(const char* op, const char* const* paths, int64_t n, const std::vector<int64_t>& sizes,
                     DstOf dst_of, void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes,
                     int32_t check_version, bool size_first, int64_t* got, uint64_t* digests, int32_t* states) {
#if FDKV_HAVE_XXHASH
  // The hashing code is AVX-512 machine code: refuse, never fault, on a CPU without it.
  if (!HaveHashedRead()) throw std::runtime_error(std::string(op) + ": this CPU lacks AVX-512 (F, BW)");
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    XXH3_state_t state;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      states[i] = 0;
      const int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        got[i] = -static_cast<int64_t>(errno);
        continue;
      }
      char* header = static_cast<char*>(headers) + i * header_bytes;
      if (size_first) {
        struct stat st;
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != header_bytes + sizes[i]) {
          got[i] = 0;
          states[i] = 3;
          close(fd);
          continue;
        }
      }
      got[i] = ReadHashedOne(fd, header, header_bytes, dst_of(i), piece_bytes, step_bytes, &state, &digests[i],
                             &states[i]);
      close(fd);
      if (check_version > 0 && states[i] == 1 &&
          HeaderMatches(header, header_bytes, got[i], sizes[i], digests[i], check_version)) {
        states[i] = 2;
      }
    }
  };
  const int64_t threads = ReadThreadsFor(n, sizes.data());
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no thread to be had: the threads already running (and the caller) read the rest
    }
  }
  work();
  for (std::thread& h : helpers) h.join();
#else
  (void)paths, (void)n, (void)sizes, (void)dst_of, (void)headers, (void)header_bytes, (void)piece_bytes;
  (void)step_bytes, (void)check_version, (void)size_first, (void)got, (void)digests, (void)states;
  throw std::runtime_error(std::string(op) + ": built without xxHash's header (install libxxhash-dev and rebuild)");
#endif
}

void CheckHashArgs(const char* op, int64_t piece_bytes, int64_t step_bytes) {
  if (piece_bytes <= 0) throw InvalidArgument(op, "piece_bytes", -1, " = " + std::to_string(piece_bytes) + " must be > 0");
  if (step_bytes <= 0) throw InvalidArgument(op, "step_bytes", -1, " = " + std::to_string(step_bytes) + " must be > 0");
}

}  // namespace

void ReadFilesHashed(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
                     void* headers, int64_t header_bytes, int64_t piece_bytes, int64_t step_bytes, int64_t* got,
                     uint64_t* digests, int32_t* hashed) {
  const char* op = "read_files_hashed";
  CheckReadArgs(op, paths, n, dsts, dst_bytes, headers, header_bytes, got);
  CheckHashArgs(op, piece_bytes, step_bytes);
  if (n == 0) return;
  if (digests == nullptr) throw InvalidArgument(op, "digests", -1, " is a null pointer");
  if (hashed == nullptr) throw InvalidArgument(op, "hashed", -1, " is a null pointer");
  const std::vector<int64_t> sizes(dst_bytes, dst_bytes + n);
  auto dst_of = [&](int64_t i) { return ObjectDst{&dsts[i], &dst_bytes[i], 1, dst_bytes[i]}; };
  ReadObjectsCore(op, paths, n, sizes, dst_of, headers, header_bytes, piece_bytes, step_bytes, 0, false, got, digests,
                  hashed);
}

std::vector<const char*> SplitPaths(const char* op, const char* blob, int64_t blob_bytes, int64_t n) {
  if (n < 0) throw InvalidArgument(op, "n", -1, " = " + std::to_string(n) + " must be >= 0");
  std::vector<const char*> out;
  if (n == 0) return out;
  if (blob == nullptr) throw InvalidArgument(op, "paths", -1, " is a null pointer");
  out.reserve(static_cast<size_t>(n));
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const void* nul = at < blob_bytes ? std::memchr(blob + at, 0, static_cast<size_t>(blob_bytes - at)) : nullptr;
    if (nul == nullptr) {
      throw InvalidArgument(op, "paths", i, ": the " + std::to_string(blob_bytes) + "-byte blob holds only " +
                                                std::to_string(i) + " NUL-terminated paths, n = " + std::to_string(n));
    }
    const int64_t end = static_cast<const char*>(nul) - blob;
    if (end == at) throw InvalidArgument(op, "paths", i, " is empty");
    out.push_back(blob + at);
    at = end + 1;
  }
  return out;
}

void ReadObjects(const char* path_blob, int64_t blob_bytes, int64_t n, void* const* segs, const int64_t* seg_bytes,
                 int64_t segs_per_object, int32_t shared_lengths, void* headers, int64_t header_bytes,
                 int64_t piece_bytes, int64_t step_bytes, int32_t check_version, int32_t size_first, int64_t* got,
                 uint64_t* digests, int32_t* states) {
  const char* op = "read_objects";
  const std::vector<const char*> paths = SplitPaths(op, path_blob, blob_bytes, n);
  if (segs_per_object <= 0) {
    throw InvalidArgument(op, "segs_per_object", -1, " = " + std::to_string(segs_per_object) + " must be > 0");
  }
  if (header_bytes < 0) {
    throw InvalidArgument(op, "header_bytes", -1, " = " + std::to_string(header_bytes) + " must be >= 0");
  }
  CheckHashArgs(op, piece_bytes, step_bytes);
  if (n == 0) return;
  if (segs == nullptr) throw InvalidArgument(op, "segs", -1, " is a null pointer");
  if (seg_bytes == nullptr) throw InvalidArgument(op, "seg_bytes", -1, " is a null pointer");
  if (header_bytes > 0 && headers == nullptr) throw InvalidArgument(op, "headers", -1, " is a null pointer");
  if (got == nullptr) throw InvalidArgument(op, "got", -1, " is a null pointer");
  if (digests == nullptr) throw InvalidArgument(op, "digests", -1, " is a null pointer");
  if (states == nullptr) throw InvalidArgument(op, "states", -1, " is a null pointer");
  const int64_t lengths = shared_lengths ? segs_per_object : n * segs_per_object;
  for (int64_t k = 0; k < lengths; ++k) {
    if (seg_bytes[k] <= 0) {
      throw InvalidArgument(op, "seg_bytes", k, " = " + std::to_string(seg_bytes[k]) + " must be > 0");
    }
  }
  std::vector<int64_t> sizes(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* lens = seg_bytes + (shared_lengths ? 0 : i * segs_per_object);
    for (int64_t k = 0; k < segs_per_object; ++k) {
      if (segs[i * segs_per_object + k] == nullptr) {
        throw InvalidArgument(op, "segs", i * segs_per_object + k, " is a null pointer");
      }
      sizes[i] += lens[k];
    }
  }
  auto dst_of = [&](int64_t i) {
    return ObjectDst{&segs[i * segs_per_object], seg_bytes + (shared_lengths ? 0 : i * segs_per_object),
                     segs_per_object, sizes[i]};
  };
  ReadObjectsCore(op, paths.data(), n, sizes, dst_of, headers, header_bytes, piece_bytes, step_bytes, check_version,
                  size_first != 0, got, digests, states);
}

int64_t FilesExist(const char* path_blob, int64_t blob_bytes, int64_t n) {
  const std::vector<const char*> paths = SplitPaths("files_exist", path_blob, blob_bytes, n);
  int64_t count = 0;
  for (const char* p : paths) {
    struct stat st;
    if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) break;
    ++count;
  }
  return count;
}

void ReadFiles(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
               void* headers, int64_t header_bytes, int64_t* got) {
  CheckReadArgs("read_files", paths, n, dsts, dst_bytes, headers, header_bytes, got);
  for (int64_t i = 0; i < n; ++i) {
    const int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      got[i] = -static_cast<int64_t>(errno);
      continue;
    }
    // The byte past the buffer tells a file longer than header + buffer without an fstat.
    char past_end = 0;
    struct iovec iov[3];
    int count = 0;
    if (header_bytes > 0) iov[count++] = {static_cast<char*>(headers) + i * header_bytes, static_cast<size_t>(header_bytes)};
    if (dst_bytes[i] > 0) iov[count++] = {dsts[i], static_cast<size_t>(dst_bytes[i])};
    iov[count++] = {&past_end, 1};
    got[i] = ReadFully(fd, iov, count, header_bytes + dst_bytes[i]);
    close(fd);
  }
}

}  // namespace fdkv
