// Description: the torch-free checkpoint format (optimizers/core/checkpoint): the JSON writer and
// strict parser, manifest encode/parse round trips with the SHA-256 seal, refusal of every single
// flipped bit and of out-of-range fields, a newer version, and the files layer (shard write with
// block CRCs, commit, replacing a checkpoint, refusing a foreign directory, verified reads that
// refuse a corrupted byte and a truncated file).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "optimizers/core/checkpoint/checkpoint_files.hpp"
#include "optimizers/core/checkpoint/json.hpp"
#include "optimizers/core/checkpoint/manifest.hpp"
#include "optimizers/core/checkpoint/shard_file_writer.hpp"

namespace {

using namespace zeroplus::ckpt;
using json::Value;

TEST(CheckpointJson, RoundTripAndPythonSpelling) {
  Value v = Value::object();
  v.set("a", Value::integer(-42));
  v.set("f", Value::number(2.0));
  v.set("g", Value::number(1e-08));
  v.set("nan", Value::number(std::nan("")));
  v.set("s", Value::string("q\"\\\n\x01"));
  Value& arr = v.set("l", Value::array());
  arr.push(Value::boolean(true));
  arr.push(Value());
  const std::string text = json::dump(v);
  EXPECT_EQ(text, "{\"a\":-42,\"f\":2.0,\"g\":1e-08,\"nan\":NaN,\"s\":\"q\\\"\\\\\\u000a\\u0001\",\"l\":[true,null]}");
  Value back;
  std::string err;
  ASSERT_EQ(json::parse(text, &back, &err), 0) << err;
  EXPECT_EQ(back.find("a")->i, -42);
  EXPECT_EQ(back.find("f")->kind, Value::Kind::Float);
  EXPECT_EQ(back.find("s")->s, "q\"\\\n\x01");
  EXPECT_TRUE(std::isnan(back.find("nan")->d));
  EXPECT_EQ(json::dump(back), text);
  ASSERT_EQ(json::parse(" {\"u\":\"\\u00e9\\ud83d\\ude00\"} ", &back, &err), 0) << err;
  EXPECT_EQ(back.find("u")->s, "\xc3\xa9\xf0\x9f\x98\x80");
}

TEST(CheckpointJson, StrictRefusals) {
  Value v;
  for (const char* bad : {"{\"a\":1,\"a\":2}", "[1,]", "{\"a\":1,}", "01", "[1] x", "9223372036854775808", "\"\\ud800\"",
                          "{\"a\" 1}", "tru", "\"abc", "1.", "-", "[\"\n\"]"}) {
    std::string err;
    EXPECT_EQ(json::parse(bad, &v, &err), -EINVAL) << bad;
    EXPECT_FALSE(err.empty());
  }
  std::string deep(json::kMaxDepth + 2, '[');
  deep += std::string(json::kMaxDepth + 2, ']');
  EXPECT_EQ(json::parse(deep, &v, nullptr), -EINVAL);
}

// Strings are well-formed UTF-8: what Python's json.loads (UTF-8 with surrogatepass) would read
// differently, or refuse with another error, is refused here (format.py validates with this parser).
TEST(CheckpointJson, StringsAreWellFormedUtf8) {
  Value v;
  for (const char* bad : {"\"\xed\xa0\x80\"", "\"\xc0\xaf\"", "\"\xe0\x80\xaf\"", "\"\xf0\x80\x80\xaf\"",
                          "\"\xf4\x90\x80\x80\"", "\"\xf5\x80\x80\x80\"", "\"\xe2\x82\"", "\"\xe9\"", "\"\x80\"",
                          "\xef\xbb\xbf{}"}) {
    std::string err;
    EXPECT_EQ(json::parse(bad, &v, &err), -EINVAL) << bad;
  }
  for (const char* good : {"\"\xc3\xa9\"", "\"\xe2\x82\xac\"", "\"\xed\x9f\xbf\"", "\"\xee\x80\x80\"",
                           "\"\xf0\x9f\x98\x80\"", "\"\xf4\x8f\xbf\xbf\"", "\"\x7f\""}) {
    std::string err;
    ASSERT_EQ(json::parse(good, &v, &err), 0) << good << ": " << err;
    EXPECT_EQ("\"" + v.s + "\"", good);
  }
}

Manifest sample() {
  Manifest m;
  m.source.set("stage", Value::integer(2));
  m.source.set("world_size", Value::integer(2));
  m.blockBytes = 64;
  m.files = {{"rank00000.bin", 100, {1, 2}}, {"rank00001.bin", 64, {3}}};
  TensorRecord w;
  w.name = "0.weight";
  w.shape = {3, 5};
  w.dtype = "float32";
  w.kind = "param";
  w.hasTrainable = w.trainable = true;
  w.state = {{"exp_avg", "float32"}};
  Value step = Value::object();
  step.set("__tensor__", Value::string("float32"));
  step.set("shape", Value::array());
  step.set("data", Value::array()).push(Value::number(2.0));
  w.scalars.set("step", step);
  TensorRecord b;
  b.name = "bn.running_mean";
  b.shape = {4};
  b.dtype = "float32";
  b.kind = "buffer";
  m.tensors = {w, b};
  m.aliases = {{"tied.weight", "0.weight"}};
  m.chunks = {{"0.weight", "param", 0, 8, "float32", 0, 0},
              {"0.weight", "param", 8, 15, "float32", 1, 0},
              {"0.weight", "exp_avg", 0, 15, "float32", 0, 32},
              {"bn.running_mean", "value", 0, 4, "float32", 1, 28}};
  Value g = Value::object();
  g.set("lr", Value::number(0.01));
  g.set("params", Value::array()).push(Value::string("0.weight"));
  m.paramGroups.push(g);
  m.optimizer.set("skipped_steps", Value::integer(0));
  m.saveId = ".x.tmp-0123456789abcdef";
  m.indexTensors();
  return m;
}

TEST(CheckpointManifest, EncodeParseRoundTrip) {
  const std::string bytes = encodeManifest(sample());
  EXPECT_NE(bytes.find(",\"manifest_sha256\":\""), std::string::npos);
  Manifest m;
  std::string err;
  ASSERT_EQ(parseManifest(bytes, &m, &err), 0) << err;
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.tensor("0.weight")->numel, 15);
  EXPECT_EQ(m.tensor("0.weight")->state.at(0).first, "exp_avg");
  EXPECT_EQ(m.tensor("0.weight")->scalars.find("step")->find("data")->items.at(0).d, 2.0);
  EXPECT_EQ(m.chunks.size(), 4u);
  EXPECT_EQ(m.chunks[1].file, 1);
  EXPECT_EQ(m.aliases.at(0).second, "0.weight");
  EXPECT_EQ(m.files[0].blockCrc32, (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(m.saveId, ".x.tmp-0123456789abcdef");
  EXPECT_EQ(encodeManifest(m), bytes);  // parse keeps everything encode writes
}

TEST(CheckpointManifest, EveryFlippedBitIsRefused) {
  const std::string bytes = encodeManifest(sample());
  Manifest m;
  for (size_t at = 0; at < bytes.size(); ++at) {
    for (int bit : {0, 5}) {
      std::string bad = bytes;
      bad[at] = static_cast<char>(bad[at] ^ (1 << bit));
      ASSERT_NE(parseManifest(bad, &m, nullptr), 0) << "byte " << at << " bit " << bit;
    }
  }
  Manifest unsealed;
  std::string err;
  EXPECT_EQ(parseManifest(bytes.substr(0, bytes.find(",\"manifest_sha256\"")) + "}", &unsealed, &err), -EIO);
  EXPECT_NE(err.find("missing or damaged"), std::string::npos) << err;
}

TEST(CheckpointManifest, OutOfRangeFieldsAreRefusedEvenWhenSealed) {
  auto refused = [](Manifest m, const char* what) {
    std::string err;
    Manifest out;
    EXPECT_EQ(parseManifest(encodeManifest(m), &out, &err), -EINVAL) << what;
    return err;
  };
  Manifest m = sample();
  m.files[0].name = "../rank00000.bin";
  EXPECT_NE(refused(m, "file name").find("rankNNNNN.bin"), std::string::npos);
  m = sample();
  m.files[0].blockCrc32.pop_back();
  refused(m, "crc count");
  m = sample();
  m.chunks[0].hi = 16;
  refused(m, "past numel");
  m = sample();
  m.chunks[2].offset = 50;  // 15 floats from byte 50 end past the 100-byte file
  refused(m, "past the file");
  m = sample();
  m.chunks[1].lo = 7;
  EXPECT_NE(refused(m, "overlap").find("overlap"), std::string::npos);
  m = sample();
  m.tensors[0].dtype = "float128";
  refused(m, "dtype");
  m = sample();
  m.aliases = {{"0.weight", "0.weight"}};
  refused(m, "alias of itself");
  m = sample();
  m.paramGroups.items[0].find("params")->push(Value::string("nope"));
  refused(m, "unknown group param");
  m = sample();
  m.tensors[0].shape = {int64_t{1} << 40, int64_t{1} << 40};
  refused(m, "huge shape");
  m = sample();
  m.tensors[1].shape = {3, 1537228672809129302};  // 2^62 + 2 elements
  refused(m, "shape of 2^62 elements or more");
  m = sample();
  m.blockBytes = kMaxBlockBytes + 1;
  refused(m, "block size");
}

TEST(CheckpointManifest, ShapesBelowTwoToThe62ElementsParse) {
  for (std::vector<int64_t> shape : {std::vector<int64_t>{(int64_t{1} << 62) - 1},
                                     std::vector<int64_t>{3, 0, 1537228672809129301}}) {
    Manifest m = sample();
    m.tensors[1].shape = shape;
    m.chunks.pop_back();  // the buffer's chunk (its range is not what this tests)
    Manifest out;
    std::string err;
    EXPECT_EQ(parseManifest(encodeManifest(m), &out, &err), 0) << shape.back() << ": " << err;
  }
}

TEST(CheckpointManifest, NewerVersionIsRefusedBeforeTheSeal) {
  std::string bytes = encodeManifest(sample());
  const size_t at = bytes.find("\"version\":2");
  bytes.replace(at, 11, "\"version\":3");
  Manifest m;
  std::string err;
  EXPECT_EQ(parseManifest(bytes, &m, &err), -ENOTSUP);
  EXPECT_NE(err.find("newer"), std::string::npos);
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/zeroplus_ckpt_fmt_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string path;
};

// One rank's shard with values, committed; returns the manifest written.
Manifest saveOne(const std::string& root, const std::string& name, const std::vector<float>& values, int* rc,
                 std::string* err) {
  Staging s;
  Manifest m;
  *rc = prepareSave(root, name, &s, err);
  if (*rc < 0) return m;
  FileRecord rec;
  std::vector<int64_t> offsets;
  *rc = writeShard(s.stagingFd.get(), s.root + "/" + s.staging, 0,
                   {{values.data(), static_cast<int64_t>(values.size() * 4)}}, ShardFileOptions().setBlockBytes(64), &rec,
                   &offsets, err);
  if (*rc < 0) {
    abandonSave(s);
    return m;
  }
  m.blockBytes = 64;
  m.files = {rec};
  TensorRecord t;
  t.name = "w";
  t.shape = {static_cast<int64_t>(values.size())};
  t.dtype = "float32";
  t.kind = "param";
  m.tensors = {t};
  m.chunks = {{"w", "param", 0, static_cast<int64_t>(values.size()), "float32", 0, offsets[0]}};
  m.saveId = s.staging;
  *rc = commitSave(s, encodeManifest(m), err);
  return m;
}

std::vector<float> readAllValues(const std::string& path, int* rc, std::string* err) {
  CheckpointReader r;
  *rc = r.open(path, err);
  if (*rc < 0) return {};
  const int64_t n = r.manifest().tensor("w")->numel;
  std::vector<float> out(n);
  *rc = r.read("w", "param", 0, n, out.data(), err);
  return out;
}

TEST(CheckpointFiles, CommitReplaceReadAndRefuse) {
  TempDir dir;
  const std::string root = dir.path + "/sub/ckpts";  // missing parents are created
  std::vector<float> a(50), b(50);
  for (int i = 0; i < 50; ++i) a[i] = static_cast<float>(i), b[i] = static_cast<float>(-i);
  int rc = 0;
  std::string err;
  saveOne(root, "step1", a, &rc, &err);
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(readAllValues(root + "/step1", &rc, &err), a);
  EXPECT_EQ(readAllValues(root, &rc, &err), a) << "through latest";
  saveOne(root, "step1", b, &rc, &err);  // replaces the checkpoint atomically
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(readAllValues(root + "/step1", &rc, &err), b);
  // Nothing but the checkpoint and latest is left (no staging directory).
  EXPECT_EQ(std::system(("test $(ls -A '" + root + "' | wc -l) -eq 2").c_str()), 0);

  ::mkdir((root + "/mine").c_str(), 0700);
  std::ofstream(root + "/mine/notes.txt") << "user data";
  saveOne(root, "mine", a, &rc, &err);
  EXPECT_EQ(rc, -EEXIST);
  EXPECT_NE(err.find("not a zeroplus checkpoint"), std::string::npos) << err;
  EXPECT_EQ(std::system(("test -f '" + root + "/mine/notes.txt'").c_str()), 0);

  // A partial read from the middle, across blocks.
  CheckpointReader r;
  ASSERT_EQ(r.open(root + "/step1", &err), 0) << err;
  std::vector<float> mid(20);
  ASSERT_EQ(r.read("w", "param", 13, 33, mid.data(), &err), 0) << err;
  EXPECT_EQ(mid[0], -13.0f);
  EXPECT_EQ(mid[19], -32.0f);

  // One flipped byte in the shard: refused by its block's CRC; a truncated file by its size.
  {
    const std::string shard = root + "/step1/rank00000.bin";
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);
    f.put('\x7f');
  }
  readAllValues(root + "/step1", &rc, &err);
  EXPECT_EQ(rc, -EIO);
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
  ASSERT_EQ(::truncate((root + "/step1/rank00000.bin").c_str(), 150), 0);
  readAllValues(root + "/step1", &rc, &err);
  EXPECT_EQ(rc, -EIO);
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
}

// Bytes this process read through read(2)/pread(2), every thread's (/proc/self/io rchar).
int64_t bytesRead() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

TEST(CheckpointFiles, SmallReadsInOneBlockReadItOnce) {
  // The engine reads value by value; many small tensors share a block. Each block is read and
  // checked once for all the reads inside it (the reader keeps the last one), not once per read.
  TempDir dir;
  std::vector<float> a(50);
  for (int i = 0; i < 50; ++i) a[i] = static_cast<float>(i) * 0.5f;
  int rc = 0;
  std::string err;
  saveOne(dir.path, "ck", a, &rc, &err);  // 64-byte blocks: 16 floats each, 4 blocks
  ASSERT_EQ(rc, 0) << err;
  CheckpointReader r;
  ASSERT_EQ(r.open(dir.path + "/ck", &err), 0) << err;
  float one = 0;
  ASSERT_EQ(r.read("w", "param", 0, 1, &one, &err), 0) << err;  // opens the shard file
  const int64_t before = bytesRead();
  for (int i = 0; i < 50; ++i) {
    ASSERT_EQ(r.read("w", "param", i, i + 1, &one, &err), 0) << err;
    EXPECT_EQ(one, a[i]);
  }
  const int64_t read = bytesRead() - before;
  EXPECT_GT(read, 0);
  // The shard once at most (200 bytes) and /proc/self/io's own text, not a 64-byte block per read (3,000+).
  EXPECT_LE(read, 200 + 256) << "50 one-element reads read " << read << " bytes of a 200-byte shard";

  // A cached block was verified: a byte flipped in another block is still refused.
  {
    std::fstream f(dir.path + "/ck/rank00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);
    f.put('\x7f');
  }
  CheckpointReader fresh;
  ASSERT_EQ(fresh.open(dir.path + "/ck", &err), 0) << err;
  EXPECT_EQ(fresh.read("w", "param", 0, 1, &one, &err), 0) << err;
  EXPECT_EQ(fresh.read("w", "param", 17, 18, &one, &err), -EIO);
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
  EXPECT_EQ(fresh.read("w", "param", 17, 18, &one, &err), -EIO) << "a block that failed is not cached";
}

TEST(CheckpointFiles, LatestMustNameAPlainSibling) {
  TempDir dir;
  std::ofstream(dir.path + "/latest") << "../elsewhere\n";
  CheckpointReader r;
  std::string err;
  EXPECT_EQ(r.open(dir.path, &err), -EINVAL);
  EXPECT_NE(err.find("escape"), std::string::npos) << err;
  std::string root, name;
  EXPECT_EQ(splitSavePath("/tmp/x/..", &root, &name, &err), -EINVAL);
  EXPECT_EQ(splitSavePath("/tmp/x/step_1/", &root, &name, &err), 0);
  EXPECT_EQ(root, "/tmp/x");
  EXPECT_EQ(name, "step_1");
}

}  // namespace
