// Set-up records of the shared-memory transport come from the store, i.e. from outside this
// process: a malformed one is a CommError naming it, not an exception from inside std::string
// (reproduced by tests/fuzz/shm_setup_fuzz with corpus/shm_setup_fuzz/regress-empty-agreement).
#include <gtest/gtest.h>

#include "process_group/core/communicator.hpp"
#include "test_group.hpp"

namespace zeroplus::pg {
namespace {

// Passes everything through, except that rank 1's agreement record is replaced.
class CorruptingRendezvous : public Rendezvous {
 public:
  explicit CorruptingRendezvous(std::string okRecord) : ok_(std::move(okRecord)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    if (key == "zeroplus/shm/ok/1") {
      inner_.set(key, std::vector<uint8_t>(ok_.begin(), ok_.end()));
    } else {
      inner_.set(key, value);
    }
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_.get(key, timeout);
  }

 private:
  std::string ok_;
  testing::InMemoryRendezvous inner_;
};

class MalformedAgreement : public ::testing::TestWithParam<const char*> {};

TEST_P(MalformedAgreement, IsACommErrorNamingTheRecord) {
  CorruptingRendezvous rdv(GetParam());
  std::string rank0Error;
  testing::runRanks(2, [&](int r) {
    CommunicatorOptions o;
    o.rank = r;
    o.size = 2;
    o.connectTimeout = std::chrono::seconds(20);
    o.shm = ShmMode::kOn;
    o.shmChunkBytes = 4096;
    try {
      auto c = Communicator::connect(rdv, o);  // rank 1 reads only rank 0's (intact) record
    } catch (const CommError& e) {
      if (r == 0) rank0Error = e.what();
    }
  });
  EXPECT_NE(rank0Error.find("malformed agreement record"), std::string::npos) << rank0Error;
}

INSTANTIATE_TEST_SUITE_P(Records, MalformedAgreement, ::testing::Values("", "0", "2x"));

}  // namespace
}  // namespace zeroplus::pg
