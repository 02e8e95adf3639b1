#include "optimizers/core/checkpoint/verified_read.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <system_error>
#include <thread>

#include "common/core/crc32.hpp"
#include "common/core/full_io.hpp"

namespace zeroplus::ckpt {
namespace {

// "[a, b)" (appended piece by piece: GCC 12 warns falsely, -Wrestrict, on "[" + std::to_string(a)).
std::string span(int64_t a, int64_t b) {
  std::string s(1, '[');
  s += std::to_string(a);
  s += ", ";
  s += std::to_string(b);
  s += ')';
  return s;
}

int fill(ReadFailure* f, int code, bool corrupt, std::string message) {
  f->code = code;
  f->corrupt = corrupt;
  f->message = std::move(message);
  return code;
}

// One copy out of a partly covered block: its bytes [from, to) -> dst.
struct Copy {
  int64_t from, to;
  uint8_t* dst;
};

// A run of whole blocks [start, end) read into dst, or (dst == nullptr) the one block at start
// read into a buffer and fanned out to `copies`.
struct Task {
  int64_t start, end;
  uint8_t* dst;
  std::vector<Copy> copies;
};

// The per-thread buffer of partly covered blocks: grown, never zeroed (every byte is read over).
struct Scratch {
  std::unique_ptr<uint8_t[]> data;
  int64_t size = 0;
  uint8_t* get(int64_t n) {
    if (n > size) {
      data.reset(new uint8_t[static_cast<size_t>(n)]);
      size = n;
    }
    return data.get();
  }
};

int readFully(int fd, uint8_t* p, int64_t n, int64_t offset, ReadFailure* f) {
  int64_t done = 0;
  bool ended = false;
  const int rc = fs::preadFull(fd, p, n, offset, &done, &ended);
  if (rc == 0) return 0;
  if (ended) {
    return fill(f, -EIO, false, "checkpoint: file is truncated: wanted " + std::to_string(n) + " bytes at offset " +
                                    std::to_string(offset) + ", it ends at " + std::to_string(offset + done));
  }
  return fill(f, rc, false, "checkpoint: cannot read bytes " + span(offset, offset + n) + ": " + std::strerror(-rc));
}

// Reads the block(s) of [start, end) into `into` one block at a time and checks each while its
// bytes are still in the CPU's cache.
int readChecked(const VerifiedFile& file, int64_t start, int64_t end, uint8_t* into, ReadFailure* f) {
  const int64_t bs = file.blockBytes;
  for (int64_t a = start; a < end; a += bs) {
    const int64_t z = std::min(a + bs, end);
    if (const int rc = readFully(file.fd, into + (a - start), z - a, a, f); rc < 0) return rc;
    if (checksum::crc32(0, into + (a - start), static_cast<size_t>(z - a)) != file.blockCrc32[a / bs]) {
      return fill(f, -EIO, true, "checkpoint: checksum mismatch in bytes " + span(a, z) + " (corrupt file)");
    }
  }
  return 0;
}

int runTask(const VerifiedFile& file, const Task& t, Scratch* scratch, ReadFailure* f) {
  if (t.dst != nullptr) return readChecked(file, t.start, t.end, t.dst, f);
  uint8_t* buf = scratch->get(t.end - t.start);
  if (const int rc = readChecked(file, t.start, t.end, buf, f); rc < 0) return rc;
  for (const Copy& c : t.copies) std::memcpy(c.dst, buf + c.from, static_cast<size_t>(c.to - c.from));
  return 0;
}

int checkArguments(const VerifiedFile& file, const std::vector<ReadPiece>& pieces, const VerifiedReadOptions& o,
                   ReadFailure* f) {
  auto bad = [f](const std::string& what) {
    f->badArgument = true;
    return fill(f, -EINVAL, false, "checkpoint: verified read: " + what);
  };
  if (file.fd < 0) return bad("fd must be an open descriptor, got " + std::to_string(file.fd));
  if (file.bytes < 0) return bad("file bytes must be >= 0, got " + std::to_string(file.bytes));
  if (file.blockBytes <= 0) return bad("block bytes must be > 0, got " + std::to_string(file.blockBytes));
  const int64_t blocks = file.bytes / file.blockBytes + (file.bytes % file.blockBytes != 0);
  if (file.blocks != blocks || (blocks > 0 && file.blockCrc32 == nullptr)) {
    return bad("a file of " + std::to_string(file.bytes) + " bytes in blocks of " + std::to_string(file.blockBytes) +
               " needs " + std::to_string(blocks) + " block CRCs, got " + std::to_string(file.blocks));
  }
  if (o.threads < 1) return bad("threads must be >= 1, got " + std::to_string(o.threads));
  if (o.taskBytes < 1) return bad("task bytes must be >= 1, got " + std::to_string(o.taskBytes));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ReadPiece& p = pieces[i];
    if (p.lo < 0 || p.lo > p.hi || p.hi > file.bytes) {
      return bad("piece " + std::to_string(i) + " covers bytes " + span(p.lo, p.hi) + ", outside the file's " +
                 span(0, file.bytes));
    }
    if (p.hi > p.lo && p.dst == nullptr) return bad("piece " + std::to_string(i) + " has no destination");
  }
  return 0;
}

// The plan (header comment), in file order.
std::vector<Task> plan(const VerifiedFile& file, const std::vector<ReadPiece>& pieces, int64_t taskBytes) {
  const int64_t bs = file.blockBytes, size = file.bytes;
  const int64_t runBlocks = std::max<int64_t>(1, taskBytes / bs);
  std::vector<size_t> order(pieces.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pieces[a].lo < pieces[b].lo; });
  std::vector<Task> tasks;
  std::map<int64_t, std::vector<Copy>> partial;  // block -> its copies
  for (const size_t i : order) {
    const auto [lo, hi, dst] = pieces[i];
    if (hi <= lo) continue;
    const int64_t last = (hi - 1) / bs;
    for (int64_t b = lo / bs; b <= last;) {
      const int64_t start = b * bs, end = std::min(start + bs, size);
      if (start >= lo && end <= hi) {  // whole blocks: a run of them, read in place
        int64_t k = b;
        while (k < last && k + 1 - b < runBlocks && std::min((k + 2) * bs, size) <= hi) ++k;
        const int64_t stop = std::min((k + 1) * bs, size);
        tasks.push_back(Task{start, stop, dst + (start - lo), {}});
        b = k + 1;
      } else {
        const int64_t a = std::max(lo, start), z = std::min(hi, end);
        partial[b].push_back(Copy{a - start, z - start, dst + (a - lo)});
        ++b;
      }
    }
  }
  for (auto& [b, copies] : partial) {
    tasks.push_back(Task{b * bs, std::min((b + 1) * bs, size), nullptr, std::move(copies)});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.start < b.start; });
  return tasks;
}

}  // namespace

int verifiedRead(const VerifiedFile& file, const std::vector<ReadPiece>& pieces, const VerifiedReadOptions& options,
                 ReadFailure* failure) {
  ReadFailure local;
  ReadFailure* f = failure != nullptr ? failure : &local;
  *f = ReadFailure{};
  if (const int rc = checkArguments(file, pieces, options, f); rc < 0) return rc;
  const std::vector<Task> tasks = plan(file, pieces, options.taskBytes);
  std::vector<ReadFailure> results(tasks.size());
  // Tasks are handed out in file order; after a failure no new one starts. Every task not
  // started lies after every started one, so the first failure in file order is among those run.
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    Scratch scratch;
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= tasks.size()) return;
      int rc;
      try {
        rc = runTask(file, tasks[i], &scratch, &results[i]);
      } catch (const std::bad_alloc&) {
        results[i].code = rc = -ENOMEM;  // set first: building the message may fail the same way
        try {
          results[i].message = "checkpoint: no memory for a block buffer of " +
                               std::to_string(tasks[i].end - tasks[i].start) + " bytes reading bytes " +
                               span(tasks[i].start, tasks[i].end);
        } catch (const std::bad_alloc&) {
        }
      }
      if (rc < 0) failed.store(true, std::memory_order_relaxed);
    }
  };
  const size_t threads = std::min<size_t>(static_cast<size_t>(options.threads), tasks.size());
  std::vector<std::thread> helpers;
  helpers.reserve(threads);  // no reallocation between starting threads (a throw there would leave them joinable)
  for (size_t i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no thread to be had (EAGAIN): the ones started and this one do the work
    }
  }
  work();
  for (std::thread& t : helpers) t.join();  // after this no task writes into a destination
  for (ReadFailure& r : results) {
    if (r.code < 0) {
      *f = std::move(r);
      return f->code;
    }
  }
  return 0;
}

}  // namespace zeroplus::ckpt
