#include "optimizers/core/checkpoint/checkpoint_files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "common/core/crc32.hpp"
#include "common/core/full_io.hpp"
#include "optimizers/core/checkpoint/verified_read.hpp"

namespace zeroplus::ckpt {
namespace {

int fail(std::string* error, int code, const std::string& what) {
  if (error) *error = what + (code < 0 ? std::string(" (") + std::strerror(-code) + ")" : std::string());
  return code;
}

int readWhole(int fd, int64_t limit, std::string* out) {
  struct stat st{};
  if (::fstat(fd, &st) != 0) return -errno;
  if (st.st_size > limit) return -EFBIG;
  out->resize(static_cast<size_t>(st.st_size));
  return fs::preadFull(fd, out->data(), st.st_size, 0);
}

std::string tempPrefix(const std::string& final) { return "." + final + ".tmp-"; }

// Makes `path` and its missing parents, 0700 each (as save.py make_directories).
int makeDirectories(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) {
    if (const int rc = makeDirectories(path.substr(0, slash)); rc < 0) return rc;
  }
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return -errno;
  return 0;
}

int renameat2Flags(int dirFd, const std::string& a, const std::string& b, unsigned flags) {
  return ::renameat2(dirFd, a.c_str(), dirFd, b.c_str(), flags) == 0 ? 0 : -errno;
}

// dirFd/name and everything in it, never following a link; a directory of another user is left.
void removeTree(int dirFd, const std::string& name, int depth = 0) {
  fs::UniqueFd fd;
  if (depth > 8 || fs::openDirectoryAt(dirFd, name, /*requireOwner=*/true, &fd) < 0) {
    ::unlinkat(dirFd, name.c_str(), 0);  // a file or link: the entry only
    return;
  }
  const int listFd = ::dup(fd.get());
  if (DIR* d = listFd >= 0 ? ::fdopendir(listFd) : nullptr) {
    std::vector<std::string> entries;
    while (const dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) entries.emplace_back(e->d_name);
    }
    ::closedir(d);
    for (const std::string& e : entries) {
      struct stat st{};
      if (::fstatat(fd.get(), e.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
        removeTree(fd.get(), e, depth + 1);
      } else {
        ::unlinkat(fd.get(), e.c_str(), 0);
      }
    }
  } else if (listFd >= 0) {
    ::close(listFd);
  }
  ::unlinkat(dirFd, name.c_str(), AT_REMOVEDIR);
}

// A small file written crash-consistently inside dirFd: temporary name, bytes, fdatasync; the
// caller renames it (*tmp) into place.
int writeTemporary(int dirFd, const std::string& final, const std::string& data, std::string* tmp) {
  fs::UniqueFd fd;
  if (const int rc = fs::createTemporary(dirFd, tempPrefix(final), 0600, 0, &fd, tmp); rc < 0) return rc;
  int rc = fs::pwriteFull(fd.get(), data.data(), static_cast<int64_t>(data.size()), 0);
  if (rc == 0 && ::fdatasync(fd.get()) != 0) rc = -errno;
  if (rc < 0) ::unlinkat(dirFd, tmp->c_str(), 0);
  return rc;
}

}  // namespace

int splitSavePath(const std::string& path, std::string* root, std::string* name, std::string* error) {
  if (path.empty()) return fail(error, -EINVAL, "path must not be empty");
  std::string abs = path;
  if (abs[0] != '/') {
    char cwd[4096];
    if (::getcwd(cwd, sizeof cwd) == nullptr) return fail(error, -errno, "cannot resolve the working directory");
    abs = std::string(cwd) + "/" + abs;
  }
  while (abs.size() > 1 && abs.back() == '/') abs.pop_back();
  const size_t slash = abs.find_last_of('/');
  *root = slash == 0 ? "/" : abs.substr(0, slash);
  *name = abs.substr(slash + 1);
  if (!isPlainDirName(*name)) {
    return fail(error, -EINVAL, "the checkpoint's directory name '" + *name + "' is not a plain directory name "
                                "(letters, digits, _ . + = -, not starting with '.', no '..')");
  }
  return 0;
}

bool isCheckpoint(int dirFd, const std::string& name) {
  fs::UniqueFd dir, mf;
  if (fs::openDirectoryAt(dirFd, name, false, &dir) < 0) return false;
  if (fs::openRegularForReading(dir.get(), kManifestName, false, &mf) < 0) return false;
  std::string data;
  if (readWhole(mf.get(), int64_t{1} << 32, &data) < 0) return false;
  json::Value v;
  if (json::parse(data, &v, nullptr) != 0) return false;
  const json::Value* format = v.find("format");
  return format != nullptr && format->isString() && format->s == kFormat;
}

int prepareSave(const std::string& root, const std::string& name, Staging* out, std::string* error) {
  const std::string where = root + "/" + name;
  if (const int rc = makeDirectories(root); rc < 0) return fail(error, rc, "cannot create the directory " + root);
  Staging s;
  s.root = root;
  s.name = name;
  if (const int rc = fs::openDirectory(root, &s.rootFd); rc < 0) return fail(error, rc, "cannot open " + root);
  fs::UniqueFd existing;
  const int rc = fs::openDirectoryAt(s.rootFd.get(), name, false, &existing);
  if (rc == 0) {
    const int listFd = ::dup(existing.get());
    bool empty = true;
    if (DIR* d = listFd >= 0 ? ::fdopendir(listFd) : nullptr) {
      while (const dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) empty = false;
      }
      ::closedir(d);
    }
    if (!empty && !isCheckpoint(s.rootFd.get(), name)) {
      return fail(error, -EEXIST, where + " exists, is not empty and is not a zeroplus checkpoint; refusing to replace it");
    }
  } else if (rc != -ENOENT) {
    return fail(error, -EEXIST, where + " exists and is not a directory");
  }
  // Locked before it carries a name Python's sweep of stale staging directories recognises.
  const std::string pending = "." + name + ".new-" + fs::randomSuffix();
  if (const int r = fs::createPrivateDirectory(s.rootFd.get(), pending, &s.stagingFd); r < 0) {
    return fail(error, r, "cannot create a staging directory in " + root);
  }
  s.staging = tempPrefix(name) + fs::randomSuffix();
  int r = ::flock(s.stagingFd.get(), LOCK_EX) == 0 ? 0 : -errno;
  if (r == 0) r = renameat2Flags(s.rootFd.get(), pending, s.staging, RENAME_NOREPLACE);
  if (r < 0) {
    removeTree(s.rootFd.get(), pending);
    return fail(error, r, "cannot set up the staging directory in " + root);
  }
  *out = std::move(s);
  return 0;
}

int openStaging(const std::string& root, const std::string& name, const std::string& staging, Staging* out,
                std::string* error) {
  Staging s;
  s.root = root;
  s.name = name;
  s.staging = staging;
  if (const int rc = fs::openDirectory(root, &s.rootFd); rc < 0) return fail(error, rc, "cannot open " + root);
  if (const int rc = fs::openDirectoryAt(s.rootFd.get(), staging, /*requireOwner=*/true, &s.stagingFd); rc < 0) {
    return fail(error, rc, "cannot open the staging directory " + root + "/" + staging);
  }
  *out = std::move(s);
  return 0;
}

void abandonSave(Staging& s) {
  if (s.rootFd && !s.staging.empty()) removeTree(s.rootFd.get(), s.staging);
  s.stagingFd = fs::UniqueFd();
}

int commitSave(Staging& s, const std::string& manifestBytes, std::string* error) {
  const std::string where = s.root + "/" + s.name;
  const int rootFd = s.rootFd.get();
  std::string tmp, latestTmp;
  bool replaced = false;
  int rc = writeTemporary(s.stagingFd.get(), kManifestName, manifestBytes, &tmp);
  if (rc == 0 && ::renameat(s.stagingFd.get(), tmp.c_str(), s.stagingFd.get(), kManifestName) != 0) {
    rc = -errno;
    ::unlinkat(s.stagingFd.get(), tmp.c_str(), 0);
  }
  // One fsync of the staging directory makes every entry durable (shards, manifest) before the
  // rename below makes NAME visible.
  if (rc == 0 && ::fsync(s.stagingFd.get()) != 0) rc = -errno;
  std::string what = rc < 0 ? "cannot write the manifest of " + where : "";
  if (rc == 0) {
    struct stat st{};
    if (::fstatat(rootFd, kLatestName, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
      rc = -EEXIST;
      what = std::string(kLatestName) + " next to " + where + " is a directory; refusing to save";
    }
  }
  if (rc == 0) {
    rc = writeTemporary(rootFd, kLatestName, s.name + "\n", &latestTmp);
    if (rc < 0) what = "cannot write the new " + std::string(kLatestName) + " next to " + where;
  }
  if (rc == 0 && ::renameat(rootFd, s.staging.c_str(), rootFd, s.name.c_str()) != 0) {
    rc = -errno;
    if ((rc == -ENOTEMPTY || rc == -EEXIST) && isCheckpoint(rootFd, s.name)) {
      // A complete checkpoint is there: swap atomically (NAME is one complete checkpoint or the other).
      rc = renameat2Flags(rootFd, s.staging, s.name, RENAME_EXCHANGE);
      replaced = rc == 0;
      if (rc < 0) what = "cannot replace the checkpoint " + where + " (renameat2 RENAME_EXCHANGE)";
    } else {
      rc = -EEXIST;
      what = where + " exists and is not a zeroplus checkpoint; refusing to replace it";
    }
  }
  if (rc < 0) {
    removeTree(rootFd, s.staging);
    if (!latestTmp.empty()) ::unlinkat(rootFd, latestTmp.c_str(), 0);
    s.stagingFd = fs::UniqueFd();
    return fail(error, rc, what);
  }
  s.stagingFd = fs::UniqueFd();  // releases the lock
  rc = ::fsync(rootFd) == 0 ? 0 : -errno;
  if (rc == 0 && ::renameat(rootFd, latestTmp.c_str(), rootFd, kLatestName) != 0) rc = -errno;
  if (rc == 0 && ::fsync(rootFd) != 0) rc = -errno;
  if (replaced) removeTree(rootFd, s.staging);  // the old checkpoint, now under the staging name
  if (rc < 0) {
    ::unlinkat(rootFd, latestTmp.c_str(), 0);
    return fail(error, rc, where + " was saved and is complete (loadable by its path), but " + kLatestName +
                               " in its directory could not be updated to name it");
  }
  return 0;
}

// -- reading --------------------------------------------------------------------------------------

int CheckpointReader::open(const std::string& path, std::string* error) {
  if (path.empty()) return fail(error, -EINVAL, "path must not be empty");
  fs::UniqueFd dir;
  if (const int rc = fs::openDirectory(path, &dir); rc < 0) return fail(error, rc, "no checkpoint directory " + path);
  std::string resolved = path;
  fs::UniqueFd mf;
  int rc = fs::openRegularForReading(dir.get(), kManifestName, false, &mf);
  if (rc == -ENOENT) {
    fs::UniqueFd latest;
    if (fs::openRegularForReading(dir.get(), kLatestName, false, &latest) == 0) {
      std::string name;
      struct stat st{};
      if (::fstat(latest.get(), &st) != 0) return fail(error, -errno, "cannot read " + path + "/" + kLatestName);
      name.resize(static_cast<size_t>(std::min<int64_t>(st.st_size, 4096)));
      if (const int r = fs::preadFull(latest.get(), name.data(), static_cast<int64_t>(name.size()), 0); r < 0) {
        return fail(error, r, "cannot read " + path + "/" + kLatestName);
      }
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.front()))) name.erase(0, 1);
      if (!isPlainDirName(name)) {
        return fail(error, -EINVAL, path + "/" + kLatestName + " names '" + name + "', which is not a plain directory "
                                    "name inside the checkpoint root (refusing a path that could escape it)");
      }
      resolved = path + "/" + name;
      if (const int r = fs::openDirectory(resolved, &dir); r < 0) return fail(error, r, "no checkpoint directory " + resolved);
      rc = fs::openRegularForReading(dir.get(), kManifestName, false, &mf);
    }
  }
  const std::string where = resolved + "/" + kManifestName;
  if (rc == -ENOENT) {
    return fail(error, rc, where + ": no manifest (not a checkpoint, or one whose save did not complete)");
  }
  if (rc < 0) return fail(error, rc, "cannot open " + where);
  std::string data;
  if (const int r = readWhole(mf.get(), int64_t{1} << 32, &data); r < 0) return fail(error, r, "cannot read " + where);
  std::string why;
  Manifest m;
  if (const int r = parseManifest(data, &m, &why); r < 0) return fail(error, r, where + ": " + why);
  dir_ = resolved;
  dirFd_ = std::move(dir);
  manifest_ = std::move(m);
  manifestCrc_ = checksum::crc32(0, data.data(), data.size());
  chunks_.clear();
  fds_.clear();
  for (const Chunk& c : manifest_.chunks) chunks_[{c.tensor, c.key}].push_back(&c);
  for (auto& [k, list] : chunks_) {
    std::sort(list.begin(), list.end(), [](const Chunk* a, const Chunk* b) { return a->lo < b->lo; });
  }
  return 0;
}

std::string CheckpointReader::storedDtype(const std::string& tensor, const std::string& key) const {
  const auto it = chunks_.find({tensor, key});
  return it == chunks_.end() ? std::string() : it->second.front()->dtype;
}

int CheckpointReader::fileFd(int64_t fi, int* fd, std::string* error) {
  if (auto it = fds_.find(fi); it != fds_.end()) {
    *fd = it->second.get();
    return 0;
  }
  const FileRecord& rec = manifest_.files[fi];
  const std::string path = dir_ + "/" + rec.name;
  fs::UniqueFd f;
  if (const int rc = fs::openRegularForReading(dirFd_.get(), rec.name, false, &f); rc < 0) {
    return fail(error, rc, rc == -ENOENT ? path + ": shard file listed in the manifest is missing" : "cannot open " + path);
  }
  struct stat st{};
  if (::fstat(f.get(), &st) != 0) return fail(error, -errno, "cannot stat " + path);
  if (st.st_size != rec.bytes) {
    return fail(error, -EIO, path + ": shard file has " + std::to_string(st.st_size) + " bytes, the manifest says " +
                                 std::to_string(rec.bytes) + " (truncated or torn)");
  }
  *fd = f.get();
  fds_.emplace(fi, std::move(f));
  return 0;
}

int CheckpointReader::read(const std::string& tensor, const std::string& key, int64_t lo, int64_t hi, void* dst,
                           std::string* error) {
  const auto it = chunks_.find({tensor, key});
  if (hi <= lo) return 0;
  if (it == chunks_.end()) {
    return fail(error, -EIO, dir_ + "/" + kManifestName + ": '" + tensor + "' (" + key + ") is not in the checkpoint");
  }
  const std::string& dtype = it->second.front()->dtype;
  const int64_t es = dtypeBytes(dtype);
  int64_t covered = 0;
  std::map<int64_t, std::vector<ReadPiece>> byFile;  // chunks do not overlap (parseManifest)
  for (const Chunk* c : it->second) {
    const int64_t a = std::max(lo, c->lo), z = std::min(hi, c->hi);
    if (a >= z) continue;
    if (c->dtype != dtype) {
      return fail(error, -EINVAL, dir_ + ": '" + tensor + "' (" + key + ") is stored in two dtypes");
    }
    byFile[c->file].push_back(
        ReadPiece{c->offset + (a - c->lo) * es, c->offset + (z - c->lo) * es, static_cast<uint8_t*>(dst) + (a - lo) * es});
    covered += z - a;
  }
  if (covered != hi - lo) {
    return fail(error, -EIO, dir_ + "/" + kManifestName + ": elements [" + std::to_string(lo) + ", " +
                                 std::to_string(hi) + ") of '" + tensor + "' (" + key +
                                 ") are not all in the shard files (the manifest is torn)");
  }
  for (const auto& [fi, pieces] : byFile) {
    int fd = -1;
    if (const int rc = fileFd(fi, &fd, error); rc < 0) return rc;
    const FileRecord& rec = manifest_.files[static_cast<size_t>(fi)];
    const VerifiedFile file{fd, rec.bytes, manifest_.blockBytes, rec.blockCrc32.data(),
                            static_cast<int64_t>(rec.blockCrc32.size())};
    const int64_t bs = manifest_.blockBytes;
    ReadFailure why;
    std::vector<ReadPiece> rest;
    for (const ReadPiece& p : pieces) {
      const int64_t b = p.lo / bs, start = b * bs, end = std::min(start + bs, rec.bytes);
      if (p.hi > end || (p.lo == start && p.hi == end)) {
        rest.push_back(p);  // whole blocks, or a range across blocks: read in place
        continue;
      }
      if (cachedFile_ != fi || cachedBlock_ != b) {  // inside one block, in part: through the cache
        cachedFile_ = cachedBlock_ = -1;
        block_.resize(static_cast<size_t>(end - start));
        if (const int rc = verifiedRead(file, {ReadPiece{start, end, block_.data()}}, VerifiedReadOptions{}, &why);
            rc < 0) {
          return fail(error, rc, dir_ + "/" + rec.name + ": " + why.message);
        }
        cachedFile_ = fi, cachedBlock_ = b;
      }
      std::memcpy(p.dst, block_.data() + (p.lo - start), static_cast<size_t>(p.hi - p.lo));
    }
    if (rest.empty()) continue;
    if (const int rc = verifiedRead(file, rest, VerifiedReadOptions{}, &why); rc < 0) {
      return fail(error, rc, dir_ + "/" + rec.name + ": " + why.message);
    }
  }
  return 0;
}

}  // namespace zeroplus::ckpt
