// Registers zeroplus::check_manifest (the checkpoint manifest's validator), zeroplus::crc32
// (checksums of file bytes) and zeroplus::create_exclusive / create_temporary / private_directory (by path) and
// their descriptor-relative peers open_directory_at / make_private_directory_at /
// create_exclusive_at / create_temporary_at / open_regular_at: the Python side's door to
// common/core/exclusive_file.hpp (zeroplus.files wraps them), so checkpoint and offload code
// written in Python creates its files under the same rules as the C++ code. Errors are
// RuntimeError texts "zeroplus <op> failed on '<path>': <strerror> (errno N)", which
// zeroplus.files turns into the matching OSError subclass. The *_at ops take a descriptor the
// caller owns (dir_fd -1: the working directory) and name it in errors by its /proc path.
#include <fcntl.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/core/crc32.hpp"
#include "common/core/exclusive_file.hpp"
#include "optimizers/core/checkpoint/manifest.hpp"
#include "optimizers/core/checkpoint/shard_file_writer.hpp"
#include "optimizers/core/checkpoint/verified_read.hpp"

namespace zeroplus::registration {
namespace {

[[noreturn]] void fail(const char* op, const std::string& path, int rc) {
  TORCH_CHECK(false, "zeroplus ", op, " failed on '", path, "': ", std::strerror(-rc), " (errno ", -rc, ")");
}

fs::UniqueFd openDir(const char* op, const std::string& dir) {
  fs::UniqueFd d;
  if (const int rc = fs::openDirectory(dir, &d); rc < 0) fail(op, dir, rc);
  return d;
}

int64_t createExclusive(const std::string& dir, const std::string& name, int64_t mode) {
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 07777, "zeroplus create_exclusive: mode must be in [0, 0o7777], got ", mode);
  auto d = openDir("create_exclusive", dir);
  fs::UniqueFd fd;
  if (const int rc = fs::createExclusive(d.get(), name, static_cast<mode_t>(mode), 0, &fd); rc < 0) {
    fail("create_exclusive", dir + "/" + name, rc);
  }
  return fd.release();
}

std::tuple<int64_t, std::string> createTemporary(const std::string& dir, const std::string& prefix, int64_t mode) {
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 07777, "zeroplus create_temporary: mode must be in [0, 0o7777], got ", mode);
  auto d = openDir("create_temporary", dir);
  fs::UniqueFd fd;
  std::string name;
  if (const int rc = fs::createTemporary(d.get(), prefix, static_cast<mode_t>(mode), 0, &fd, &name); rc < 0) {
    fail("create_temporary", dir + "/" + prefix + "*", rc);
  }
  return {fd.release(), name};
}

int64_t privateDirectory(const std::string& parent, const std::string& name) {
  auto d = openDir("private_directory", parent);
  fs::UniqueFd fd;
  if (const int rc = fs::ensurePrivateDirectory(d.get(), name, &fd); rc < 0) {
    fail("private_directory", parent + "/" + name, rc);
  }
  return fd.release();
}

void checkMode(const char* op, int64_t mode) {
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 07777, "zeroplus ", op, ": mode must be in [0, 0o7777], got ", mode);
}

int atFd(const char* op, int64_t dirFd) {
  TORCH_CHECK_VALUE(dirFd >= -1 && dirFd <= INT_MAX, "zeroplus ", op, ": dir_fd must be a descriptor or -1, got ",
                    dirFd);
  return dirFd < 0 ? AT_FDCWD : static_cast<int>(dirFd);
}

// What an error names for `name` relative to `dirFd`: the directory's path as the kernel
// knows it (readlink of /proc/self/fd/N), else "<fd N>".
std::string atPath(int dirFd, const std::string& name) {
  if (dirFd == AT_FDCWD || (!name.empty() && name[0] == '/')) return name;
  char buf[PATH_MAX];
  const std::string link = "/proc/self/fd/" + std::to_string(dirFd);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf));
  return (n > 0 ? std::string(buf, static_cast<size_t>(n)) : "<fd " + std::to_string(dirFd) + ">") + "/" + name;
}

int64_t openDirectoryAt(int64_t dirFd, const std::string& path, bool owned) {
  const int at = atFd("open_directory_at", dirFd);
  fs::UniqueFd fd;
  if (const int rc = fs::openDirectoryAt(at, path, owned, &fd); rc < 0) fail("open_directory_at", atPath(at, path), rc);
  return fd.release();
}

int64_t makePrivateDirectoryAt(int64_t dirFd, const std::string& name) {
  const int at = atFd("make_private_directory_at", dirFd);
  fs::UniqueFd fd;
  if (const int rc = fs::createPrivateDirectory(at, name, &fd); rc < 0) {
    fail("make_private_directory_at", atPath(at, name), rc);
  }
  return fd.release();
}

int64_t createExclusiveAt(int64_t dirFd, const std::string& name, int64_t mode) {
  checkMode("create_exclusive_at", mode);
  const int at = atFd("create_exclusive_at", dirFd);
  fs::UniqueFd fd;
  if (const int rc = fs::createExclusive(at, name, static_cast<mode_t>(mode), 0, &fd); rc < 0) {
    fail("create_exclusive_at", atPath(at, name), rc);
  }
  return fd.release();
}

std::tuple<int64_t, std::string> createTemporaryAt(int64_t dirFd, const std::string& prefix, int64_t mode) {
  checkMode("create_temporary_at", mode);
  const int at = atFd("create_temporary_at", dirFd);
  fs::UniqueFd fd;
  std::string name;
  if (const int rc = fs::createTemporary(at, prefix, static_cast<mode_t>(mode), 0, &fd, &name); rc < 0) {
    fail("create_temporary_at", atPath(at, prefix + "*"), rc);
  }
  return {fd.release(), name};
}

int64_t openRegularAt(int64_t dirFd, const std::string& name, bool owned) {
  const int at = atFd("open_regular_at", dirFd);
  fs::UniqueFd fd;
  if (const int rc = fs::openRegularForReading(at, name, owned, &fd); rc < 0) fail("open_regular_at", atPath(at, name), rc);
  return fd.release();
}

// The checkpoint format's block checksum (common/core/crc32.hpp): zlib's crc32() of a CPU
// tensor's bytes, continuing `crc`.
int64_t crc32Of(const at::Tensor& data, int64_t crc) {
  TORCH_CHECK(data.device().is_cpu(), "zeroplus crc32: data must be a CPU tensor, got ", data.device());
  TORCH_CHECK(data.is_contiguous(), "zeroplus crc32: data must be contiguous");
  TORCH_CHECK(crc >= 0 && crc <= int64_t{UINT32_MAX}, "zeroplus crc32: crc must be in [0, 2^32), got ", crc);
  return checksum::crc32(static_cast<uint32_t>(crc), data.const_data_ptr(), data.nbytes());
}

// -- verified reads of checkpoint shard files (optimizers/core/checkpoint/verified_read.hpp) ------
// zeroplus.checkpoint.reader's byte work: file bytes [lo[i], hi[i]) into dst[i] from byte
// dst_offset[i] on, every block touched checked against block_crc32 (int64 tensor, one per
// block). The GIL is not held (torch.ops releases it around every op), so the reader's threads
// run in C++ while Python goes on. Returns (0, False, "") or (-errno, corrupt, message): the
// caller raises CheckpointCorruptError / OSError naming the file. threads 0: the core's default
// (VerifiedReadOptions: 4, whatever the core count). Bad arguments: ValueError.
std::tuple<int64_t, bool, std::string> verifiedReadOp(int64_t fd, int64_t fileBytes, int64_t blockBytes,
                                                      const at::Tensor& blockCrc32, at::IntArrayRef lo,
                                                      at::IntArrayRef hi, at::TensorList dst,
                                                      at::IntArrayRef dstOffset, int64_t threads) {
  TORCH_CHECK_VALUE(fd >= 0 && fd <= INT_MAX, "zeroplus verified_read: fd must be a descriptor, got ", fd);
  TORCH_CHECK_VALUE(threads >= 0 && threads <= 256,
                    "zeroplus verified_read: threads must be in [0, 256] (0: the default), got ", threads);
  TORCH_CHECK_VALUE(blockCrc32.device().is_cpu() && blockCrc32.scalar_type() == at::kLong && blockCrc32.dim() == 1,
                    "zeroplus verified_read: block_crc32 must be a 1-D CPU int64 tensor, got ",
                    blockCrc32.scalar_type(), " of ", blockCrc32.dim(), " dims on ", blockCrc32.device());
  TORCH_CHECK_VALUE(lo.size() == dst.size() && hi.size() == dst.size() && dstOffset.size() == dst.size(),
                    "zeroplus verified_read: lo, hi, dst and dst_offset must have one entry per piece, got ",
                    lo.size(), ", ", hi.size(), ", ", dst.size(), ", ", dstOffset.size());
  const at::Tensor crcs = blockCrc32.contiguous();
  std::vector<uint32_t> crc(static_cast<size_t>(crcs.numel()));
  const int64_t* c = crcs.const_data_ptr<int64_t>();
  for (size_t i = 0; i < crc.size(); ++i) {
    TORCH_CHECK_VALUE(c[i] >= 0 && c[i] <= int64_t{UINT32_MAX}, "zeroplus verified_read: block_crc32[", i,
                      "] must be in [0, 2^32), got ", c[i]);
    crc[i] = static_cast<uint32_t>(c[i]);
  }
  std::vector<ckpt::ReadPiece> pieces(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    TORCH_CHECK_VALUE(d.device().is_cpu() && d.is_contiguous(), "zeroplus verified_read: dst[", i,
                      "] must be a contiguous CPU tensor");
    const int64_t n = hi[i] - lo[i];
    TORCH_CHECK_VALUE(n >= 0 && dstOffset[i] >= 0 && dstOffset[i] <= static_cast<int64_t>(d.nbytes()) - n,
                      "zeroplus verified_read: piece ", i, " (file bytes [", lo[i], ", ", hi[i], ") to dst_offset ",
                      dstOffset[i], ") does not fit its destination of ", d.nbytes(), " bytes");
    pieces[i] = ckpt::ReadPiece{lo[i], hi[i], static_cast<uint8_t*>(d.data_ptr()) + dstOffset[i]};
  }
  const ckpt::VerifiedFile file{static_cast<int>(fd), fileBytes, blockBytes, crc.data(),
                                static_cast<int64_t>(crc.size())};
  ckpt::ReadFailure why;
  ckpt::VerifiedReadOptions options;
  if (threads > 0) options.setThreads(static_cast<int>(threads));
  const int rc = ckpt::verifiedRead(file, pieces, options, &why);
  TORCH_CHECK_VALUE(!why.badArgument, "zeroplus ", why.message);
  return {rc, why.corrupt, why.message};
}

// -- the checkpoint manifest's validator (optimizers/core/checkpoint/manifest.hpp) ---------------
// format.py parse_manifest's check: ckpt::parseManifest over the manifest's bytes, the one
// definition of a valid manifest for the Python and the LibTorch reader. `data` is declared str
// but is passed a Python bytes: pybind11 copies a bytes object into std::string as it is (no UTF-8
// decoding), while the GIL is held, so the parser sees exactly the bytes Python then hands to
// json.loads, and no other thread can change them under the check. Returns (0, "") or (rc, what):
// -EIO corrupt, -ENOTSUP a newer format version, -EINVAL malformed; format.py raises
// CheckpointCorruptError / CheckpointVersionError / CheckpointError with "<where>: <what>". `what`
// is UTF-8 (names quoted in it passed the parser's UTF-8 check).
std::tuple<int64_t, std::string> checkManifestOp(const std::string& data) {
  ckpt::Manifest m;
  std::string what;
  const int rc = ckpt::parseManifest(data, &m, &what);
  return {rc, rc < 0 ? what : std::string()};
}

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
  m.def("check_manifest(str data) -> (int, str)", &zeroplus::registration::checkManifestOp);
  m.def("crc32(Tensor data, int crc) -> int", &zeroplus::registration::crc32Of);
  m.def("create_exclusive(str directory, str name, int mode) -> int", &zeroplus::registration::createExclusive);
  m.def("create_temporary(str directory, str prefix, int mode) -> (int, str)",
        &zeroplus::registration::createTemporary);
  m.def("private_directory(str parent, str name) -> int", &zeroplus::registration::privateDirectory);
  m.def("open_directory_at(int dir_fd, str path, bool owned) -> int", &zeroplus::registration::openDirectoryAt);
  m.def("make_private_directory_at(int dir_fd, str name) -> int", &zeroplus::registration::makePrivateDirectoryAt);
  m.def("create_exclusive_at(int dir_fd, str name, int mode) -> int", &zeroplus::registration::createExclusiveAt);
  m.def("create_temporary_at(int dir_fd, str prefix, int mode) -> (int, str)",
        &zeroplus::registration::createTemporaryAt);
  m.def("open_regular_at(int dir_fd, str name, bool owned) -> int", &zeroplus::registration::openRegularAt);
  m.def("verified_read(int fd, int file_bytes, int block_bytes, Tensor block_crc32, int[] lo, int[] hi, Tensor[] dst, "
        "int[] dst_offset, int threads=0) -> (int, bool, str)",
        &zeroplus::registration::verifiedReadOp);
}

// -- torch.classes.zeroplus.ShardFileWriter ------------------------------------------------------
// Python's door to ckpt::ShardFileWriter (checkpoint/shard_io.py drives it; the layout, I/O and
// durability are the core's). Method calls run with the GIL released (torch releases it around
// every custom-class method), so the byte work never stalls the training thread of an async
// save. Errors: RuntimeError "zeroplus write_shard failed on '<temporary file>': <what> (errno N)",
// or an aio error's own "zeroplus.aio: <op> failed on '<file>' ... (errno N)" (shard_io.py maps
// either to the OSError of that errno, naming the file); bad arguments ValueError. The writer keeps
// no tensor alive: shard_io.py holds each placed tensor until drain() or finish() returned.
namespace zeroplus::registration {
namespace {

class ShardFileWriterHolder : public torch::CustomClassHolder {
 public:
  ShardFileWriterHolder(int64_t dirFd, const std::string& dirPath, int64_t rank, const std::string& io,
                        const std::string& direct, int64_t blockBytes, int64_t segmentBytes) {
    TORCH_CHECK_VALUE(dirFd >= 0 && dirFd <= INT_MAX, "zeroplus write_shard: dir_fd must be a descriptor, got ", dirFd);
    TORCH_CHECK_VALUE(rank >= 0 && rank <= INT_MAX, "zeroplus write_shard: rank must be >= 0, got ", rank);
    TORCH_CHECK_VALUE(io == "aio" || io == "posix", "zeroplus write_shard: io must be 'aio' or 'posix', got '", io,
                      "'");
    TORCH_CHECK_VALUE(direct == "auto" || direct == "off",
                      "zeroplus write_shard: direct must be 'auto' or 'off', got '", direct, "'");
    TORCH_CHECK_VALUE(blockBytes > 0 && blockBytes <= ckpt::kMaxBlockBytes,
                      "zeroplus write_shard: block_bytes must be in (0, ", ckpt::kMaxBlockBytes, "], got ", blockBytes);
    TORCH_CHECK_VALUE(segmentBytes > 0, "zeroplus write_shard: segment_bytes must be > 0, got ", segmentBytes);
    ckpt::ShardFileOptions o;
    o.setIo(io == "aio" ? ckpt::ShardIo::Aio : ckpt::ShardIo::Posix)
        .setDirect(direct == "auto" ? aio::DirectMode::Auto : aio::DirectMode::Off)
        .setBlockBytes(blockBytes)
        .setSegmentBytes(segmentBytes);
    std::string error;
    check(writer_.open(static_cast<int>(dirFd), dirPath, static_cast<int>(rank), o, &error), error);
  }

  // (offset in the file, whether the writer still reads `data` after returning: the caller then
  // keeps it alive and unchanged until drain() or finish()).
  std::tuple<int64_t, bool> place(const at::Tensor& data) {
    TORCH_CHECK_VALUE(data.device().is_cpu() && data.is_contiguous(),
                      "zeroplus write_shard: data must be a contiguous CPU tensor, got ", data.device());
    int64_t offset = 0;
    std::string error;
    const auto bytes = static_cast<int64_t>(data.nbytes());
    check(writer_.place(data.const_data_ptr(), bytes, &offset, &error), error);
    return {offset, writer_.readsAfterPlace(bytes)};
  }

  void drain() {
    std::string error;
    check(writer_.drain(&error), error);
  }

  // (bytes, block CRC-32s) of the file now published under its final name.
  std::tuple<int64_t, std::vector<int64_t>> finish() {
    ckpt::FileRecord record;
    std::string error;
    check(writer_.finish(&record, &error), error);
    return {record.bytes, std::vector<int64_t>(record.blockCrc32.begin(), record.blockCrc32.end())};
  }

  void abandon() { writer_.abandon(); }

 private:
  // An aio::IoError's text already names the operation, file, range and errno: it is passed on
  // as it is (what AioHandle raised when the Python writer used it); the writer's own get the
  // op's form.
  void check(int rc, const std::string& error) const {
    if (rc >= 0) return;
    TORCH_CHECK(error.find("(errno ") == std::string::npos, error);
    TORCH_CHECK(false, "zeroplus write_shard failed on '", writer_.path(), "': ", error, " (errno ", -rc, ")");
  }

  ckpt::ShardFileWriter writer_;
};

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
  using Self = c10::intrusive_ptr<zeroplus::registration::ShardFileWriterHolder>;
  m.class_<zeroplus::registration::ShardFileWriterHolder>("ShardFileWriter")
      .def(torch::init<int64_t, std::string, int64_t, std::string, std::string, int64_t, int64_t>())
      .def("place", [](const Self& s, const at::Tensor& data) { return s->place(data); })
      .def("drain", [](const Self& s) { s->drain(); })
      .def("finish", [](const Self& s) { return s->finish(); })
      .def("abandon", [](const Self& s) { s->abandon(); });
}
