// zeroplus::save_checkpoint / load_checkpoint (checkpoint_io.hpp): the tensor side of the
// checkpoint format. What is saved mirrors the Python engine's adapter (checkpoint/adapters.py
// EngineAdapter) so either language reads the other's checkpoints without special cases: per
// segment (a parameter's piece of this rank's shard) the fp32 master as "param" and each
// elementwise state tensor under torch's key, Adam's step as a tagged 0-d float32 scalar in the
// manifest; frozen parameters and buffers whole, from rank 0; param groups with torch's
// hyperparameter names. The bytes, files and manifest are optimizers/core/checkpoint's; the
// masters and state are read and replaced through engine::BucketStates (in memory or offloaded).
#include "optimizers/adapter/zero/checkpoint_io.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "optimizers/adapter/zero/engine.hpp"
#include "optimizers/core/checkpoint/checkpoint_files.hpp"
#include "optimizers/core/checkpoint/shard_file_writer.hpp"

namespace zeroplus {
namespace {

using ckpt::json::Value;
using zero::engine::Engine;

constexpr const char* kSave = "zeroplus::save_checkpoint";
constexpr const char* kLoad = "zeroplus::load_checkpoint";

std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return "";
  }
}

at::ScalarType dtypeOf(const std::string& name) {
  static const std::map<std::string, at::ScalarType> kMap = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
      {"int64", at::kLong},    {"int32", at::kInt},      {"int16", at::kShort},  {"int8", at::kChar},
      {"uint8", at::kByte},    {"bool", at::kBool}};
  return kMap.at(name);  // the manifest parser admits only these
}

Value tuple(double a, double b) {
  Value t = Value::object();
  Value& items = t.set("__tuple__", Value::array());
  items.push(Value::number(a));
  items.push(Value::number(b));
  return t;
}

// torch.optim's param group keys and values (what Python's torch 2.x optimizers hold).
Value hyperparameters(const torch::optim::OptimizerOptions& o, std::string* className) {
  Value g = Value::object();
  auto adam = [&](double lr, std::tuple<double, double> betas, double eps, double wd, bool amsgrad, bool maximize,
                  bool decoupled) {
    *className = decoupled ? "AdamW" : "Adam";
    g.set("lr", Value::number(lr));
    g.set("betas", tuple(std::get<0>(betas), std::get<1>(betas)));
    g.set("eps", Value::number(eps));
    g.set("weight_decay", Value::number(wd));
    g.set("amsgrad", Value::boolean(amsgrad));
    g.set("maximize", Value::boolean(maximize));
    g.set("foreach", Value());
    g.set("capturable", Value::boolean(false));
    g.set("differentiable", Value::boolean(false));
    g.set("fused", Value());
    g.set("decoupled_weight_decay", Value::boolean(decoupled));
  };
  if (const auto* z = dynamic_cast<const optim::ZeroAdamWOptions*>(&o)) {
    adam(z->lr(), z->betas(), z->eps(), z->weight_decay(), z->amsgrad(), z->maximize(), z->decoupled_weight_decay());
  } else if (const auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    adam(a->lr(), a->betas(), a->eps(), a->weight_decay(), a->amsgrad(), false, true);
  } else if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    adam(a->lr(), a->betas(), a->eps(), a->weight_decay(), a->amsgrad(), false, false);
  } else if (const auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&o)) {
    *className = "SGD";
    g.set("lr", Value::number(s->lr()));
    g.set("momentum", Value::number(s->momentum()));
    g.set("dampening", Value::number(s->dampening()));
    g.set("weight_decay", Value::number(s->weight_decay()));
    g.set("nesterov", Value::boolean(s->nesterov()));
    g.set("maximize", Value::boolean(false));
    g.set("foreach", Value());
    g.set("differentiable", Value::boolean(false));
    g.set("fused", Value());
  }
  return g;
}

bool isSgd(const torch::optim::OptimizerOptions& o) { return dynamic_cast<const torch::optim::SGDOptions*>(&o); }

// The model as the checkpoint names it: parameters by name (the first name of each tensor is
// its own; later names of the same tensor are aliases, as Python's named_parameters dedups),
// buffers, and the engine's trainable entries.
struct ModelView {
  std::vector<std::pair<std::string, at::Tensor>> params, buffers;
  std::vector<std::pair<std::string, std::string>> aliases;
  std::unordered_map<const void*, std::string> nameOf;

  explicit ModelView(torch::nn::Module& model) {
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      const void* impl = item.value().unsafeGetTensorImpl();
      auto [it, fresh] = nameOf.emplace(impl, item.key());
      if (fresh) params.emplace_back(item.key(), item.value());
      else aliases.emplace_back(item.key(), it->second);
    }
    for (const auto& item : model.named_buffers(/*recurse=*/true)) buffers.emplace_back(item.key(), item.value());
  }
  bool trainable(const at::Tensor& p, const std::unordered_set<const void*>& bucketed) const {
    return bucketed.count(p.unsafeGetTensorImpl()) > 0;
  }
};

std::unordered_set<const void*> bucketedParams(Engine& eng) {
  std::unordered_set<const void*> out;
  for (const auto& b : eng.params().buckets()) {
    for (const auto& e : b.entries) out.insert(e.param.unsafeGetTensorImpl());
  }
  return out;
}

// -- strings between ranks ------------------------------------------------------------------------

// The strings travel as byte tensors on the engine's device (the group may serve only that one)
// and are read on the host.
at::Tensor bytesOf(const std::string& s, int64_t size, at::Device device) {
  at::Tensor t = at::zeros({size}, at::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t.to(device);
}

std::string broadcastString(zero::engine::Collectives& comm, const std::string& mine) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::TensorOptions(at::kLong).device(comm.device()));
  comm.broadcastFromZero(len);
  at::Tensor data = bytesOf(comm.rank() == 0 ? mine : std::string(), len.item<int64_t>(), comm.device());
  comm.broadcastFromZero(data);
  data = data.cpu();
  return std::string(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
}

std::vector<std::string> allGatherStrings(zero::engine::Collectives& comm, const std::string& mine) {
  const int world = comm.worldSize();
  const auto longs = at::TensorOptions(at::kLong).device(comm.device());
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), longs);
  at::Tensor lens = at::zeros({world}, longs);
  comm.allGather(lens, len)->wait();
  lens = lens.cpu();
  const int64_t most = std::max<int64_t>(lens.max().item<int64_t>(), 1);
  at::Tensor in = bytesOf(mine, most, comm.device());
  at::Tensor out = at::zeros({most * world}, at::TensorOptions(at::kByte).device(comm.device()));
  comm.allGather(out, in)->wait();
  out = out.cpu();
  std::vector<std::string> all;
  for (int r = 0; r < world; ++r) {
    all.emplace_back(static_cast<const char*>(out.data_ptr()) + r * most, static_cast<size_t>(lens[r].item<int64_t>()));
  }
  return all;
}

Value tensorScalar(const at::Tensor& t) {
  Value v = Value::object();
  v.set("__tensor__", Value::string(dtypeName(t.scalar_type())));
  v.set("shape", Value::array());
  v.set("data", Value::array()).push(Value::number(t.item<double>()));
  return v;
}

// The loss scaler as the Python engine's scaler.state_dict() writes it into the manifest's
// "optimizer" (checkpoint/adapters.py optimizer_meta): a dynamic scaler's full state and options;
// a static one (fp32, bf16, fp16 with loss_scale > 0) {"scale": 1.0}, as Python's StaticLossScaler.
Value scalerState(const zero::engine::LossScaler& scaler) {
  Value out = Value::object();
  if (!scaler.dynamic()) {
    out.set("scale", Value::number(1.0));
    return out;
  }
  const auto& st = scaler.state();
  const auto& o = scaler.settings();
  out.set("scale", Value::number(st.scale));
  out.set("hysteresis_left", Value::integer(st.hysteresisLeft));
  out.set("iteration", Value::integer(st.iteration));
  out.set("last_overflow_iteration", Value::integer(st.lastOverflowIteration));
  Value opts = Value::object();
  opts.set("init_scale", Value::number(o.initScale));
  opts.set("scale_window", Value::integer(o.scaleWindow));
  opts.set("hysteresis", Value::integer(o.hysteresis));
  opts.set("min_scale", Value::number(o.minScale));
  opts.set("consecutive_hysteresis", Value::boolean(o.consecutiveHysteresis));
  opts.set("scale_factor", Value::number(o.scaleFactor));
  opts.set("raise_error_at_min_scale", Value::boolean(o.raiseErrorAtMinScale));
  out.set("options", opts);
  return out;
}

void checkModel(const std::shared_ptr<torch::nn::Module>& model, zero::ZeroOptimizer& opt, const char* op) {
  TORCH_CHECK_VALUE(model != nullptr, op, ": model is null");
  TORCH_CHECK_VALUE(model.get() == opt.model().get(), op,
                    ": optimizer was not initialized with this model (pass the model given to zeroplus::zero::initialize)");
}

}  // namespace

// -- save -------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, const std::shared_ptr<torch::nn::Module>& model,
                     zero::ZeroOptimizer& opt) {
  checkModel(model, opt, kSave);
  at::NoGradGuard noGrad;
  Engine& eng = opt.engine();
  auto& comm = eng.comm();
  const int rank = comm.rank(), world = comm.worldSize();
  ModelView view(*model);
  const auto bucketed = bucketedParams(eng);

  // Rank 0 refuses a bad path or an existing non-checkpoint and makes the staging directory;
  // every rank learns the outcome (no rank is left waiting in a collective).
  std::string root, name, error;
  ckpt::Staging staging;
  std::string msg;
  if (rank == 0) {
    int rc = ckpt::splitSavePath(path, &root, &name, &error);
    if (rc == 0) rc = ckpt::prepareSave(root, name, &staging, &error);
    msg = rc == 0 ? "ok:" + staging.staging : "error:" + error;
  }
  msg = broadcastString(comm, msg);
  TORCH_CHECK(msg.rfind("ok:", 0) == 0, kSave, "(\"", path, "\"): ", rank == 0 ? msg.substr(6) : "rank 0: " + msg.substr(6),
              "; nothing was written");

  // Every rank streams its shard into its file, bucket by bucket (an offloaded bucket's state is
  // in memory only while it is copied out); its index (file record, chunks, state) goes to rank 0.
  // A failure here (a swap record that cannot be read, a write) becomes the index's error: rank 0
  // then abandons the save and every rank raises it.
  Value index = Value::object(), chunks = Value::array();
  Value state = Value::object(), scalars = Value::object();
  std::string werr;
  int rc = 0;
  if (rank != 0) {
    root.clear();
    rc = ckpt::splitSavePath(path, &root, &name, &werr);
    if (rc == 0) rc = ckpt::openStaging(root, name, msg.substr(3), &staging, &werr);
  }
  // The shard file goes out as the Python writer's does (shard_file_writer.hpp: io_uring through
  // the page cache, each large piece's write-back started segment by segment).
  auto writer = std::make_unique<ckpt::ShardFileWriter>();
  if (rc == 0) rc = writer->open(staging.stagingFd.get(), staging.root + "/" + staging.staging, rank,
                                 ckpt::ShardFileOptions(), &werr);
  // The writer queues writes from the tensors' memory: they are kept until drain() returned.
  std::vector<at::Tensor> placed;
  // One piece: elements [lo, hi) of `tensor`'s value `key`.
  auto put = [&](const std::string& tensor, const std::string& key, int64_t lo, int64_t hi, const at::Tensor& value) {
    if (rc < 0) return;
    const at::Tensor data = value.to(at::kCPU).contiguous();  // a CUDA piece: its host copy, kept until drained
    int64_t offset = 0;
    rc = writer->place(data.data_ptr(), data.numel() * static_cast<int64_t>(data.element_size()), &offset, &werr);
    placed.push_back(data);
    Value c = Value::array();
    c.push(Value::string(tensor));
    c.push(Value::string(key));
    c.push(Value::integer(lo));
    c.push(Value::integer(hi));
    c.push(Value::string(dtypeName(data.scalar_type())));
    c.push(Value::integer(offset));
    chunks.push(std::move(c));
  };
  try {
    auto& buckets = eng.params().buckets();
    if (rc == 0) eng.states().beginRead();
    for (size_t b = 0; b < buckets.size() && rc == 0; ++b) {
      const auto values = eng.states().read(b, kSave);
      const auto& segs = eng.steppers()[b].segments();
      for (size_t k = 0; k < segs.size(); ++k) {
        const auto& entry = buckets[b].entries[segs[k].entry];
        const std::string& pname = view.nameOf.at(entry.param.unsafeGetTensorImpl());
        const auto pc = buckets[b].piece(entry, rank);
        const zero::engine::SegmentState& st = values[k].state;
        put(pname, "param", pc.paramLo, pc.paramHi, values[k].master);
        const std::pair<const char*, const at::Tensor*> elementwise[] = {
            {"exp_avg", &st.exp_avg}, {"exp_avg_sq", &st.exp_avg_sq},
            {"max_exp_avg_sq", &st.max_exp_avg_sq}, {"momentum_buffer", &st.momentum_buffer}};
        for (const auto& [key, t] : elementwise) {
          if (!t->defined()) continue;
          put(pname, key, pc.paramLo, pc.paramHi, *t);
          Value* sv = state.find(pname);
          if (sv == nullptr) sv = &state.set(pname, Value::object());
          sv->set(key, Value::string(dtypeName(t->scalar_type())));
        }
        if (st.step.defined()) {
          Value* sv = scalars.find(pname);
          if (sv == nullptr) sv = &scalars.set(pname, Value::object());
          sv->set("step", tensorScalar(st.step));
        }
      }
      // An offloaded bucket's values are resident only until the next read: written first.
      if (rc == 0) rc = writer->drain(&werr);
      placed.clear();
    }
    if (rank == 0) {  // replicated tensors: written once
      for (const auto& [pname, p] : view.params) {
        if (!view.trainable(p, bucketed) && p.numel()) put(pname, "param", 0, p.numel(), p.detach().reshape(-1));
      }
      for (const auto& [bname, buf] : view.buffers) {
        if (buf.numel()) put(bname, "value", 0, buf.numel(), buf.detach().reshape(-1));
      }
    }
  } catch (const c10::Error& e) {
    rc = -1;
    werr = e.what_without_backtrace();
  } catch (const std::exception& e) {
    rc = -1;
    werr = e.what();
  }
  ckpt::FileRecord rec;
  if (rc == 0) rc = writer->finish(&rec, &werr);
  // A file left unfinished is removed now, before rank 0 may remove the staging directory; a
  // write still queued (after an error) is waited for before `placed` lets its memory go.
  writer.reset();
  placed.clear();
  if (rc < 0) {
    index.set("error", Value::string(werr));
  } else {
    Value& file = index.set("file", Value::object());
    file.set("name", Value::string(rec.name));
    file.set("bytes", Value::integer(rec.bytes));
    Value& crcs = file.set("block_crc32", Value::array());
    for (uint32_t c : rec.blockCrc32) crcs.push(Value::integer(c));
    index.set("chunks", std::move(chunks));
    index.set("state", state);
    index.set("scalars", scalars);
  }
  const auto indexes = allGatherStrings(comm, ckpt::json::dump(index));

  std::string outcome;
  if (rank == 0) {
    ckpt::Manifest m;
    std::string failure;
    std::vector<Value> parsed(world);
    for (int r = 0; r < world && failure.empty(); ++r) {
      std::string perr;
      if (ckpt::json::parse(indexes[r], &parsed[r], &perr) != 0) failure = "rank " + std::to_string(r) + ": " + perr;
      else if (const Value* e = parsed[r].find("error")) failure = "rank " + std::to_string(r) + ": " + e->s;
    }
    if (failure.empty()) {
      std::string className;
      for (const auto& g : opt.param_groups()) {
        Value group = hyperparameters(g.options(), &className);
        Value& names = group.set("params", Value::array());
        for (const auto& p : g.params()) names.push(Value::string(view.nameOf.at(p.unsafeGetTensorImpl())));
        m.paramGroups.push(std::move(group));
      }
      const auto dtype = eng.computeDtype();
      m.source.set("stage", Value::integer(eng.stage()));
      m.source.set("world_size", Value::integer(world));
      m.source.set("mixed_precision", dtype && *dtype == at::kBFloat16 ? Value::string("bf16") : Value());
      m.source.set("engine", Value::string("Stage" + std::to_string(eng.stage()) + "Optimizer"));
      m.source.set("optimizer_class", Value::string(className));
      m.source.set("frontend", Value::string("libtorch"));
#ifdef ZEROPLUS_VERSION
      m.source.set("zeroplus_version", Value::string(ZEROPLUS_VERSION));
#endif
      m.source.set("torch_version", Value::string(TORCH_VERSION));
      for (const auto& [pname, p] : view.params) {
        ckpt::TensorRecord t;
        t.name = pname;
        t.shape = p.sizes().vec();
        t.dtype = dtypeName(p.scalar_type());
        t.kind = "param";
        t.hasTrainable = true;
        t.trainable = view.trainable(p, bucketed);
        m.tensors.push_back(std::move(t));
      }
      for (const auto& [bname, buf] : view.buffers) {
        ckpt::TensorRecord t;
        t.name = bname;
        t.shape = buf.sizes().vec();
        t.dtype = dtypeName(buf.scalar_type());
        t.kind = "buffer";
        m.tensors.push_back(std::move(t));
      }
      m.indexTensors();
      for (const auto& t : m.tensors) {
        TORCH_CHECK(!t.dtype.empty(), kSave, "(\"", path, "\"): tensor '", t.name, "' has a dtype the format lacks");
      }
      m.aliases = view.aliases;
      for (int r = 0; r < world; ++r) {
        const Value& ix = parsed[r];
        const Value& file = *ix.find("file");
        ckpt::FileRecord rec{file.find("name")->s, file.find("bytes")->i, {}};
        for (const Value& c : file.find("block_crc32")->items) rec.blockCrc32.push_back(static_cast<uint32_t>(c.i));
        m.files.push_back(std::move(rec));
        for (const Value& c : ix.find("chunks")->items) {
          m.chunks.push_back({c.items[0].s, c.items[1].s, c.items[2].i, c.items[3].i, c.items[4].s, r, c.items[5].i});
        }
        const Value& st = *ix.find("state");
        for (size_t k = 0; k < st.keys.size(); ++k) {
          auto& rec = m.tensors[m.tensorIndex.at(st.keys[k])];
          for (size_t j = 0; j < st.items[k].keys.size(); ++j) {
            const std::string& key = st.items[k].keys[j];
            bool have = false;
            for (const auto& kv : rec.state) have = have || kv.first == key;
            if (!have) rec.state.emplace_back(key, st.items[k].items[j].s);
          }
        }
        const Value& sc = *ix.find("scalars");
        for (size_t k = 0; k < sc.keys.size(); ++k) {
          auto& rec = m.tensors[m.tensorIndex.at(sc.keys[k])];
          for (size_t j = 0; j < sc.items[k].keys.size(); ++j) {
            if (rec.scalars.find(sc.items[k].keys[j]) == nullptr) rec.scalars.set(sc.items[k].keys[j], sc.items[k].items[j]);
          }
        }
      }
      m.optimizer.set("loss_scaler", scalerState(eng.scaler()));
      m.optimizer.set("skipped_steps", Value::integer(eng.skippedSteps()));
      m.saveId = staging.staging;
      std::string cerr;
      if (ckpt::commitSave(staging, ckpt::encodeManifest(m), &cerr) < 0) failure = cerr;
    } else {
      ckpt::abandonSave(staging);
    }
    outcome = failure;
  }
  staging = ckpt::Staging();
  outcome = broadcastString(comm, outcome);
  TORCH_CHECK(outcome.empty(), kSave, "(\"", path, "\"): ", outcome,
              outcome.find("was saved and is complete") == std::string::npos
                  ? "; the checkpoint was not written (an existing one at the path is unchanged)"
                  : "");
}

// -- load -------------------------------------------------------------------------------------------

namespace {

// Everything a load changes, read and validated first.
struct Staged {
  struct Segment {
    size_t bucket, segment;
    at::Tensor master;
    bool hasState = false;
    at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, step, momentum_buffer;
  };
  std::vector<Segment> segments;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, value): frozen params, buffers
  std::vector<Value> groups;                                 // the checkpoint's hyperparameters per group
  std::optional<zero::engine::LossScaler::State> scaler;    // a dynamic scaler's saved state
  int64_t skippedSteps = 0;
};

// The manifest's engine state (the Python adapter's check_optimizer_meta and stage_optimizer):
// a saved scaler whose keys are this run's scaler's keys is loaded (dynamic into dynamic: scale,
// hysteresis, iteration, last overflow; a static one has nothing to load); another precision's
// is ignored and this run keeps its own. skipped_steps is always loaded.
void stageScaler(const ckpt::Manifest& m, Engine& eng, Staged* out) {
  auto refuse = [](const std::string& field, const std::string& expected) {
    TORCH_CHECK_VALUE(false, "checkpoint: optimizer.", field, " is not ", expected);
  };
  const Value* skipped = m.optimizer.find("skipped_steps");
  if (skipped != nullptr) {
    if (!skipped->isInt() || skipped->i < 0) refuse("skipped_steps", "an int >= 0");
    out->skippedSteps = skipped->i;
  }
  const Value* saved = m.optimizer.find("loss_scaler");
  const Value mine = scalerState(eng.scaler());
  if (saved == nullptr || !saved->isObject() || saved->keys.size() != mine.keys.size()) return;
  for (const auto& k : mine.keys) {
    if (saved->find(k) == nullptr) return;  // another precision saved it: keep this run's scaler
  }
  for (size_t k = 0; k < mine.keys.size(); ++k) {
    const std::string& key = mine.keys[k];
    const Value& v = *saved->find(key);
    switch (mine.items[k].kind) {
      case Value::Kind::Bool:
        if (v.kind != Value::Kind::Bool) refuse("loss_scaler." + key, "a bool");
        break;
      case Value::Kind::Int:
        if (!v.isInt()) refuse("loss_scaler." + key, "an int");
        break;
      case Value::Kind::Float:
        if (!v.isNumber() || !std::isfinite(v.asDouble()) || (key == "scale" && v.asDouble() <= 0)) {
          refuse("loss_scaler." + key, key == "scale" ? "a finite number > 0" : "a finite number");
        }
        break;
      default:
        break;
    }
  }
  if (eng.scaler().dynamic()) {
    out->scaler = zero::engine::LossScaler::State{saved->find("scale")->asDouble(), saved->find("hysteresis_left")->i,
                                                 saved->find("iteration")->i,
                                                 saved->find("last_overflow_iteration")->i};
  }
}

std::string torchShape(const std::vector<int64_t>& s) {
  std::string out = "torch.Size([";
  for (size_t k = 0; k < s.size(); ++k) out += (k ? ", " : "") + std::to_string(s[k]);
  return out + "])";
}

// model.load_state_dict(strict=True)'s checks and wording.
void checkKeys(const ckpt::Manifest& m, const ModelView& view) {
  std::map<std::string, std::vector<int64_t>> saved, current;
  for (const auto& t : m.tensors) saved[t.name] = t.shape;
  for (const auto& [alias, target] : m.aliases) saved[alias] = m.tensor(target)->shape;
  std::vector<std::string> order;
  for (const auto& [n, p] : view.params) current[n] = p.sizes().vec(), order.push_back(n);
  for (const auto& [alias, target] : view.aliases) current[alias] = current[target], order.push_back(alias);
  for (const auto& [n, b] : view.buffers) current[n] = b.sizes().vec(), order.push_back(n);
  std::string missing, unexpected, sizes;
  for (const auto& n : order) {
    if (!saved.count(n)) missing += (missing.empty() ? "\"" : ", \"") + n + "\"";
    else if (saved[n] != current[n]) {
      sizes += "\n\tsize mismatch for " + n + ": copying a param with shape " + torchShape(saved[n]) +
               " from checkpoint, the shape in current model is " + torchShape(current[n]) + ".";
    }
  }
  for (const auto& t : m.tensors) {
    if (!current.count(t.name)) unexpected += (unexpected.empty() ? "\"" : ", \"") + t.name + "\"";
  }
  for (const auto& [alias, target] : m.aliases) {
    if (!current.count(alias)) unexpected += (unexpected.empty() ? "\"" : ", \"") + alias + "\"";
  }
  std::string errors;
  if (!missing.empty()) errors += "\n\tMissing key(s) in state_dict: " + missing + ". ";
  if (!unexpected.empty()) errors += "\n\tUnexpected key(s) in state_dict: " + unexpected + ". ";
  errors += sizes;
  TORCH_CHECK(errors.empty(), "Error(s) in loading state_dict:", errors);
}

// A manifest scalar (encode_value of a tensor or a number) as a double.
double scalarValue(const Value& v, const std::string& what) {
  if (v.isNumber()) return v.asDouble();
  const Value* data = v.find("data");
  TORCH_CHECK(v.find("__tensor__") != nullptr && data != nullptr && data->isArray() && data->items.size() == 1 &&
                  data->items[0].isNumber(),
              what, " is not a number or a one-element tensor");
  return data->items[0].asDouble();
}

at::Tensor readRange(ckpt::CheckpointReader& r, const std::string& tensor, const std::string& key, int64_t lo,
                     int64_t hi, at::ScalarType want) {
  const std::string dtype = r.storedDtype(tensor, key);
  TORCH_CHECK(!dtype.empty(), "'", tensor, "' (", key, ") is not in the checkpoint");
  const at::ScalarType stored = dtypeOf(dtype);
  TORCH_CHECK(at::isFloatingType(stored) == at::isFloatingType(want), "'", tensor, "' (", key, ") is stored as ",
              dtype, ", not convertible to ", want);
  at::Tensor out = at::empty({hi - lo}, stored);
  std::string err;
  TORCH_CHECK(r.read(tensor, key, lo, hi, out.data_ptr(), &err) == 0, err);
  return stored == want ? out : out.to(want);
}

void stageGroups(const ckpt::Manifest& m, zero::ZeroOptimizer& opt, const ModelView& view, Staged* out) {
  const auto& groups = opt.param_groups();
  TORCH_CHECK(m.paramGroups.items.size() == groups.size(), "the checkpoint has ", m.paramGroups.items.size(),
              " param groups, the optimizer has ", groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const Value& saved = m.paramGroups.items[g];
    std::set<std::string> a, b;
    for (const Value& n : saved.find("params")->items) a.insert(n.s);
    for (const auto& p : groups[g].params()) b.insert(view.nameOf.at(p.unsafeGetTensorImpl()));
    TORCH_CHECK(a == b, "param group ", g, " holds other parameters in the checkpoint than in the optimizer");
    const bool sgd = isSgd(groups[g].options());
    for (const char* key : sgd ? std::vector<const char*>{"lr", "momentum", "dampening", "weight_decay"}
                               : std::vector<const char*>{"lr", "eps", "weight_decay"}) {
      const Value* v = saved.find(key);
      TORCH_CHECK(v != nullptr && v->isNumber() && std::isfinite(v->asDouble()), "param_groups[", g, "].", key,
                  " is missing or not a finite number (a checkpoint of another optimizer kind?)");
    }
    if (!sgd) {
      const Value* betas = saved.find("betas");
      const Value* items = betas ? betas->find("__tuple__") : nullptr;
      if (items == nullptr && betas != nullptr && betas->isArray()) items = betas;
      TORCH_CHECK(items != nullptr && items->items.size() == 2 && items->items[0].isNumber() &&
                      items->items[1].isNumber(),
                  "param_groups[", g, "].betas is missing or not two numbers");
    }
    out->groups.push_back(saved);
  }
}

void applyGroups(zero::ZeroOptimizer& opt, const std::vector<Value>& saved) {
  auto num = [](const Value& g, const char* k, double fallback) {
    const Value* v = g.find(k);
    return v != nullptr && v->isNumber() ? v->asDouble() : fallback;
  };
  auto flag = [](const Value& g, const char* k, bool fallback) {
    const Value* v = g.find(k);
    return v != nullptr && v->kind == Value::Kind::Bool ? v->b : fallback;
  };
  auto betas = [](const Value& g) {
    const Value* b = g.find("betas");
    const Value* items = b->find("__tuple__") ? b->find("__tuple__") : b;
    return std::make_tuple(items->items[0].asDouble(), items->items[1].asDouble());
  };
  for (size_t g = 0; g < saved.size(); ++g) {
    auto& o = opt.param_groups()[g].options();
    const Value& s = saved[g];
    if (auto* z = dynamic_cast<optim::ZeroAdamWOptions*>(&o)) {
      z->lr(num(s, "lr", z->lr())).betas(betas(s)).eps(num(s, "eps", z->eps()));
      z->weight_decay(num(s, "weight_decay", z->weight_decay())).amsgrad(flag(s, "amsgrad", z->amsgrad()));
      z->maximize(flag(s, "maximize", z->maximize()));
    } else if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
      a->lr(num(s, "lr", a->lr())).betas(betas(s)).eps(num(s, "eps", a->eps()));
      a->weight_decay(num(s, "weight_decay", a->weight_decay())).amsgrad(flag(s, "amsgrad", a->amsgrad()));
    } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
      a->lr(num(s, "lr", a->lr())).betas(betas(s)).eps(num(s, "eps", a->eps()));
      a->weight_decay(num(s, "weight_decay", a->weight_decay())).amsgrad(flag(s, "amsgrad", a->amsgrad()));
    } else if (auto* sg = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
      sg->lr(num(s, "lr", sg->lr())).momentum(num(s, "momentum", sg->momentum()));
      sg->dampening(num(s, "dampening", sg->dampening())).weight_decay(num(s, "weight_decay", sg->weight_decay()));
      sg->nesterov(flag(s, "nesterov", sg->nesterov()));
    }
  }
}

void stage(ckpt::CheckpointReader& reader, const ModelView& view, zero::ZeroOptimizer& opt, Staged* out) {
  const ckpt::Manifest& m = reader.manifest();
  checkKeys(m, view);
  stageGroups(m, opt, view, out);
  Engine& eng = opt.engine();
  stageScaler(m, eng, out);
  const int rank = eng.comm().rank();
  const auto bucketed = bucketedParams(eng);
  auto& buckets = eng.params().buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    const bool sgd = isSgd(opt.param_groups()[buckets[b].group].options());
    const auto& segs = eng.steppers()[b].segments();
    for (size_t s = 0; s < segs.size(); ++s) {
      const auto& entry = buckets[b].entries[segs[s].entry];
      const std::string& name = view.nameOf.at(entry.param.unsafeGetTensorImpl());
      const auto pc = buckets[b].piece(entry, rank);
      Staged::Segment st;
      st.bucket = b;
      st.segment = s;
      st.master = readRange(reader, name, "param", pc.paramLo, pc.paramHi, at::kFloat);
      const ckpt::TensorRecord& rec = *m.tensor(name);
      for (const auto& [key, dtype] : rec.state) {
        const bool known = sgd ? key == "momentum_buffer"
                               : (key == "exp_avg" || key == "exp_avg_sq" || key == "max_exp_avg_sq");
        TORCH_CHECK(known, "optimizer state '", key, "' of '", name, "' is not one this optimizer (",
                    sgd ? "SGD" : "Adam/AdamW", ") keeps (a checkpoint of another optimizer kind?)");
        at::Tensor v = readRange(reader, name, key, pc.paramLo, pc.paramHi, at::kFloat);
        if (key == "exp_avg") st.exp_avg = v;
        else if (key == "exp_avg_sq") st.exp_avg_sq = v;
        else if (key == "max_exp_avg_sq") st.max_exp_avg_sq = v;
        else st.momentum_buffer = v;
        st.hasState = true;
      }
      for (size_t k = 0; k < rec.scalars.keys.size(); ++k) {
        const std::string& key = rec.scalars.keys[k];
        if (rec.scalars.items[k].isNull()) continue;
        TORCH_CHECK(!sgd && key == "step", "optimizer scalar '", key, "' of '", name,
                    "' is not one this optimizer keeps (a checkpoint of another optimizer kind?)");
        const double step = scalarValue(rec.scalars.items[k], "the step of '" + name + "'");
        TORCH_CHECK(std::isfinite(step) && step >= 0, "the step of '", name, "' is ", step, ", expected a count >= 0");
        st.step = at::full({}, step, at::kFloat);
        st.hasState = true;
      }
      if (st.hasState && !sgd) {
        TORCH_CHECK(st.exp_avg.defined() && st.exp_avg_sq.defined() && st.step.defined(), "the Adam state of '", name,
                    "' is incomplete (it needs exp_avg, exp_avg_sq and step)");
      }
      out->segments.push_back(std::move(st));
    }
  }
  for (const auto& [name, p] : view.params) {
    if (view.trainable(p, bucketed) || p.numel() == 0) continue;
    const std::string key = reader.storedDtype(name, "param").empty() ? "value" : "param";
    out->copies.emplace_back(p, readRange(reader, name, key, 0, p.numel(), p.scalar_type()));
  }
  for (const auto& [name, buf] : view.buffers) {
    if (buf.numel() == 0) continue;
    const std::string key = reader.storedDtype(name, "value").empty() ? "param" : "value";
    out->copies.emplace_back(buf, readRange(reader, name, key, 0, buf.numel(), buf.scalar_type()));
  }
}

}  // namespace

void load_checkpoint(const std::string& path, const std::shared_ptr<torch::nn::Module>& model,
                     zero::ZeroOptimizer& opt) {
  checkModel(model, opt, kLoad);
  at::NoGradGuard noGrad;
  Engine& eng = opt.engine();
  auto& comm = eng.comm();
  ModelView view(*model);
  Staged staged;
  std::string error;
  uint32_t which = 0;
  try {
    ckpt::CheckpointReader reader;
    std::string err;
    TORCH_CHECK(reader.open(path, &err) == 0, err);
    which = reader.manifestCrc32();
    stage(reader, view, opt, &staged);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Agree: every rank read everything, and the same checkpoint (`latest` may move meanwhile).
  const auto all = allGatherStrings(comm, std::to_string(which) + ":" + error);
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string e = all[r].substr(all[r].find(':') + 1);
    TORCH_CHECK_VALUE(e.empty(), kLoad, "(\"", path, "\"): ", r == static_cast<size_t>(comm.rank()) ? "" : "rank " + std::to_string(r) + ": ",
                      e, " (nothing was changed)");
  }
  for (const auto& s : all) {
    TORCH_CHECK(s.substr(0, s.find(':')) == all[0].substr(0, all[0].find(':')), kLoad, "(\"", path,
                "\"): the ranks read different checkpoints (it was replaced, or `latest` moved, during the load); "
                "nothing was changed");
  }
  // Change: masters and state (wherever the engine keeps them; published into the parameters),
  // hyperparameters, frozen parameters and buffers.
  std::vector<zero::engine::BucketValues> values(eng.steppers().size());
  for (size_t b = 0; b < values.size(); ++b) values[b].resize(eng.steppers()[b].segments().size());
  for (auto& s : staged.segments) {
    auto& v = values[s.bucket][s.segment];
    v.master = s.master;
    if (s.hasState) v.state = {s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.step, s.momentum_buffer};
  }
  eng.writeStates(values, kLoad);
  applyGroups(opt, staged.groups);
  if (staged.scaler) eng.scaler().load(*staged.scaler);
  eng.setSkippedSteps(staged.skippedSteps);
  for (auto& [dest, value] : staged.copies) dest.detach().reshape(-1).copy_(value);
}

}  // namespace zeroplus
