#include "aio/adapter/staging.hpp"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "aio/core/io_error.hpp"

#ifdef ZEROPLUS_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace zeroplus::aio {

// Copies between a tensor's bytes and host staging memory. CPU: memcpy. CUDA: a side stream
// that first waits for the work queued on the caller's stream before the call (the event), then
// a synchronous-to-host copy, so a staging buffer is never reused while a copy still reads it.
//
// It holds the tensor's address, never an at::Tensor: dropping the last reference to a tensor
// that has a Python object needs the GIL, and this thread must never wait for the GIL (the
// Python thread may hold it while joining us). AioHandle keeps the tensor alive instead.
class Copier {
 public:
  Copier(char* base, c10::Device device) : base_(base) {
#ifdef ZEROPLUS_WITH_CUDA
    if (device.is_cuda()) {
      guard_.emplace(device);
      stream_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
    }
#endif
  }
#ifdef ZEROPLUS_WITH_CUDA
  void after(const std::shared_ptr<at::cuda::CUDAEvent>& ev) {
    if (ev && stream_) ev->block(*stream_);
  }
#endif
  void toHost(char* dst, size_t off, size_t n) { copy(dst, base_ + off, n, /*d2h=*/true); }
  void fromHost(size_t off, const char* src, size_t n) { copy(base_ + off, src, n, /*d2h=*/false); }

 private:
  void copy(void* dst, const void* src, size_t n, bool d2h) {
#ifdef ZEROPLUS_WITH_CUDA
    if (stream_) {
      C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, d2h ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                     stream_->stream()));
      C10_CUDA_CHECK(cudaStreamSynchronize(stream_->stream()));
      return;
    }
#endif
    std::memcpy(dst, src, n);
  }
  char* base_;
#ifdef ZEROPLUS_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard_;
  std::optional<c10::cuda::CUDAStream> stream_;
#endif
};

namespace {

// Waits for every ticket even when one throws: a staging buffer must not be reused or freed
// while the kernel may still write into it.
void drain(Ticket* tickets, int n) {
  for (int i = 0; i < n; ++i) {
    try {
      tickets[i].wait();
    } catch (...) {
    }
  }
}

}  // namespace

bool cudaPinHost(void* ptr, size_t bytes) {
#ifdef ZEROPLUS_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return false;
  }
  const cudaError_t rc = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (rc == cudaSuccess) return true;
  (void)cudaGetLastError();
  logOnce("cudaHostRegister", std::string("cudaHostRegister failed: ") + cudaGetErrorString(rc) +
                                  "; host<->device copies of aio buffers will not be asynchronous");
#endif
  return false;
}

void cudaUnpinHost(void* ptr) {
#ifdef ZEROPLUS_WITH_CUDA
  if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
#endif
}

int cudaCurrentDevice() {
#ifdef ZEROPLUS_WITH_CUDA
  // torch's view of the device, not cudaGetDevice: a device guard may have recorded its target
  // without making it current (c10::cuda::MaybeSetDevice, to create no context).
  try {
    if (c10::cuda::device_count() == 0) return -1;
    return static_cast<int>(c10::cuda::current_device());
  } catch (const c10::Error&) {
    return -1;
  }
#else
  return -1;
#endif
}

bool cudaPinHostOn(int device, void* ptr, size_t bytes) {
#ifdef ZEROPLUS_WITH_CUDA
  if (device < 0) return false;
  try {
    // CUDAGuard restores the previous device through c10's MaybeSetDevice: never a new context.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const cudaError_t rc = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (rc == cudaSuccess) return true;
    (void)cudaGetLastError();
    logOnce("cudaHostRegister", std::string("cudaHostRegister failed: ") + cudaGetErrorString(rc) +
                                    "; host<->device copies of swap buffers will not be asynchronous");
  } catch (const c10::Error& e) {
    logOnce("cudaHostRegister", std::string("cannot select CUDA device ") + std::to_string(device) + ": " +
                                    e.what_without_backtrace());
  }
#else
  (void)device;
  (void)ptr;
  (void)bytes;
#endif
  return false;
}

void cudaUnpinHostOn(int device, void* ptr) {
#ifdef ZEROPLUS_WITH_CUDA
  if (device < 0) return;
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
  } catch (const c10::Error&) {
  }
#else
  (void)device;
  (void)ptr;
#endif
}

StagingExecutor::StagingExecutor(std::shared_ptr<Engine> engine, size_t chunk_bytes)
    : engine_(std::move(engine)), staging_bytes_(chunk_bytes), chunk_(chunk_bytes), thread_([this] { loop(); }) {}

StagingExecutor::~StagingExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (int i = 0; i < 2; ++i) {
    if (registered_[i]) engine_->unregisterBuffer(buffers_[i].data());
    if (cuda_pinned_[i]) cudaUnpinHost(buffers_[i].data());
  }
}

std::shared_future<void> StagingExecutor::enqueue(OpKind op, const at::Tensor& tensor,
                                                  std::shared_ptr<const File> file, uint64_t offset) {
  auto task = std::make_shared<std::packaged_task<void()>>();
  char* base = static_cast<char*>(tensor.data_ptr());
  const c10::Device device = tensor.device();
  const size_t nbytes = tensor.nbytes();
#ifdef ZEROPLUS_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> ready;
  if (tensor.is_cuda()) {
    // Recorded on the caller's thread and stream: everything the caller queued that produces
    // (write) or last reads (read) this tensor happens before our copy.
    c10::cuda::CUDAGuard guard(tensor.device());
    ready = std::make_shared<at::cuda::CUDAEvent>();
    ready->record(at::cuda::getCurrentCUDAStream(tensor.device().index()));
  }
  *task = std::packaged_task<void()>([this, op, base, device, nbytes, file, offset, ready] {
    Copier copier(base, device);
    copier.after(ready);
#else
  *task = std::packaged_task<void()>([this, op, base, device, nbytes, file, offset] {
    Copier copier(base, device);
#endif
    ensureBuffers(op, *file, offset, nbytes);
    if (op == OpKind::Write) {
      writeStaged(copier, nbytes, file, offset);
    } else {
      readStaged(copier, nbytes, file, offset);
    }
  });
  std::shared_future<void> fut = task->get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.emplace_back([task] { (*task)(); });
  }
  cv_.notify_one();
  return fut;
}

void StagingExecutor::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();  // packaged_task stores any exception in its future
  }
}

void StagingExecutor::ensureBuffers(OpKind op, const File& file, uint64_t offset, uint64_t length) {
  // Chunks must keep every file offset aligned: round the chunk up to the file's alignment.
  const size_t a = std::max<uint64_t>(file.offsetAlign(), kPageSize);
  const size_t want = (chunk_ + a - 1) / a * a;
  if (buffers_[0].data() && buffers_[1].data() && buffers_[0].size() >= want) return;
  // Both new buffers are allocated before the old ones are touched: a failure leaves the
  // executor as it was (never one buffer new and the other missing), and names the knob.
  AlignedBuffer fresh[2];
  try {
    fresh[0] = AlignedBuffer(want);
    fresh[1] = AlignedBuffer(want);
  } catch (const std::bad_alloc&) {
    throw IoError(op == OpKind::Write ? "write" : "read", file.path(), offset, length, ENOMEM,
                  "cannot allocate two staging buffers of " + std::to_string(want) +
                      " bytes each (staging_bytes=" + std::to_string(staging_bytes_) + "); lower staging_bytes");
  }
  for (int i = 0; i < 2; ++i) {
    if (registered_[i]) engine_->unregisterBuffer(buffers_[i].data());
    if (cuda_pinned_[i]) cudaUnpinHost(buffers_[i].data());
    buffers_[i] = std::move(fresh[i]);
    registered_[i] = engine_->registerBuffer(buffers_[i].data(), want);
    cuda_pinned_[i] = cudaPinHost(buffers_[i].data(), want);
  }
  chunk_ = want;
}

void StagingExecutor::writeStaged(Copier& copier, size_t total, const std::shared_ptr<const File>& f,
                                  uint64_t offset) {
  Ticket inflight[2];
  try {
    for (size_t k = 0, off = 0; off < total; ++k, off += chunk_) {
      const size_t n = std::min(chunk_, total - off);
      const int b = static_cast<int>(k % 2);
      inflight[b].wait();  // the write that last used buffer b (chunk k-2) has finished
      copier.toHost(static_cast<char*>(buffers_[b].data()), off, n);
      inflight[b] = engine_->submit({OpKind::Write, f, buffers_[b].data(), offset + off, n});
    }
    inflight[0].wait();
    inflight[1].wait();
  } catch (...) {
    drain(inflight, 2);
    throw;
  }
}

void StagingExecutor::readStaged(Copier& copier, size_t total, const std::shared_ptr<const File>& f,
                                 uint64_t offset) {
  if (total == 0) return;
  const size_t chunks = (total + chunk_ - 1) / chunk_;
  Ticket inflight[2];
  auto issue = [&](size_t k) {
    const size_t off = k * chunk_;
    inflight[k % 2] = engine_->submit(
        {OpKind::Read, f, buffers_[k % 2].data(), offset + off, std::min(chunk_, total - off)});
  };
  try {
    issue(0);
    for (size_t k = 0; k < chunks; ++k) {
      // Chunk k+1 is read while chunk k is copied out; buffer (k+1)%2 is free because the
      // copy-out of chunk k-1 completed synchronously in the previous iteration.
      if (k + 1 < chunks) issue(k + 1);
      inflight[k % 2].wait();
      const size_t off = k * chunk_;
      copier.fromHost(off, static_cast<const char*>(buffers_[k % 2].data()), std::min(chunk_, total - off));
    }
  } catch (...) {
    drain(inflight, 2);
    throw;
  }
}

}  // namespace zeroplus::aio
