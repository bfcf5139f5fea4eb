// Batch file reads for the storage tier's file backend (fdkv_read_files in the C ABI).
//
// Why native: a prefetch reads one file per KV block (64 KiB to a few MiB), and in Python
// each costs an open, a preadv and a close plus the interpreter's bookkeeping around them,
// all under the GIL between the syscalls.  Here a whole batch is one call that holds no
// Python lock, so the engine thread and the server's event loop keep running while a
// prefetch reads.  Verification (header, checksum) stays with the caller.
#include <cerrno>
#include <cstdint>
#include <string>

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "swap_core.h"

namespace fdkv {

namespace {

// preadv until the iovecs are full or the file ends; returns bytes read or -errno.  A read
// that comes back short once at least `enough` bytes are in is taken as the end of the file:
// a regular file reads short only there, and asking again would cost every object a second
// preadv that returns 0 (a read short of `enough` is still confirmed that way).
int64_t ReadFully(int fd, struct iovec* iov, int count, int64_t enough) {
  int64_t total = 0;
  off_t offset = 0;
  while (count > 0) {
    size_t asked = 0;
    for (int k = 0; k < count; ++k) asked += iov[k].iov_len;
    const ssize_t r = preadv(fd, iov, count, offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
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

}  // namespace

void ReadFiles(const char* const* paths, int64_t n, void* const* dsts, const int64_t* dst_bytes,
               void* headers, int64_t header_bytes, int64_t* got) {
  const char* op = "read_files";
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
