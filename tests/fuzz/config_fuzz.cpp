// Fuzzes every ZEROPLUS_* value parser: process_group/core/config.hpp (parseBytes, parseBool,
// parseShmMode, parseCudaTransport, applyOption, configFromEnvironment) and the optimizer's
// ZEROPLUS_CPU_ISA (optimizers/core/cpu_isa.hpp, parseIsa).
//
// Input: byte 0 picks the parser, the rest is the value (for applyOption "field=value"; for
// the environment, byte 1 picks the variable). Contract checked: a parser returns or throws
// std::invalid_argument (anything else escapes and aborts), and what it returns obeys the
// documented limits. parseBytes is compared with an exact 128-bit model of the grammar.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "optimizers/core/cpu_isa.hpp"
#include "process_group/core/config.hpp"

namespace pg = zeroplus::pg;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "config_fuzz: contract violated: %s\n", what);
    std::abort();
  }
}

// The documented grammar of sizes: digits, then "", B, K, KiB, k, M, MiB, G or GiB; below 1 TiB.
bool modelBytes(std::string_view v, unsigned __int128* out) {
  size_t i = 0;
  unsigned __int128 n = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') {
    n = n * 10 + static_cast<unsigned>(v[i] - '0');
    if (n > (static_cast<unsigned __int128>(1) << 80)) n = static_cast<unsigned __int128>(1) << 80;  // saturate
    ++i;
  }
  if (i == 0) return false;
  const std::string_view s = v.substr(i);
  unsigned shift;
  if (s == "" || s == "B") shift = 0;
  else if (s == "K" || s == "KiB" || s == "k") shift = 10;
  else if (s == "M" || s == "MiB") shift = 20;
  else if (s == "G" || s == "GiB") shift = 30;
  else return false;
  n <<= shift;
  if (n >= (static_cast<unsigned __int128>(1) << 40)) return false;
  *out = n;
  return true;
}

const char* const kEnv[] = {"ZEROPLUS_BUCKET_BYTES", "ZEROPLUS_FUSE",          "ZEROPLUS_SHM",
                            "ZEROPLUS_SHM_CHUNK_BYTES", "ZEROPLUS_SPIN_US",    "ZEROPLUS_INLINE_SYNC",
                            "ZEROPLUS_CUDA_TRANSPORT"};

void checkTuning(const pg::PgTuning& t) {
  check(t.bucketBytes < (size_t{1} << 40), "bucket_bytes below 1 TiB");
  check(t.shmChunkBytes >= 4096 && t.shmChunkBytes <= (256u << 20), "shm_chunk_bytes in 4K..256M");
  check(t.spinMicros <= 1000000, "spin_us <= 1000000");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 7;
  const std::string value(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (which) {
      case 0: {
        unsigned __int128 want = 0;
        const bool valid = modelBytes(value, &want);
        size_t got = 0;
        try {
          got = pg::parseBytes("ZEROPLUS_FUZZ", value);
        } catch (const std::invalid_argument&) {
          check(!valid, "parseBytes refused a valid size");
          return 0;
        }
        check(valid, "parseBytes accepted an invalid size");
        check(got == want, "parseBytes returned another value than the grammar says");
        break;
      }
      case 1: pg::parseBool("ZEROPLUS_FUZZ", value); break;
      case 2: pg::toString(pg::parseShmMode("ZEROPLUS_FUZZ", value)); break;
      case 3: pg::toString(pg::parseCudaTransport("ZEROPLUS_FUZZ", value)); break;
      case 4: {
        const size_t eq = value.find('=');
        pg::PgTuning t;
        pg::applyOption(t, std::string_view(value).substr(0, eq),
                        eq == std::string::npos ? std::string_view() : std::string_view(value).substr(eq + 1));
        checkTuning(t);
        break;
      }
      case 5: {
        if (value.empty()) return 0;
        // setenv cannot hold a NUL; the rest of the value is what a shell could export.
        const std::string v = value.substr(1, value.find('\0', 1) == std::string::npos ? std::string::npos
                                                                                     : value.find('\0', 1) - 1);
        const char* name = kEnv[static_cast<uint8_t>(value[0]) % (sizeof(kEnv) / sizeof(kEnv[0]))];
        ::setenv(name, v.c_str(), 1);
        try {
          checkTuning(pg::configFromEnvironment());
        } catch (...) {
          ::unsetenv(name);
          throw;
        }
        ::unsetenv(name);
        break;
      }
      case 6: {
        const auto isa = zeroplus::optim::parseIsa(value);
        if (isa) check(std::string_view(zeroplus::optim::isaName(*isa)) == value, "parseIsa round trip");
        break;
      }
    }
  } catch (const std::invalid_argument& e) {
    check(std::string_view(e.what()).find("zeroplus: ") == 0, "errors start with 'zeroplus: '");
  }
  return 0;
}
