// PrefixRendezvous: a view of another Rendezvous whose keys all start with `prefix`, so that a
// communicator over a subset of a group's ranks (the ranks of one host, hierarchical_
// communicator.hpp) can run its own set-up on the group's store without meeting the keys of
// the group-wide communicator ("zeroplus/addr/<rank>" would otherwise collide). Torch-free;
// holds a reference: `inner` must outlive it.
#pragma once

#include <string>
#include <utility>

#include "process_group/core/rendezvous.hpp"

namespace zeroplus::pg {

class PrefixRendezvous final : public Rendezvous {
 public:
  PrefixRendezvous(Rendezvous& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_.set(prefix_ + key, value); }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_.get(prefix_ + key, timeout);
  }
  bool check(const std::string& key) override { return inner_.check(prefix_ + key); }

 private:
  Rendezvous& inner_;
  std::string prefix_;
};

}  // namespace zeroplus::pg
