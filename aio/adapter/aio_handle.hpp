// zeroplus::aio::AioHandle: asynchronous reads and writes of whole tensors to files, for
// LibTorch users and (through AioHandleHolder, registered as torch.classes.zeroplus.AioHandle)
// for Python's zeroplus.aio. Names follow DeepSpeed's aio_handle (async_pread, wait, ...).
//
// Data paths, chosen per operation:
//   * CPU tensor whose address suits the file's O_DIRECT alignment (every tensor from
//     newCpuLockedTensor does): handed to the Engine as is, zero copies.
//   * CUDA tensor, or a CPU tensor at an unaligned address: through two page-locked staging
//     buffers of staging_bytes each, double-buffered so that copying chunk k+1 overlaps the
//     file I/O of chunk k. Runs on the handle's staging thread, one such operation at a time.
// File offsets: with direct="on" they must be multiples of the file's alignment (IoError
// EINVAL otherwise); with "auto" an unaligned offset makes that one operation buffered.
// Writes open the file with O_CREAT and without O_TRUNC (like DeepSpeed): a larger existing
// file keeps its size. Reads must lie inside the file; reading past the end fails (ENODATA).
//
// Contract:
//   * Tensors must be contiguous, on CPU or CUDA. The handle keeps a reference to the tensor
//     until wait(); the caller must not modify (write) or read (read) its contents before then.
//     CUDA work queued on the current stream before an async call is ordered before its copy.
//   * async_* return at once (0); wait() blocks until every operation submitted so far on this
//     handle (from any thread) has finished, returns how many finished, and rethrows the first
//     failure (c10::Error whose message is the IoError text: op, path, offset, length, errno).
//     All operations are waited for before an error is thrown.
//   * Thread-safe: all methods may be called concurrently. The destructor waits for outstanding
//     operations and drops their errors.
//   * Files: one open File per (path, read/write, O_DIRECT mode) is shared by all queued
//     operations (FileCache) and closed once wait() has released the last of them. Only regular
//     files and block devices are accepted (File::open), refused at the call.
//   * staging_bytes larger than half of physical memory is refused at construction; if the
//     staging buffers still cannot be allocated, the staged operation fails with IoError
//     (ENOMEM) naming staging_bytes.
//   * newCpuLockedTensor memory is freed when the last tensor sharing its storage dies, which
//     may be after the handle is gone.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "aio/core/engine.hpp"
#include "aio/core/file_cache.hpp"

namespace zeroplus::aio {

class StagingExecutor;

struct AioHandleOptions {
  int64_t block_size = 1 << 20;       // bytes per I/O request
  int64_t queue_depth = 32;           // requests in flight per thread
  int64_t threads = 1;                // I/O threads (DeepSpeed: intra_op_parallelism)
  std::string engine = "auto";        // "auto" | "io_uring" | "threads"
  std::string direct = "auto";        // O_DIRECT: "auto" | "on" | "off"
  int64_t staging_bytes = 16 << 20;   // per staging buffer (two per handle, allocated lazily)
};

class AioHandle {
 public:
  explicit AioHandle(AioHandleOptions options = {});
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  int64_t asyncPread(const at::Tensor& tensor, const std::string& path, int64_t offset = 0);
  int64_t asyncPwrite(const at::Tensor& tensor, const std::string& path, int64_t offset = 0);
  // Submit and wait (including every earlier outstanding operation); return 1... as wait().
  int64_t syncPread(const at::Tensor& tensor, const std::string& path, int64_t offset = 0);
  int64_t syncPwrite(const at::Tensor& tensor, const std::string& path, int64_t offset = 0);
  int64_t wait();
  int64_t pending() const;

  // Replaces `path` with exactly the tensor's bytes, all or nothing: writes a temporary file in
  // the same directory (preallocated, so ENOSPC shows before any write), fsyncs it, renames it
  // over `path` and fsyncs the directory. Blocks until done; waits only for this operation.
  // On any failure the temporary file is removed and `path` keeps its old contents (or stays
  // absent). Returns 1. Unlike asyncPwrite, which overwrites in place, a failure part-way
  // cannot destroy the old file.
  int64_t atomicWrite(const at::Tensor& tensor, const std::string& path);

  // A 1-D CPU tensor of `numel` elements of `dtype` in page-aligned, mlocked memory of exactly
  // that size (rounded up to a page only), registered with the engine (io_uring fixed buffers)
  // and, when built with CUDA and a GPU is present, with cudaHostRegister.
  at::Tensor newCpuLockedTensor(int64_t numel, at::ScalarType dtype);

  const AioHandleOptions& options() const noexcept { return options_; }
  std::string engineName() const { return toString(engine_->kind()); }

 private:
  struct Started {
    Ticket ticket;                    // direct path
    std::shared_future<void> staged;  // staged path
    void wait() const;                // throws the operation's error
  };
  struct Pending {
    Started op;
    at::Tensor keep;
  };
  int64_t submit(OpKind op, const at::Tensor& tensor, const std::string& path, int64_t offset);
  std::shared_ptr<const File> openFor(const std::string& path, const OpenOptions& oo, uint64_t offset,
                                      uint64_t length);
  Started start(OpKind op, const at::Tensor& t, const std::shared_ptr<const File>& file, uint64_t offset);

  AioHandleOptions options_;
  FileCache files_;  // one open File per (path, mode) while operations use it
  std::shared_ptr<Engine> engine_;
  std::unique_ptr<StagingExecutor> staging_;
  mutable std::mutex mu_;
  std::vector<Pending> pending_;
};

}  // namespace zeroplus::aio
