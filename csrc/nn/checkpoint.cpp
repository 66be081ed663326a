#include <fox/nn/checkpoint.h>

#include <filesystem>
#include <memory>
#include <set>
#include <system_error>
#include <vector>

#include <c10/util/Exception.h>

#include "json_files.h"

namespace fs = std::filesystem;

namespace fox::nn {

namespace {

// transformers' name of a parameter dtype (config.json's "torch_dtype"), or none.
const char* torch_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kFloat64: return "float64";
    case torch::kFloat16: return "float16";
    case torch::kBFloat16: return "bfloat16";
    default: return nullptr;
  }
}

}  // namespace

void save_pretrained(const ForgettingTransformerForCausalLMImpl& model, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec && fs::is_directory(dir), "save_pretrained: cannot create directory '", dir,
              "'");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& kv : model.named_parameters(true)) tensors[kv.key()] = kv.value();
  for (const auto& kv : model.named_buffers(true)) tensors[kv.key()] = kv.value();
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  std::string text = config_to_json(model.config);
  if (const char* dt = torch_dtype_name(model.model->embeddings->weight.scalar_type())) {
    // nlohmann's object keeps the keys sorted; numbers read back exactly, so dump gives the same
    auto cfg = detail::parse_json(text, "config");
    cfg["torch_dtype"] = dt;
    text = cfg.dump(2) + "\n";
  }
  detail::write_file_atomic((fs::path(dir) / "config.json").string(), "save_pretrained",
                            [&](std::ofstream& f) { f << text; });
}

void save_pretrained(const ForgettingTransformerForCausalLM& model, const std::string& dir) {
  save_pretrained(*model, dir);
}

void load_pretrained_weights(ForgettingTransformerForCausalLMImpl& model, const std::string& dir,
                             bool strict) {
  // the files and which one holds each tensor
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const SafetensorsFile*> where;
  std::string source;
  const fs::path d(dir);
  if (fs::is_regular_file(d)) {
    files.push_back(std::make_unique<SafetensorsFile>(d.string()));
    source = d.string();
  } else if (fs::is_regular_file(d / "model.safetensors")) {
    files.push_back(std::make_unique<SafetensorsFile>((d / "model.safetensors").string()));
    source = (d / "model.safetensors").string();
  } else if (fs::is_regular_file(d / "model.safetensors.index.json")) {
    source = (d / "model.safetensors.index.json").string();
    const auto index = detail::parse_json(detail::read_file(source, "load_pretrained"), source);
    const auto wm = index.is_object() ? index.find("weight_map") : index.end();
    TORCH_CHECK(wm != index.end() && wm->is_object(), source, ": no \"weight_map\" object");
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& [name, file] : wm->items()) {
      TORCH_CHECK(file.is_string(), source, ": weight_map entry of '", name,
                  "' is not a file name");
      auto& f = by_file[file.get<std::string>()];
      if (!f) {
        files.push_back(
            std::make_unique<SafetensorsFile>((d / file.get<std::string>()).string()));
        f = files.back().get();
      }
      TORCH_CHECK(f->contains(name), source, ": tensor '", name, "' is not in its shard '",
                  f->path(), "'");
      where[name] = f;
    }
  } else {
    bool bin = fs::exists(d / "pytorch_model.bin");
    TORCH_CHECK(false, "load_pretrained: no model.safetensors or model.safetensors.index.json in '",
                dir, "'",
                bin ? " (pytorch_model.bin is not supported: convert it to safetensors)" : "");
  }
  if (files.size() == 1 && where.empty()) {
    for (const auto& [name, e] : files[0]->entries()) where[name] = files[0].get();
  }

  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  auto load_into = [&](const std::string& name, torch::Tensor& dst, bool required) {
    auto it = where.find(name);
    if (it == where.end()) {
      TORCH_CHECK(!required, "load_pretrained: missing tensor '", name, "' in '", source, "'");
      return;
    }
    auto t = it->second->read(name);
    TORCH_CHECK(t.sizes() == dst.sizes(), "load_pretrained: shape mismatch for tensor '", name,
                "' in '", it->second->path(), "': checkpoint ", t.sizes(), ", model ",
                dst.sizes());
    dst.copy_(t);
    used.insert(name);
  };
  for (auto& kv : model.named_parameters(true)) load_into(kv.key(), kv.value(), true);
  for (auto& kv : model.named_buffers(true)) load_into(kv.key(), kv.value(), false);

  std::vector<std::string> unexpected;
  for (const auto& [name, f] : where) {
    if (used.count(name)) continue;
    if (name == "lm_head.weight" && model.config.tie_word_embeddings()) continue;
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t k = 0; k < unexpected.size() && k < 8; ++k) list += (k ? ", " : "") + unexpected[k];
    if (unexpected.size() > 8) list += ", ...";
    TORCH_CHECK(!strict, "load_pretrained: ", unexpected.size(), " tensor(s) in '", source,
                "' that the model does not have: ", list);
    TORCH_WARN("load_pretrained: ignoring ", unexpected.size(), " tensor(s) in '", source,
               "' that the model does not have: ", list);
  }
}

ForgettingTransformerForCausalLM load_pretrained(const std::string& dir,
                                                 std::optional<torch::Device> device,
                                                 std::optional<torch::ScalarType> dtype,
                                                 bool strict) {
  auto config = load_config(dir);
  ForgettingTransformerForCausalLM model(config);
  if (dtype) model->to(*dtype);
  if (device) model->to(*device);
  load_pretrained_weights(*model, dir, strict);
  return model;
}

}  // namespace fox::nn
