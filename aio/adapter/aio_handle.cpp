#include "aio/adapter/aio_handle.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <limits>

#include "aio/adapter/staging.hpp"
#include "aio/core/aligned_buffer.hpp"
#include "aio/core/durability.hpp"
#include "aio/core/file.hpp"
#include "aio/core/io_error.hpp"

namespace zeroplus::aio {
namespace {

EngineKind parseEngine(const std::string& s) {
  if (s == "auto") return EngineKind::Auto;
  if (s == "io_uring") return EngineKind::IoUring;
  if (s == "threads") return EngineKind::ThreadPool;
  TORCH_CHECK(false, "AioHandle: engine must be 'auto', 'io_uring' or 'threads', got '", s, "'");
}

DirectMode parseDirect(const std::string& s) {
  if (s == "auto") return DirectMode::Auto;
  if (s == "on") return DirectMode::On;
  if (s == "off") return DirectMode::Off;
  TORCH_CHECK(false, "AioHandle: direct must be 'auto', 'on' or 'off', got '", s, "'");
}

// IoError -> c10::Error at the torch edge; the message keeps op, path, offset, length, errno.
template <typename F>
auto rethrowAsTorch(F&& f) {
  try {
    return f();
  } catch (const IoError& e) {
    TORCH_CHECK(false, e.what());
    throw;  // unreachable: TORCH_CHECK(false) throws
  }
}

}  // namespace

AioHandle::AioHandle(AioHandleOptions options) : options_(std::move(options)) {
  TORCH_CHECK(options_.block_size > 0, "AioHandle: block_size must be positive, got ", options_.block_size);
  TORCH_CHECK(options_.queue_depth > 0 && options_.queue_depth <= 4096,
              "AioHandle: queue_depth must be in [1, 4096], got ", options_.queue_depth);
  TORCH_CHECK(options_.threads > 0 && options_.threads <= 256, "AioHandle: threads must be in [1, 256], got ",
              options_.threads);
  TORCH_CHECK(options_.staging_bytes >= static_cast<int64_t>(kPageSize),
              "AioHandle: staging_bytes must be at least ", kPageSize, ", got ", options_.staging_bytes);
  // Two staging buffers are allocated (lazily, at the first staged operation); sizes that can
  // never fit are refused here, naming the knob, rather than as std::bad_alloc at every write.
  const int64_t phys = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES));
  const int64_t limit = phys > 0 ? phys / 2 * static_cast<int64_t>(kPageSize) : INT64_MAX / 2;
  TORCH_CHECK(options_.staging_bytes <= limit, "AioHandle: staging_bytes=", options_.staging_bytes,
              " is too large: two staging buffers of that size are allocated and must fit in half of "
              "physical memory (at most ", limit, " bytes each)");
  parseDirect(options_.direct);
  EngineOptions eo;
  eo.kind = parseEngine(options_.engine);
  eo.block_size = static_cast<uint64_t>(options_.block_size);
  eo.queue_depth = static_cast<unsigned>(options_.queue_depth);
  eo.threads = static_cast<unsigned>(options_.threads);
  engine_ = rethrowAsTorch([&] { return std::shared_ptr<Engine>(Engine::create(eo)); });
  staging_ = std::make_unique<StagingExecutor>(engine_, static_cast<size_t>(options_.staging_bytes));
}

AioHandle::~AioHandle() {
  try {
    wait();
  } catch (...) {
    // Errors of operations nobody waited for are dropped; the I/O itself has finished.
  }
  staging_.reset();  // before engine_: it unregisters its buffers from the engine
}

int64_t AioHandle::submit(OpKind op, const at::Tensor& t, const std::string& path, int64_t offset) {
  const char* name = op == OpKind::Read ? "async_pread" : "async_pwrite";
  TORCH_CHECK(t.defined(), name, ": tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), name, ": tensor must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), name, ": tensor must be on CPU or CUDA, got ", t.device());
  TORCH_CHECK(offset >= 0, name, ": offset must be >= 0, got ", offset);
  TORCH_CHECK(!path.empty(), name, ": path is empty");
  // The file range must end at a representable file offset (off_t); checked before the open,
  // which for a write would already create the file.
  TORCH_CHECK(t.nbytes() <= static_cast<size_t>(std::numeric_limits<int64_t>::max() - offset), name,
              ": offset + tensor bytes overflows the largest file offset, got offset ", offset, " and ",
              t.nbytes(), " bytes");

  return rethrowAsTorch([&]() -> int64_t {
    const auto off = static_cast<uint64_t>(offset);
    OpenOptions oo;
    oo.write = op == OpKind::Write;
    oo.create = oo.write;
    oo.direct = parseDirect(options_.direct);
    std::shared_ptr<const File> file = openFor(path, oo, off, t.nbytes());
    if (file->direct() && off % file->offsetAlign() != 0 && oo.direct == DirectMode::Auto) {
      // Unaligned offset under "auto": this operation goes buffered rather than failing.
      logOnce("unaligned-offset", "file offset not O_DIRECT-aligned; using buffered I/O for such operations");
      oo.direct = DirectMode::Off;
      file = openFor(path, oo, off, t.nbytes());
    }
    Pending p;
    p.keep = t;
    p.op = start(op, t, file, off);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
    return 0;
  });
}

std::shared_ptr<const File> AioHandle::openFor(const std::string& path, const OpenOptions& oo, uint64_t offset,
                                               uint64_t length) {
  try {
    return files_.open(path, oo);
  } catch (const IoError& e) {
    throw e.withRange(offset, length);  // the open knows no range; the operation does
  }
}

AioHandle::Started AioHandle::start(OpKind op, const at::Tensor& t, const std::shared_ptr<const File>& file,
                                    uint64_t off) {
  Started s;
  const bool direct_ok = t.is_cpu() && reinterpret_cast<uintptr_t>(t.data_ptr()) % file->memAlign() == 0;
  if (direct_ok) {
    s.ticket = engine_->submit({op, file, t.data_ptr(), off, t.nbytes()});
  } else {
    if (file->direct() && off % file->offsetAlign() != 0) {
      throw IoError(op == OpKind::Read ? "read" : "write", file->path(), off, t.nbytes(), EINVAL,
                    "O_DIRECT file offset must be a multiple of " + std::to_string(file->offsetAlign()));
    }
    s.staged = staging_->enqueue(op, t, file, off);
  }
  return s;
}

void AioHandle::Started::wait() const {
  if (staged.valid()) staged.get();
  else ticket.wait();
}

int64_t AioHandle::atomicWrite(const at::Tensor& t, const std::string& path) {
  TORCH_CHECK(t.defined(), "atomic_write: tensor is undefined");
  TORCH_CHECK(t.is_contiguous(), "atomic_write: tensor must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), "atomic_write: tensor must be on CPU or CUDA, got ", t.device());
  TORCH_CHECK(!path.empty(), "atomic_write: path is empty");
  return rethrowAsTorch([&]() -> int64_t {
    // The temporary file is new and private: it is never shared through the FileCache.
    AtomicFile out(path, parseDirect(options_.direct));
    // Reserving the whole size first turns ENOSPC into an error before any byte is written.
    preallocate(*out.file(), 0, t.nbytes());
    start(OpKind::Write, t, out.file(), 0).wait();
    out.commit();  // fsync, rename over `path`, fsync the directory
    return 1;
  });  // on any failure ~AtomicFile unlinks the temporary file; `path` is untouched
}

int64_t AioHandle::asyncPread(const at::Tensor& t, const std::string& path, int64_t offset) {
  return submit(OpKind::Read, t, path, offset);
}

int64_t AioHandle::asyncPwrite(const at::Tensor& t, const std::string& path, int64_t offset) {
  return submit(OpKind::Write, t, path, offset);
}

int64_t AioHandle::syncPread(const at::Tensor& t, const std::string& path, int64_t offset) {
  submit(OpKind::Read, t, path, offset);
  return wait();
}

int64_t AioHandle::syncPwrite(const at::Tensor& t, const std::string& path, int64_t offset) {
  submit(OpKind::Write, t, path, offset);
  return wait();
}

int64_t AioHandle::wait() {
  std::vector<Pending> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(pending_);
  }
  // Wait for all of them before throwing, so no buffer is still in use when the caller sees
  // the error and frees or reuses its tensors.
  std::string first_error;
  for (auto& p : batch) {
    try {
      p.op.wait();
    } catch (const std::exception& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  TORCH_CHECK(first_error.empty(), first_error);
  return static_cast<int64_t>(batch.size());
}

int64_t AioHandle::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(pending_.size());
}

at::Tensor AioHandle::newCpuLockedTensor(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "new_cpu_locked_tensor: numel must be >= 0, got ", numel);
  // numel * itemsize must not wrap around (2**61 + 512 float64s would be a 4 KiB buffer
  // under a tensor that claims 2.3e18 elements), and must fit the int64 that torch keeps.
  const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t total = 0;
  TORCH_CHECK(!__builtin_mul_overflow(numel, itemsize, &total) &&
                  total <= std::numeric_limits<int64_t>::max() - static_cast<int64_t>(kPageSize),
              "new_cpu_locked_tensor: numel=", numel, " of ", dtype, " (", itemsize,
              " bytes each) overflows the byte count");
  const auto bytes = static_cast<size_t>(total);
  bool locked = false;
  void* ptr = allocateAligned(bytes, kPageSize, /*lock=*/true, &locked);
  TORCH_CHECK(ptr, "new_cpu_locked_tensor: cannot allocate ", bytes, " bytes");
  const size_t span = (std::max<size_t>(bytes, 1) + kPageSize - 1) / kPageSize * kPageSize;
  const bool registered = engine_->registerBuffer(ptr, span);
  const bool cuda_pinned = cudaPinHost(ptr, span);
  // The deleter may run after the handle died: it holds the engine only weakly.
  std::weak_ptr<Engine> engine = engine_;
  auto deleter = [engine, bytes, locked, registered, cuda_pinned](void* p) {
    if (registered) {
      if (auto e = engine.lock()) e->unregisterBuffer(p);
    }
    if (cuda_pinned) cudaUnpinHost(p);
    freeAligned(p, bytes, locked);
  };
  return at::from_blob(ptr, {numel}, deleter, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace zeroplus::aio
