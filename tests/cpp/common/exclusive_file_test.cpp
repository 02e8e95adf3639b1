// Exclusive, non-following creation (common/core/exclusive_file.hpp): planted symbolic links,
// FIFOs and regular files are never opened, truncated or followed.
#include "common/core/exclusive_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace zeroplus::fs {
namespace {

namespace stdfs = std::filesystem;

class ExclusiveFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char templ[] = "/tmp/zeroplus-excl-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    root_ = templ;
    victim_ = root_ + "/victim";
    std::ofstream(victim_) << "precious";
    ASSERT_EQ(openDirectory(root_, &dir_), 0);
  }
  void TearDown() override { stdfs::remove_all(root_); }
  std::string contents(const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

  std::string root_;
  std::string victim_;
  UniqueFd dir_;
};

TEST_F(ExclusiveFile, CreatesANewFileAndRefusesAnyExistingName) {
  UniqueFd fd;
  ASSERT_EQ(createExclusive(dir_.get(), "fresh", 0600, 0, &fd), 0);
  ASSERT_EQ(::write(fd.get(), "x", 1), 1);
  struct stat st {};
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  UniqueFd again;
  EXPECT_EQ(createExclusive(dir_.get(), "fresh", 0600, 0, &again), -EEXIST);  // a planted regular file
  EXPECT_EQ(contents(root_ + "/fresh"), "x");                                 // ... is not truncated
  EXPECT_FALSE(again);
}

TEST_F(ExclusiveFile, APlantedSymlinkIsNeitherFollowedNorReplaced) {
  stdfs::create_symlink(victim_, root_ + "/link");
  stdfs::create_symlink(root_ + "/nowhere", root_ + "/dangling");  // O_CREAT would create the target
  UniqueFd fd;
  EXPECT_EQ(createExclusive(dir_.get(), "link", 0644, 0, &fd), -EEXIST);
  EXPECT_EQ(createExclusive(dir_.get(), "dangling", 0644, 0, &fd), -EEXIST);
  EXPECT_FALSE(stdfs::exists(root_ + "/nowhere"));
  EXPECT_EQ(contents(victim_), "precious");
  EXPECT_TRUE(stdfs::is_symlink(root_ + "/link"));
  EXPECT_EQ(openRegularForReading(dir_.get(), "link", false, &fd), -ELOOP);
}

TEST_F(ExclusiveFile, TemporaryNamesAreUnpredictableAndExclusive) {
  std::set<std::string> names;
  for (int i = 0; i < 64; ++i) {
    UniqueFd fd;
    std::string name;
    ASSERT_EQ(createTemporary(dir_.get(), ".ckpt.tmp-", 0644, 0, &fd, &name), 0);
    EXPECT_EQ(name.rfind(".ckpt.tmp-", 0), 0u) << name;
    EXPECT_EQ(name.size(), std::string(".ckpt.tmp-").size() + 16);
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 64u);
  EXPECT_NE(randomSuffix(), randomSuffix());
}

TEST_F(ExclusiveFile, NamesThatEscapeTheDirectoryAreRejected) {
  UniqueFd fd;
  EXPECT_EQ(createExclusive(dir_.get(), "../escape", 0644, 0, &fd), -EINVAL);
  EXPECT_EQ(createExclusive(dir_.get(), "..", 0644, 0, &fd), -EINVAL);
  EXPECT_EQ(createExclusive(dir_.get(), "", 0644, 0, &fd), -EINVAL);
  EXPECT_EQ(ensurePrivateDirectory(dir_.get(), "a/b", &fd), -EINVAL);
}

TEST_F(ExclusiveFile, PrivateDirectoriesAre0700AndVerified) {
  UniqueFd d;
  ASSERT_EQ(ensurePrivateDirectory(dir_.get(), "swap", &d), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(d.get(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  UniqueFd again;
  EXPECT_EQ(ensurePrivateDirectory(dir_.get(), "swap", &again), 0);  // reuse is fine
  ASSERT_EQ(::mkdir((root_ + "/open").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((root_ + "/open").c_str(), 0777), 0);
  EXPECT_EQ(ensurePrivateDirectory(dir_.get(), "open", &again), -EACCES);
  stdfs::create_symlink(root_ + "/swap", root_ + "/linkdir");
  EXPECT_EQ(ensurePrivateDirectory(dir_.get(), "linkdir", &again), -ENOTDIR);
  EXPECT_EQ(ensurePrivateDirectory(dir_.get(), "victim", &again), -ENOTDIR);
}

TEST_F(ExclusiveFile, ReadingRefusesFifosAndLinksWithoutBlocking) {
  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0644), 0);
  UniqueFd fd;
  EXPECT_EQ(openRegularForReading(dir_.get(), "fifo", false, &fd), -EINVAL);  // and did not block
  EXPECT_EQ(openRegularForReading(dir_.get(), "missing", false, &fd), -ENOENT);
  ASSERT_EQ(openRegularForReading(dir_.get(), "victim", true, &fd), 0);
}

TEST_F(ExclusiveFile, DescriptorRelativeDirectoriesNeverFollowALink) {
  stdfs::create_directory(root_ + "/real");
  stdfs::create_symlink(root_ + "/real", root_ + "/link");
  UniqueFd d;
  EXPECT_EQ(openDirectoryAt(dir_.get(), "real", true, &d), 0);
  EXPECT_EQ(openDirectoryAt(dir_.get(), "link", false, &d), -ENOTDIR);  // even our own link
  EXPECT_EQ(openDirectoryAt(dir_.get(), "victim", false, &d), -ENOTDIR);
  EXPECT_EQ(openDirectoryAt(dir_.get(), "missing", false, &d), -ENOENT);
  EXPECT_EQ(openDirectoryAt(AT_FDCWD, root_ + "/real", true, &d), 0);
}

TEST_F(ExclusiveFile, NewPrivateDirectoriesAreExclusive0700) {
  UniqueFd d;
  const mode_t old = ::umask(0277);  // a umask that takes the owner's write bit
  const int rc = createPrivateDirectory(dir_.get(), "staging", &d);
  ::umask(old);
  ASSERT_EQ(rc, 0);
  struct stat st {};
  ASSERT_EQ(::fstat(d.get(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(createPrivateDirectory(dir_.get(), "staging", &d), -EEXIST);  // never an existing one
  stdfs::create_symlink(root_ + "/nowhere", root_ + "/dangling");
  EXPECT_EQ(createPrivateDirectory(dir_.get(), "dangling", &d), -EEXIST);
  EXPECT_FALSE(stdfs::exists(root_ + "/nowhere"));
  EXPECT_EQ(createPrivateDirectory(dir_.get(), "../up", &d), -EINVAL);
}

TEST_F(ExclusiveFile, DirectorySymlinksAreFollowedOnlyWhenTheirOwnersAreTrusted) {
  // Our own link to our own directory (a /nvme -> /mnt/nvme0 set-up) is followed.
  stdfs::create_directory(root_ + "/real");
  stdfs::create_symlink(root_ + "/real", root_ + "/mine");
  UniqueFd d;
  EXPECT_EQ(openDirectory(root_ + "/mine", &d), 0);
  EXPECT_EQ(openDirectory(victim_, &d), -ENOTDIR);
  if (::geteuid() != 0) GTEST_SKIP() << "a link owned by another user needs root to create";
  ASSERT_EQ(::lchown((root_ + "/mine").c_str(), 65534, 65534), 0);
  EXPECT_EQ(openDirectory(root_ + "/mine", &d), -ELOOP);
}

}  // namespace
}  // namespace zeroplus::fs
