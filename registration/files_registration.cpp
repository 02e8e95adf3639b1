// Registers zeroplus::create_exclusive / create_temporary / private_directory: the Python side's
// door to common/core/exclusive_file.hpp (zeroplus.files wraps them), so checkpoint and offload
// code written in Python creates its files under the same rules as the C++ code. Errors are
// RuntimeError texts "zeroplus <op> failed on '<path>': <strerror> (errno N)", which
// zeroplus.files turns into the matching OSError subclass.
#include <torch/library.h>

#include <cstring>
#include <string>
#include <tuple>

#include "common/core/exclusive_file.hpp"

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

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY_FRAGMENT(zeroplus, m) {
  m.def("create_exclusive(str directory, str name, int mode) -> int", &zeroplus::registration::createExclusive);
  m.def("create_temporary(str directory, str prefix, int mode) -> (int, str)",
        &zeroplus::registration::createTemporary);
  m.def("private_directory(str parent, str name) -> int", &zeroplus::registration::privateDirectory);
}
