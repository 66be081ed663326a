#include <fox/nn/parameters.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <fox/nn/attention.h>
#include <fox/nn/norm.h>

namespace fox::nn {
namespace {

// torch::nn::Module::parameters_ is protected and register_parameter refuses an existing name;
// a pointer to the member taken through a derived class reaches it legally from here.
struct ParameterAccess : torch::nn::Module {
  static torch::OrderedDict<std::string, torch::Tensor>& of(torch::nn::Module& m) {
    return m.*(&ParameterAccess::parameters_);
  }
};

// The member that forward reads for parameter `name`, or nullptr.
torch::Tensor* member_of(torch::nn::Module& m, const std::string& name) {
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    return name == "weight" ? &l->weight : name == "bias" ? &l->bias : nullptr;
  }
  if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) {
    return name == "weight" ? &e->weight : nullptr;
  }
  if (auto* n = dynamic_cast<RMSNormImpl*>(&m)) return name == "weight" ? &n->weight : nullptr;
  if (auto* n = dynamic_cast<GroupRMSNormImpl*>(&m)) return name == "weight" ? &n->weight : nullptr;
  if (auto* a = dynamic_cast<ForgettingAttentionLayerImpl*>(&m)) {
    return name == "fgate_bias" ? &a->fgate_bias : nullptr;
  }
  return nullptr;
}

}  // namespace

void replace_parameter(torch::nn::Module& module, const std::string& name,
                       const torch::Tensor& value) {
  auto& params = ParameterAccess::of(module);
  auto* entry = params.find(name);
  TORCH_CHECK(entry != nullptr, "replace_parameter: ", module.name(), " has no parameter '", name,
              "'");
  TORCH_CHECK(value.defined() && value.sizes() == entry->sizes(), "replace_parameter: ",
              module.name(), ".", name, " has shape ", entry->sizes(), ", got ",
              value.defined() ? value.sizes() : at::IntArrayRef{});
  auto* member = member_of(module, name);
  TORCH_CHECK(member != nullptr, "replace_parameter: no known member holds ", module.name(), ".",
              name);
  *entry = value;
  *member = value;
}

void release_gradients(torch::nn::Module& module) {
  for (auto& p : module.named_parameters(/*recurse=*/false)) p->mutable_grad().reset();
  for (const auto& child : module.children()) release_gradients(*child);
}

}  // namespace fox::nn
