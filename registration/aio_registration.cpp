// Registers torch.classes.zeroplus.AioHandle (Python: zeroplus.aio.AioHandle wraps it).
// Method names follow DeepSpeed's aio_handle so swappers written for it read the same.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "aio/adapter/aio_handle.hpp"

namespace zeroplus::aio {

// TorchScript custom classes must derive from CustomClassHolder; AioHandle itself stays a
// plain C++ class for LibTorch users.
class AioHandleHolder : public torch::CustomClassHolder {
 public:
  AioHandleHolder(int64_t block_size, int64_t queue_depth, int64_t threads, std::string engine,
                  std::string direct, int64_t staging_bytes)
      : handle(AioHandleOptions{block_size, queue_depth, threads, std::move(engine), std::move(direct),
                                staging_bytes}) {}
  AioHandle handle;
};

}  // namespace zeroplus::aio

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
  using zeroplus::aio::AioHandleHolder;
  using Self = c10::intrusive_ptr<AioHandleHolder>;
  m.class_<AioHandleHolder>("AioHandle")
      .def(torch::init<int64_t, int64_t, int64_t, std::string, std::string, int64_t>())
      .def("async_pread", [](const Self& s, const at::Tensor& t, const std::string& path, int64_t offset) {
        return s->handle.asyncPread(t, path, offset);
      })
      .def("async_pwrite", [](const Self& s, const at::Tensor& t, const std::string& path, int64_t offset) {
        return s->handle.asyncPwrite(t, path, offset);
      })
      .def("sync_pread", [](const Self& s, const at::Tensor& t, const std::string& path, int64_t offset) {
        return s->handle.syncPread(t, path, offset);
      })
      .def("sync_pwrite", [](const Self& s, const at::Tensor& t, const std::string& path, int64_t offset) {
        return s->handle.syncPwrite(t, path, offset);
      })
      .def("atomic_write", [](const Self& s, const at::Tensor& t, const std::string& path) {
        return s->handle.atomicWrite(t, path);
      })
      .def("wait", [](const Self& s) { return s->handle.wait(); })
      .def("pending", [](const Self& s) { return s->handle.pending(); })
      .def("new_cpu_locked_tensor", [](const Self& s, int64_t numel, at::ScalarType dtype) {
        return s->handle.newCpuLockedTensor(numel, dtype);
      })
      .def("get_block_size", [](const Self& s) { return s->handle.options().block_size; })
      .def("get_queue_depth", [](const Self& s) { return s->handle.options().queue_depth; })
      .def("get_threads", [](const Self& s) { return s->handle.options().threads; })
      .def("get_direct", [](const Self& s) { return s->handle.options().direct; })
      .def("get_staging_bytes", [](const Self& s) { return s->handle.options().staging_bytes; })
      .def("get_engine", [](const Self& s) { return s->handle.engineName(); });
}
