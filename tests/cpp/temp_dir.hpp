// TempDir: a fresh directory under the system's temporary directory (mkdtemp: private, 0700),
// removed with everything in it when the object goes. The one temporary-directory helper of
// the GoogleTest suites (torch-free, header-only). Not zeroplus::testing: code inside namespace
// zeroplus would then find it before GoogleTest's ::testing.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace zeroplus::test_util {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "zeroplus-test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace zeroplus::test_util
