// Registers torch.classes.zeroplus.SwapStore: the C++ engine's swap substrate
// (optimizers/core/swap_store.hpp) for the Python engine's NVMe optimizer swapper
// (plugin/python/zeroplus/offload/swapper.py), so both engines keep records the same way.
//
// The adapter's edge, nothing more: records keys as four ints, payloads as uint8 tensors viewing
// the held buffer (at::from_blob without ownership: valid until the record is stored without
// linger, released or the store is closed; the Python side empties every view before), faults as
// (id, path, errno, what) tuples that the Python side turns into OSError with its own wording.
// With `pin` (CUDA training) the store's buffers are registered with cudaHostRegister as they
// are allocated, so host-to-device copies of a master in a record are asynchronous; the
// torch-free core never sees CUDA.
//
// Threading: one owner thread (the store's contract). close() destroys the store (waits for its
// transfers, removes its files); every other method then raises.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <set>
#include <tuple>

#include "aio/adapter/staging.hpp"
#include "aio/core/io_error.hpp"
#include "optimizers/core/swap_store.hpp"

namespace zeroplus::swap {
namespace {

using Fault = std::tuple<int64_t, std::string, int64_t, std::string>;  // id, path, errno, what
using Held = std::tuple<at::Tensor, int64_t, std::string>;              // payload, errno, what

RecordKey keyOf(int64_t id, int64_t generation, int64_t payloadBytes, int64_t tag) {
  TORCH_CHECK(id >= 0 && generation >= 0 && payloadBytes >= 0, "SwapStore: a record key must be non-negative, got id ",
              id, " generation ", generation, " payload_bytes ", payloadBytes);
  return {static_cast<uint64_t>(id), static_cast<uint64_t>(generation), static_cast<uint64_t>(payloadBytes),
          static_cast<uint64_t>(tag)};
}

std::vector<Fault> toList(const std::vector<SwapFault>& faults) {
  std::vector<Fault> out;
  for (const auto& f : faults) out.emplace_back(static_cast<int64_t>(f.id), f.path, f.err, f.what);
  return out;
}

Held held(int rc, void* payload, uint64_t bytes, const SwapFault& fault) {
  if (rc != 0) return {at::empty({0}, at::kByte), fault.err, fault.what};
  return {at::from_blob(payload, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte)), 0, ""};
}

}  // namespace

class SwapStoreHolder : public torch::CustomClassHolder {
 public:
  // directory: the caller's private directory (inPlace); stem: file names stem + 5-digit id + ".swp".
  SwapStoreHolder(std::string directory, std::string stem, int64_t bufferBytes, int64_t bufferCount, int64_t blockSize,
                  int64_t queueDepth, int64_t threads, bool keepWritten, bool pin) {
    TORCH_CHECK_VALUE(bufferCount >= 1, "SwapStore: buffer_count must be >= 1, got ", bufferCount);
    TORCH_CHECK_VALUE(bufferBytes >= static_cast<int64_t>(kHeaderBytes), "SwapStore: buffer_bytes must be >= ",
                      kHeaderBytes, ", got ", bufferBytes);
    TORCH_CHECK_VALUE(blockSize >= 4096 && queueDepth >= 1 && threads >= 1, "SwapStore: bad aio options (block_size ",
                      blockSize, ", queue_depth ", queueDepth, ", threads ", threads, ")");
    SwapStoreOptions o;
    o.parent = std::move(directory);
    o.inPlace = true;
    o.stem = std::move(stem);
    o.bufferBytes = static_cast<size_t>(bufferBytes);
    o.bufferCount = static_cast<size_t>(bufferCount);
    o.io.block_size = static_cast<uint64_t>(blockSize);
    o.io.queue_depth = static_cast<unsigned>(queueDepth);
    o.io.threads = static_cast<unsigned>(threads);
    o.keepWritten = keepWritten;
    if (pin) {
      // Buffers pinned here are unpinned before they are freed (the store calls onFree first).
      // The callbacks run on the store's pump thread too, whose current device is 0: they make
      // this (the training thread's) device current, or every rank would create a context on GPU 0.
      auto pinned = std::make_shared<std::set<void*>>();
      const int device = aio::cudaCurrentDevice();
      o.onAllocate = [pinned, device](void* p, size_t n) {
        if (aio::cudaPinHostOn(device, p, n)) pinned->insert(p);
      };
      o.onFree = [pinned, device](void* p, size_t) {
        if (pinned->erase(p) != 0) aio::cudaUnpinHostOn(device, p);
      };
    }
    try {
      store_ = std::make_unique<SwapStore>(o);
    } catch (const aio::IoError& e) {
      TORCH_CHECK(false, "SwapStore: ", e.what());
    }
  }

  SwapStore& store() {
    TORCH_CHECK(store_ != nullptr, "SwapStore: closed");
    return *store_;
  }
  void close() { store_.reset(); }

 private:
  std::unique_ptr<SwapStore> store_;
};

}  // namespace zeroplus::swap

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
  using zeroplus::swap::SwapStoreHolder;
  using Self = c10::intrusive_ptr<SwapStoreHolder>;
  namespace sw = zeroplus::swap;
  m.class_<SwapStoreHolder>("SwapStore")
      .def(torch::init<std::string, std::string, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool>())
      .def("directory", [](const Self& s) { return s->store().directory(); })
      .def("path_of", [](const Self& s, int64_t id) { return s->store().pathOf(static_cast<uint64_t>(id)); })
      .def("engine", [](const Self& s) { return std::string(s->store().engineName()); })
      .def("reserve", [](const Self& s, int64_t bytes) {
        s->store().reserve(static_cast<size_t>(std::max<int64_t>(bytes, 0)));
      })
      .def("buffer_bytes", [](const Self& s) { return static_cast<int64_t>(s->store().bufferBytes()); })
      // keys: id, generation, payload_bytes, layout_tag for each record, flat.
      .def("plan_reads", [](const Self& s, std::vector<int64_t> keys) {
        TORCH_CHECK_VALUE(keys.size() % 4 == 0, "SwapStore.plan_reads: keys must hold 4 ints per record, got ",
                          keys.size());
        std::vector<sw::RecordKey> plan;
        for (size_t i = 0; i < keys.size(); i += 4) {
          plan.push_back(sw::keyOf(keys[i], keys[i + 1], keys[i + 2], keys[i + 3]));
        }
        s->store().planReads(std::move(plan));
      })
      .def("fetch", [](const Self& s, int64_t id, int64_t generation, int64_t payloadBytes, int64_t tag) {
        void* payload = nullptr;
        sw::SwapFault fault;
        const int rc = s->store().fetch(sw::keyOf(id, generation, payloadBytes, tag), &payload, &fault);
        return sw::held(rc, payload, static_cast<uint64_t>(payloadBytes), fault);
      })
      .def("overwrite", [](const Self& s, int64_t id, int64_t payloadBytes) {
        void* payload = nullptr;
        sw::SwapFault fault;
        const int rc = s->store().overwrite(sw::keyOf(id, 0, payloadBytes, 0).id, static_cast<uint64_t>(payloadBytes),
                                            &payload, &fault);
        return sw::held(rc, payload, static_cast<uint64_t>(payloadBytes), fault);
      })
      .def("store", [](const Self& s, int64_t id, int64_t generation, int64_t payloadBytes, int64_t tag, bool linger) {
        s->store().store(sw::keyOf(id, generation, payloadBytes, tag), linger);
      })
      .def("release", [](const Self& s, int64_t id) { s->store().release(static_cast<uint64_t>(id)); })
      // 0, or EBUSY: the record is held or stored with linger and not released (nothing dropped).
      .def("forget", [](const Self& s, int64_t id) { return static_cast<int64_t>(-s->store().forget(static_cast<uint64_t>(id))); })
      .def("held_capacity", [](const Self& s, int64_t id) {
        return static_cast<int64_t>(s->store().heldCapacity(static_cast<uint64_t>(id)));
      })
      .def("adopt", [](const Self& s, int64_t id) {
        sw::SwapFault fault;
        const int rc = s->store().adopt(static_cast<uint64_t>(id), &fault);
        return std::make_tuple(static_cast<int64_t>(rc == 0 ? 0 : fault.err), fault.what);
      })
      .def("poll", [](const Self& s) { return sw::toList(s->store().poll()); })
      .def("drain", [](const Self& s) { return sw::toList(s->store().drain()); })
      // Seals a record laid out in `record` (a contiguous uint8 CPU tensor: the 4 KiB header, then
      // the payload) as the store would: a side file written by the caller (a staged load).
      .def("seal", [](const Self&, const at::Tensor& record, int64_t id, int64_t generation, int64_t payloadBytes,
                      int64_t tag) {
        const auto need = static_cast<int64_t>(sw::recordBytes(static_cast<uint64_t>(std::max<int64_t>(payloadBytes, 0))));
        TORCH_CHECK_VALUE(record.device().is_cpu() && record.scalar_type() == at::kByte && record.is_contiguous() &&
                              record.numel() >= need,
                          "SwapStore.seal: record must be a contiguous uint8 CPU tensor of at least ",
                          need, " bytes, got ",
                          record.scalar_type(), " of ", record.numel());
        sw::sealRecord(record.data_ptr(), sw::keyOf(id, generation, payloadBytes, tag));
      })
      .def("stats", [](const Self& s) {
        const sw::SwapStats st = s->store().stats();
        c10::Dict<std::string, int64_t> d;
        auto put = [&](const char* k, uint64_t v) { d.insert(k, static_cast<int64_t>(v)); };
        put("reads", st.reads);
        put("writes", st.writes);
        put("bytes_read", st.bytesRead);
        put("bytes_written", st.bytesWritten);
        put("waits_for_write", st.waitsForWrite);
        put("buffers", st.buffers);
        put("reads_ahead", st.readsAhead);
        put("reads_on_demand", st.readsOnDemand);
        put("fetches_in_buffer", st.fetchesInBuffer);
        put("prefetches_refused", st.prefetchesRefused);
        put("read_wait_ns", st.readWaitNs);
        put("write_wait_ns", st.writeWaitNs);
        put("checksum_ns", st.checksumNs);
        put("evictions", st.evictions);
        put("max_in_flight", st.maxInFlight);
        put("cache_hits", st.cacheHits);
        put("buffer_bytes", st.bufferBytes);
        put("peak_buffer_bytes", st.peakBufferBytes);
        return d;
      })
      .def("reset_peak", [](const Self& s) { s->store().resetPeak(); })
      .def("close", [](const Self& s) { s->close(); });
}
