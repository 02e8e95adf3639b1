// Every collective at world sizes {1,2,3,4} and counts {0, 1, odd, large}, ranks as threads,
// checked against a serial reference. Reductions use inputs whose results are exact in every
// type (small integers), so any order of evaluation must give the reference bytes exactly;
// a separate test uses random floats to check that all ranks get bitwise-identical results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <tuple>
#include <vector>

#include "process_group/core/half.hpp"
#include "test_group.hpp"

namespace zeroplus::pg {
namespace {

using testing::Group;
using testing::soon;

constexpr size_t kLarge = (size_t{1} << 20) + 3;  // ~1M elements, not divisible by 2, 3 or 4

const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt16,   DataType::kInt32,
                           DataType::kInt64,   DataType::kBool};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                         ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

// Connecting is the slow part of a test, so one group per world size serves the whole file.
Group& group(int n) {
  static std::map<int, std::unique_ptr<Group>> groups;
  auto& g = groups[n];
  if (!g) g = std::make_unique<Group>(n);
  return *g;
}

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void storeValue(DataType t, uint8_t* p, size_t i, double v, uint64_t bits) {
  switch (t) {
    case DataType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
    case DataType::kFloat16: reinterpret_cast<uint16_t*>(p)[i] = detail::floatToHalf(static_cast<float>(v)); break;
    case DataType::kBFloat16: reinterpret_cast<uint16_t*>(p)[i] = detail::floatToBf16(static_cast<float>(v)); break;
    case DataType::kInt8: reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(bits ? bits : v); break;
    case DataType::kUInt8: reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(bits ? bits : v); break;
    case DataType::kInt16: reinterpret_cast<int16_t*>(p)[i] = static_cast<int16_t>(bits ? bits : v); break;
    case DataType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(bits ? bits : v); break;
    case DataType::kInt64:
      reinterpret_cast<int64_t*>(p)[i] = bits ? static_cast<int64_t>(bits) : static_cast<int64_t>(v);
      break;
    case DataType::kBool: p[i] = static_cast<uint8_t>(static_cast<int>(v) & 1); break;
  }
}

double loadValue(DataType t, const uint8_t* p, size_t i) {
  switch (t) {
    case DataType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DataType::kFloat64: return reinterpret_cast<const double*>(p)[i];
    case DataType::kFloat16: return detail::halfToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DataType::kBFloat16: return detail::bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    default: return 0;
  }
}

// Inputs whose reduction over <= 4 ranks is exact in every type, so the reference is exact.
std::vector<uint8_t> makeInput(DataType t, ReduceOp op, int rank, size_t count, uint64_t seed) {
  std::vector<uint8_t> v(count * elementSize(t));
  const bool isUnsigned = t == DataType::kUInt8 || t == DataType::kBool;
  const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  for (size_t i = 0; i < count; ++i) {
    const uint64_t h = mix(seed * 1000003 + static_cast<uint64_t>(rank) * 7919 + i);
    double x = 0;
    uint64_t bits = 0;
    if (t == DataType::kBool) {
      // Bias towards 1 so that "all" reductions are not almost always 0.
      x = (h % 4) != 0;
    } else if (bitwise) {
      bits = h | 1;  // non-zero marks "use the bits"
    } else if (op == ReduceOp::kSum) {
      x = isUnsigned ? static_cast<double>(h % 9) : static_cast<double>(h % 17) - 8;
    } else if (op == ReduceOp::kProduct) {
      static const double kSigned[] = {-1, 1, 2}, kUnsigned[] = {1, 2, 1};
      x = (isUnsigned ? kUnsigned : kSigned)[h % 3];
    } else {
      x = isUnsigned ? static_cast<double>(h % 201) : static_cast<double>(h % 201) - 100;
    }
    storeValue(t, v.data(), i, x, bits);
  }
  return v;
}

// Serial reference: fold the ranks' inputs in rank order with the (separately tested) kernel.
std::vector<uint8_t> reference(const std::vector<std::vector<uint8_t>>& inputs, size_t count, DataType t,
                               ReduceOp op) {
  std::vector<uint8_t> acc = inputs[0];
  for (size_t p = 1; p < inputs.size(); ++p) reduceInto(acc.data(), inputs[p].data(), count, t, op);
  return acc;
}

// Index of the first differing byte, or -1; keeps failure output short for large buffers.
long firstDiff(const uint8_t* a, const uint8_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return -1;
}
long firstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return -2;
  return firstDiff(a.data(), b.data(), a.size());
}

std::vector<uint8_t> pattern(size_t bytes, uint64_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(mix(seed * 131 + i));
  return v;
}

class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  size_t count() const { return std::get<1>(GetParam()); }
  // Per-rank block for reduce_scatter/allgather-style ops: the large case shrinks so the
  // n-block buffers stay moderate, but stays above the small-message threshold.
  size_t blockCount() const { return count() == kLarge ? kLarge / 4 : count(); }
  Group& g() { return group(n()); }
};

TEST_P(CollectivesTest, AllreduceEveryTypeAndOp) {
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      if (!reduceSupported(t, op)) continue;
      std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n()));
      for (int r = 0; r < n(); ++r) in[static_cast<size_t>(r)] = makeInput(t, op, r, count(), 1);
      const auto ref = reference(in, count(), t, op);
      auto buf = in;
      g().run([&](Communicator& c, int r) {
        c.allreduce(buf[static_cast<size_t>(r)].data(), count(), t, op, soon());
      });
      for (int r = 0; r < n(); ++r) {
        ASSERT_EQ(firstDiff(buf[static_cast<size_t>(r)], ref), -1)
            << "rank " << r << " " << toString(t) << " " << toString(op);
      }
    }
  }
}

TEST_P(CollectivesTest, AllreduceRandomFloatsAreBitwiseIdenticalAcrossRanks) {
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    std::vector<std::vector<uint8_t>> buf(static_cast<size_t>(n()));
    std::vector<double> exact(count(), 0.0);
    for (int r = 0; r < n(); ++r) {
      auto& b = buf[static_cast<size_t>(r)];
      b.resize(count() * elementSize(t));
      for (size_t i = 0; i < count(); ++i) {
        const double x = static_cast<double>(mix(99 + static_cast<uint64_t>(r) * 31337 + i) % 2000001) / 1e6 - 1;
        storeValue(t, b.data(), i, x, 0);
        exact[i] += loadValue(t, b.data(), i);
      }
    }
    g().run([&](Communicator& c, int r) {
      c.allreduce(buf[static_cast<size_t>(r)].data(), count(), t, ReduceOp::kSum, soon());
    });
    const double tol = t == DataType::kFloat64 ? 1e-12 : t == DataType::kFloat32 ? 1e-5
                       : t == DataType::kFloat16 ? 1e-2 : 8e-2;
    for (int r = 1; r < n(); ++r) {
      ASSERT_EQ(firstDiff(buf[static_cast<size_t>(r)], buf[0]), -1) << "rank " << r << " " << toString(t);
    }
    for (size_t i = 0; i < count(); ++i) {
      ASSERT_NEAR(loadValue(t, buf[0].data(), i), exact[i], tol) << toString(t) << " at " << i;
    }
  }
}

TEST_P(CollectivesTest, ReduceEveryTypeAndOpToEveryRoot) {
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      if (!reduceSupported(t, op)) continue;
      // The large case covers every op on two types and sum on every type (time budget).
      if (count() == kLarge && t != DataType::kFloat32 && t != DataType::kInt32 && op != ReduceOp::kSum) continue;
      std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n()));
      for (int r = 0; r < n(); ++r) in[static_cast<size_t>(r)] = makeInput(t, op, r, count(), 2);
      const auto ref = reference(in, count(), t, op);
      for (int root = 0; root < n(); ++root) {
        if (count() == kLarge && root > 1) break;
        auto buf = in;
        g().run([&](Communicator& c, int r) {
          c.reduce(buf[static_cast<size_t>(r)].data(), count(), t, op, root, soon());
        });
        for (int r = 0; r < n(); ++r) {
          const auto& want = r == root ? ref : in[static_cast<size_t>(r)];
          ASSERT_EQ(firstDiff(buf[static_cast<size_t>(r)], want), -1)
              << "rank " << r << " root " << root << " " << toString(t) << " " << toString(op);
        }
      }
    }
  }
}

TEST_P(CollectivesTest, ReduceScatterEveryTypeAndOp) {
  const size_t bc = blockCount();
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      if (!reduceSupported(t, op)) continue;
      if (count() == kLarge && t != DataType::kFloat32 && t != DataType::kInt32 && op != ReduceOp::kSum) continue;
      const size_t es = elementSize(t);
      const size_t total = bc * static_cast<size_t>(n());
      std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n()));
      for (int r = 0; r < n(); ++r) in[static_cast<size_t>(r)] = makeInput(t, op, r, total, 3);
      const auto ref = reference(in, total, t, op);
      for (bool aliased : {false, true}) {
        auto src = in;
        std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n()), std::vector<uint8_t>(bc * es, 0xEE));
        g().run([&](Communicator& c, int r) {
          auto& s = src[static_cast<size_t>(r)];
          uint8_t* dst = aliased ? s.data() + static_cast<size_t>(r) * bc * es : out[static_cast<size_t>(r)].data();
          c.reduceScatter(s.data(), dst, bc, t, op, soon());
        });
        for (int r = 0; r < n(); ++r) {
          const uint8_t* got = aliased ? src[static_cast<size_t>(r)].data() + static_cast<size_t>(r) * bc * es
                                       : out[static_cast<size_t>(r)].data();
          ASSERT_EQ(firstDiff(got, ref.data() + static_cast<size_t>(r) * bc * es, bc * es), -1)
              << "rank " << r << " aliased " << aliased << " " << toString(t) << " " << toString(op);
          if (!aliased) {
            ASSERT_EQ(firstDiff(src[static_cast<size_t>(r)], in[static_cast<size_t>(r)]), -1);
          }
        }
      }
    }
  }
}

TEST_P(CollectivesTest, BroadcastFromEveryRoot) {
  const size_t bytes = count() * 4;  // large: 4 MiB, chain-pipelined for n >= 3
  for (int root = 0; root < n(); ++root) {
    const auto want = pattern(bytes, static_cast<uint64_t>(root) + 5);
    std::vector<std::vector<uint8_t>> buf(static_cast<size_t>(n()), std::vector<uint8_t>(bytes, 0));
    buf[static_cast<size_t>(root)] = want;
    g().run([&](Communicator& c, int r) { c.broadcast(buf[static_cast<size_t>(r)].data(), bytes, root, soon()); });
    for (int r = 0; r < n(); ++r) ASSERT_EQ(firstDiff(buf[static_cast<size_t>(r)], want), -1) << "rank " << r;
  }
}

TEST_P(CollectivesTest, AllgatherSeparateAndInPlace) {
  const size_t bytes = blockCount();
  for (bool inPlace : {false, true}) {
    std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n()));
    std::vector<uint8_t> want;
    for (int r = 0; r < n(); ++r) {
      in[static_cast<size_t>(r)] = pattern(bytes, static_cast<uint64_t>(r) + 11);
      want.insert(want.end(), in[static_cast<size_t>(r)].begin(), in[static_cast<size_t>(r)].end());
    }
    std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n()), std::vector<uint8_t>(want.size(), 0));
    g().run([&](Communicator& c, int r) {
      auto& o = out[static_cast<size_t>(r)];
      uint8_t* mine = o.data() + static_cast<size_t>(r) * bytes;
      if (inPlace && bytes > 0) std::memcpy(mine, in[static_cast<size_t>(r)].data(), bytes);
      c.allgather(inPlace ? mine : in[static_cast<size_t>(r)].data(), bytes, o.data(), soon());
    });
    for (int r = 0; r < n(); ++r) ASSERT_EQ(firstDiff(out[static_cast<size_t>(r)], want), -1) << "rank " << r;
  }
}

TEST_P(CollectivesTest, AllgathervWithUnevenCountsAndGaps) {
  const size_t nn = static_cast<size_t>(n());
  std::vector<size_t> counts(nn), displs(nn);
  size_t at = 0;
  for (size_t r = 0; r < nn; ++r) {
    counts[r] = r == 1 ? 0 : blockCount() + r * 7;  // one empty contribution, uneven others
    displs[r] = at + 3;                               // gaps between blocks stay untouched
    at = displs[r] + counts[r];
  }
  const size_t total = at + 5;
  std::vector<uint8_t> want(total, 0xAB);
  std::vector<std::vector<uint8_t>> in(nn);
  for (size_t r = 0; r < nn; ++r) {
    in[r] = pattern(counts[r], r + 21);
    if (counts[r]) std::memcpy(want.data() + displs[r], in[r].data(), counts[r]);
  }
  std::vector<std::vector<uint8_t>> out(nn, std::vector<uint8_t>(total, 0xAB));
  g().run([&](Communicator& c, int r) {
    c.allgatherv(in[static_cast<size_t>(r)].data(), out[static_cast<size_t>(r)].data(), counts, displs, soon());
  });
  for (size_t r = 0; r < nn; ++r) ASSERT_EQ(firstDiff(out[r], want), -1) << "rank " << r;
}

TEST_P(CollectivesTest, GatherAndScatterAtEveryRoot) {
  const size_t bytes = blockCount();
  const size_t nn = static_cast<size_t>(n());
  for (int root = 0; root < n(); ++root) {
    std::vector<std::vector<uint8_t>> in(nn);
    std::vector<uint8_t> all;
    for (size_t r = 0; r < nn; ++r) {
      in[r] = pattern(bytes, r * 3 + static_cast<size_t>(root));
      all.insert(all.end(), in[r].begin(), in[r].end());
    }
    std::vector<uint8_t> gathered(all.size(), 0);
    g().run([&](Communicator& c, int r) {
      c.gather(in[static_cast<size_t>(r)].data(), bytes, r == root ? gathered.data() : nullptr, root, soon());
    });
    ASSERT_EQ(firstDiff(gathered, all), -1) << "gather root " << root;

    std::vector<std::vector<uint8_t>> out(nn, std::vector<uint8_t>(bytes, 0));
    g().run([&](Communicator& c, int r) {
      c.scatter(r == root ? all.data() : nullptr, bytes, out[static_cast<size_t>(r)].data(), root, soon());
    });
    for (size_t r = 0; r < nn; ++r) ASSERT_EQ(firstDiff(out[r], in[r]), -1) << "scatter root " << root;
  }
}

TEST_P(CollectivesTest, AlltoallvWithUnevenCounts) {
  const size_t nn = static_cast<size_t>(n());
  // Bytes that `src` sends to `dst`: uneven, sometimes zero.
  auto amount = [&](size_t src, size_t dst) { return (blockCount() * ((src * 3 + dst * 5) % 7)) / 4; };
  std::vector<std::vector<uint8_t>> in(nn), out(nn), want(nn);
  std::vector<std::vector<size_t>> sc(nn, std::vector<size_t>(nn)), sd = sc, rc = sc, rd = sc;
  for (size_t r = 0; r < nn; ++r) {
    size_t s = 0, d = 0;
    for (size_t p = 0; p < nn; ++p) {
      sc[r][p] = amount(r, p);
      sd[r][p] = s;
      s += sc[r][p];
      rc[r][p] = amount(p, r);
      rd[r][p] = d + 1;  // one-byte gaps in the output
      d += rc[r][p] + 1;
    }
    in[r] = pattern(s, r + 40);
    out[r].assign(d, 0);
  }
  for (size_t r = 0; r < nn; ++r) {
    want[r].assign(out[r].size(), 0);
    for (size_t p = 0; p < nn; ++p) {
      if (rc[r][p]) std::memcpy(want[r].data() + rd[r][p], in[p].data() + sd[p][r], rc[r][p]);
    }
  }
  g().run([&](Communicator& c, int r) {
    const size_t rr = static_cast<size_t>(r);
    c.alltoallv(in[rr].data(), sc[rr], sd[rr], out[rr].data(), rc[rr], rd[rr], soon());
  });
  for (size_t r = 0; r < nn; ++r) ASSERT_EQ(firstDiff(out[r], want[r]), -1) << "rank " << r;
}

TEST_P(CollectivesTest, SendRecvAroundTheRing) {
  if (n() == 1) GTEST_SKIP() << "point-to-point needs a peer";
  const size_t bytes = count();
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n()), std::vector<uint8_t>(bytes, 0));
  g().run([&](Communicator& c, int r) {
    const int next = (r + 1) % n(), prev = (r + n() - 1) % n();
    const auto msg = pattern(bytes, static_cast<uint64_t>(r) + 60);
    // Even ranks send first, odd ranks receive first: blocking sends of large messages
    // around a ring would otherwise wait on each other (as with MPI_Send).
    if (r % 2 == 0) {
      c.send(msg.data(), bytes, next, 7, soon());
      c.recv(out[static_cast<size_t>(r)].data(), bytes, prev, 7, soon());
    } else {
      c.recv(out[static_cast<size_t>(r)].data(), bytes, prev, 7, soon());
      c.send(msg.data(), bytes, next, 7, soon());
    }
  });
  for (int r = 0; r < n(); ++r) {
    ASSERT_EQ(firstDiff(out[static_cast<size_t>(r)], pattern(bytes, static_cast<uint64_t>((r + n() - 1) % n()) + 60)),
              -1);
  }
}

TEST_P(CollectivesTest, BarrierAndMixedSequenceStayInStep) {
  std::vector<std::vector<float>> buf(static_cast<size_t>(n()), std::vector<float>(count() % 5000, 1.0f));
  g().run([&](Communicator& c, int r) {
    for (int i = 0; i < 3; ++i) {
      c.barrier(soon());
      auto& b = buf[static_cast<size_t>(r)];
      c.allreduce(b.data(), b.size(), DataType::kFloat32, ReduceOp::kSum, soon());
      c.broadcast(b.data(), b.size() * 4, i % n(), soon());
    }
  });
  const float want = std::pow(static_cast<float>(n()), 3.0f);
  for (int r = 0; r < n(); ++r) {
    for (float v : buf[static_cast<size_t>(r)]) ASSERT_EQ(v, want);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndCount, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{1001}, kLarge)),
                         [](const auto& info) {
                           const size_t c = std::get<1>(info.param);
                           return "n" + std::to_string(std::get<0>(info.param)) + "_count" +
                                  (c == kLarge ? std::string("Large") : std::to_string(c));
                         });

TEST(SendRecvTest, MessagesWithOtherTagsAreKeptForLaterReceives) {
  Group& g = group(2);
  g.run([&](Communicator& c, int r) {
    if (r == 0) {
      for (uint32_t tag : {1u, 2u, 3u}) {
        const std::vector<uint32_t> msg(tag * 10, tag);
        c.send(msg.data(), msg.size() * 4, 1, tag, soon());
      }
    } else {
      for (uint32_t tag : {3u, 1u, 2u}) {
        std::vector<uint32_t> msg(tag * 10, 0);
        c.recv(msg.data(), msg.size() * 4, 0, tag, soon());
        for (uint32_t v : msg) ASSERT_EQ(v, tag);
      }
    }
  });
}

}  // namespace
}  // namespace zeroplus::pg
