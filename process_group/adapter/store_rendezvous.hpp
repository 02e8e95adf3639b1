// Rendezvous over a c10d::Store: the adapter's bridge from torch's store to the torch-free core.
// The store given by c10d is already prefixed per group and device, but it may hold keys of an
// earlier instance of the same group (torchrun reuses its store across restarts): the backend
// agrees a fresh scope first (core/group_session.hpp) and prefixes everything else with it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "process_group/core/rendezvous.hpp"

namespace zeroplus::pg {

class StoreRendezvous final : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override { store_->set(key, value); }

  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    store_->wait({key}, timeout);  // throws c10::DistStoreError naming the key on timeout
    return store_->get(key);
  }

  bool check(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace zeroplus::pg
