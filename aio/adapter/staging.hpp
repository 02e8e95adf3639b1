// Internal to the aio adapter: moves tensors that cannot go to the Engine directly (CUDA
// tensors, CPU tensors at addresses unsuitable for O_DIRECT) through two page-locked staging
// buffers, double-buffered so the copy of one chunk overlaps the file I/O of the other.
//
// Threading: one executor thread per AioHandle runs staged transfers in submission order, one
// at a time; enqueue() may be called from any thread and never blocks on I/O. Buffers are
// allocated on first use and registered with the Engine and (CUDA builds) cudaHostRegister'ed.
// Ownership: a queued transfer holds the File, but not the tensor: the caller (AioHandle) keeps
// the tensor alive until the future is ready. The executor thread never owns an at::Tensor, so
// it never needs the Python GIL (releasing a tensor with a Python object takes it).
#pragma once

#include <ATen/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "aio/core/aligned_buffer.hpp"
#include "aio/core/engine.hpp"

namespace zeroplus::aio {

// Page-locks host memory for CUDA DMA when this build has CUDA and a GPU is present; a no-op
// returning false otherwise. Best effort: failures are logged once.
bool cudaPinHost(void* ptr, size_t bytes);
void cudaUnpinHost(void* ptr);
// The calling thread's current CUDA device, or -1 (no CUDA in this build, no GPU, an error).
int cudaCurrentDevice();
// As cudaPinHost/cudaUnpinHost, for a thread that is not the caller's training thread (a swap
// store's pump): `device` (from cudaCurrentDevice() on the training thread; < 0: nothing is
// done, false) is made current for the call, so that thread never creates a context on GPU 0,
// which every rank would otherwise do. The previous device is restored only where it already
// has a context (torch's device guard). Registered cudaHostRegisterPortable: pinned for every
// context, not only `device`'s.
bool cudaPinHostOn(int device, void* ptr, size_t bytes);
void cudaUnpinHostOn(int device, void* ptr);

class Copier;  // tensor <-> host bytes (memcpy, or cudaMemcpyAsync on a side stream)

class StagingExecutor {
 public:
  StagingExecutor(std::shared_ptr<Engine> engine, size_t chunk_bytes);
  ~StagingExecutor();  // finishes queued transfers, then stops

  // The future becomes ready when the transfer is done; get() rethrows IoError/c10::Error.
  std::shared_future<void> enqueue(OpKind op, const at::Tensor& tensor, std::shared_ptr<const File> file,
                                   uint64_t offset);

 private:
  void loop();
  // Allocates both buffers for `file` (first use, or a larger alignment); throws IoError
  // (ENOMEM, naming staging_bytes and the operation's range) when they cannot be allocated.
  void ensureBuffers(OpKind op, const File& file, uint64_t offset, uint64_t length);
  void writeStaged(Copier& copier, size_t total, const std::shared_ptr<const File>& f, uint64_t offset);
  void readStaged(Copier& copier, size_t total, const std::shared_ptr<const File>& f, uint64_t offset);

  std::shared_ptr<Engine> engine_;
  const size_t staging_bytes_;  // as configured, for error messages
  size_t chunk_;                // staging_bytes_ rounded up to the file alignment
  AlignedBuffer buffers_[2];
  bool registered_[2] = {false, false};
  bool cuda_pinned_[2] = {false, false};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zeroplus::aio
