// Stage-3 units of a LibTorch model (units.hpp): the search of the module tree, the decision of
// which parameters stay whole, and the wrapper that brackets each unit's forward.
#include "optimizers/adapter/zero/units.hpp"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "optimizers/adapter/zero/engine.hpp"

namespace zeroplus::zero {
namespace {

constexpr const char* kInit = "zeroplus::zero::initialize";

// What the Sequential calls in place of child `unit` (its entry in the Sequential's list of
// callables is replaced; the registered child, so every parameter name, stays). Gathers the
// unit's parameters for its forward, releases them after, and arranges for them to be gathered
// again when autograd reaches the unit's output in backward.
class UnitForwardImpl : public torch::nn::Module {
 public:
  UnitForwardImpl(std::weak_ptr<engine::Engine> engine, int64_t unit, torch::nn::AnyModule inner)
      : engine_(std::move(engine)), unit_(unit), inner_(std::move(inner)) {}

  at::Tensor forward(at::Tensor x) {
    auto eng = engine_.lock();
    TORCH_CHECK(eng != nullptr, "zeroplus::zero: the optimizer zeroplus::zero::initialize returned for this stage-3 "
                "model was destroyed; its parameters are shards only it can gather (keep it alive while the model is "
                "used, or take zeroplus::zero::full_state_dict before)");
    eng->unitForwardBegin(unit_);
    at::Tensor y;
    try {
      y = inner_.forward<at::Tensor>(std::move(x));
    } catch (...) {
      eng->unitForwardEnd(unit_);
      throw;
    }
    if (y.requires_grad()) {
      std::weak_ptr<engine::Engine> weak = engine_;
      const int64_t unit = unit_;
      y.register_hook([weak, unit](const at::Tensor& grad) {
        if (auto e = weak.lock()) e->unitBackwardBegin(unit);
        return grad;
      });
    }
    eng->unitForwardEnd(unit_);
    return y;
  }

 private:
  std::weak_ptr<engine::Engine> engine_;
  int64_t unit_;
  torch::nn::AnyModule inner_;
};

const void* keyOf(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// A container whose elements the user's forward calls itself: nothing the engine can wrap.
struct Container {
  std::string name, kind;
  std::shared_ptr<torch::nn::Module> module;
};

struct Search {
  Stage3Units out;
  int64_t units = 0;
  std::unordered_set<const torch::nn::Module*> visited;
  std::unordered_map<const void*, std::set<int64_t>> unitsOf;  // parameter -> units whose subtree holds it
  std::unordered_set<const void*> outside;                     // registered by a module outside every unit
  std::vector<Container> containers;

  void visit(const std::shared_ptr<torch::nn::Module>& m, const std::string& name) {
    if (!visited.insert(m.get()).second) return;  // a module registered twice is one module
    for (const auto& p : m->parameters(/*recurse=*/false)) outside.insert(keyOf(p));
    if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m)) {
      const auto children = seq->children();
      TORCH_CHECK_VALUE(children.size() == seq->size(), kInit, ": the torch::nn::Sequential \"", name, "\" has ",
                        seq->size(), " entries but ", children.size(), " registered children");
      for (size_t i = 0; i < seq->size(); ++i) {
        TORCH_CHECK_VALUE(!std::dynamic_pointer_cast<UnitForwardImpl>(seq->ptr(i)), kInit, ": the torch::nn::"
                          "Sequential \"", name, "\" was already wrapped for stage 3 by an earlier initialize; build "
                          "a fresh model (its parameters are that optimizer's shards)");
      }
      for (const auto& child : children) {
        const int64_t u = units++;
        for (const auto& p : child->parameters(/*recurse=*/true)) unitsOf[keyOf(p)].insert(u);
      }
      out.sequentials.push_back(seq);
      out.names.push_back(name);
      return;
    }
    if (std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(m)) {
      containers.push_back({name, "torch::nn::ModuleList", m});
    } else if (std::dynamic_pointer_cast<torch::nn::ModuleDictImpl>(m)) {
      containers.push_back({name, "torch::nn::ModuleDict", m});
    }
    for (const auto& item : m->named_children()) visit(item.value(), join(name, item.key()));
  }
};

// "\"layers\" is a torch::nn::ModuleList (3 modules, 48 trainable elements)"
std::string describe(const Container& c, int64_t elements) {
  std::ostringstream s;
  s << "\"" << c.name << "\" is a " << c.kind << " (" << c.module->children().size() << " modules, " << elements
    << " trainable elements)";
  return s.str();
}

}  // namespace

Stage3Units findUnits(const std::shared_ptr<torch::nn::Module>& model,
                      const std::vector<std::vector<at::Tensor>>& trainable, int64_t persistenceThreshold) {
  Search search;
  search.visit(model, "");
  Stage3Units& out = search.out;
  out.layout.unitCount = search.units;

  std::unordered_map<const void*, int64_t> position;
  for (const auto& p : model->parameters(/*recurse=*/true)) position.emplace(keyOf(p), position.size());
  int64_t sharded = 0;
  std::unordered_set<const void*> persistent;
  for (const auto& group : trainable) {
    for (const auto& p : group) {
      const auto found = search.unitsOf.find(keyOf(p));
      const bool inOneUnit =
          found != search.unitsOf.end() && found->second.size() == 1 && !search.outside.count(keyOf(p));
      const int64_t home = inOneUnit ? *found->second.begin() : -1;
      const bool small = p.numel() <= persistenceThreshold;
      out.layout.unitOf.push_back(inOneUnit && !small ? home : -1);
      out.layout.homeUnit.push_back(home);
      out.layout.position.push_back(position.at(keyOf(p)));
      if (inOneUnit) {
        sharded += p.numel();  // a unit holds it (the error below is about units, not the threshold)
      } else {
        persistent.insert(keyOf(p));
      }
    }
  }
  // Trainable elements of a container that would stay whole.
  auto wholeIn = [&](const Container& c) {
    int64_t n = 0;
    std::unordered_set<const void*> seen;
    for (const auto& p : c.module->parameters(/*recurse=*/true)) {
      if (persistent.count(keyOf(p)) && seen.insert(keyOf(p)).second) n += p.numel();
    }
    return n;
  };
  if (sharded == 0) {
    std::ostringstream s;
    s << kInit << ": options.stage 3 found no torch::nn::Sequential holding trainable parameters in the model (a "
      << model->name() << "), so every parameter would stay whole on every rank. LibTorch modules have no forward "
      << "hooks: the engine gathers parameters only around calls it makes itself, which are a torch::nn::"
      << "Sequential's calls of its children (each child one unit).";
    for (const auto& c : search.containers) {
      const int64_t n = wholeIn(c);
      if (n > 0) s << " " << describe(c, n) << ": your forward calls its elements itself, which the engine cannot "
                   << "intercept.";
    }
    s << " Remedy: hold the repeated blocks in a torch::nn::Sequential and call it from forward (x = "
      << "blocks->forward(x)); the modules your forward calls itself (embeddings, final norm, head) then stay whole. "
      << "Or train this model at stage 1 or 2.";
    TORCH_CHECK_VALUE(false, s.str());
  }
  for (const auto& c : search.containers) {
    const int64_t n = wholeIn(c);
    if (n > 0) {
      TORCH_WARN(kInit, ": stage 3 keeps the parameters of ", describe(c, n), " whole on every rank: your forward ",
                 "calls its elements itself, which the engine cannot intercept; hold them in a torch::nn::Sequential "
                 "to shard them");
    }
  }
  return out;
}

void wrapUnits(const Stage3Units& units, const std::shared_ptr<engine::Engine>& engine) {
  int64_t u = 0;
  for (const auto& seq : units.sequentials) {
    for (auto it = seq->begin(); it != seq->end(); ++it, ++u) {
      *it = torch::nn::AnyModule(std::make_shared<UnitForwardImpl>(engine, u, std::move(*it)));
    }
  }
}

}  // namespace zeroplus::zero
