#include <fox/nn/config_json.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <system_error>

#include <c10/util/Exception.h>

#include "json_files.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace fox::nn {

// Every ForgettingTransformerConfig field, in declaration order.
#define FOX_CONFIG_FIELDS(X)                                                                     \
  X(vocab_size) X(hidden_size) X(hidden_ratio) X(intermediate_size) X(num_hidden_layers)         \
  X(num_heads) X(num_kv_heads) X(hidden_act) X(initializer_range) X(norm_eps) X(pad_token_id)    \
  X(bos_token_id) X(eos_token_id) X(tie_word_embeddings) X(rope_base) X(use_rope)                \
  X(use_output_gate) X(ogate_act) X(fgate_type) X(fgate_bias_init) X(decay_time_min)             \
  X(decay_time_max) X(use_output_norm) X(qk_norm) X(qk_norm_share_param_across_head)             \
  X(log_pruning_tolerance) X(use_k_shift) X(use_v_shift)

namespace {

template <typename T>
json to_json_value(const T& v, const char* key) {
  if constexpr (std::is_same_v<T, double>) {
    // nlohmann would write null, which reads back as "unset"
    TORCH_CHECK(std::isfinite(v), "config_to_json: '", key, "' is ", v,
                ": JSON has no non-finite numbers");
  }
  return v;
}
template <typename T>
json to_json_value(const std::optional<T>& v, const char* key) {
  return v ? to_json_value(*v, key) : json(nullptr);
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "binary data";
  }
}

// from_json_value(v, out, key, what): false when v is null (keep the default).
bool from_json_value(const json& v, int64_t& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  if (v.is_number_integer() &&
      (!v.is_number_unsigned() ||
       v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
    out = v.get<int64_t>();
    return true;
  }
  // an integral float (64.0) is an integer, as Python's int() of it
  const double d = v.is_number() ? v.get<double>() : 0.0;
  TORCH_CHECK(v.is_number_float() && std::isfinite(d) && std::floor(d) == d && std::abs(d) < 9.2e18,
              what, ": '", key, "' must be an integer, got ",
              v.is_number() ? detail::brief_json(v) : type_name(v));
  out = static_cast<int64_t>(d);
  return true;
}
bool from_json_value(const json& v, double& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_number(), what, ": '", key, "' must be a number, got ", type_name(v));
  out = v.get<double>();
  return true;
}
bool from_json_value(const json& v, bool& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_boolean(), what, ": '", key, "' must be true or false, got ", type_name(v));
  out = v.get<bool>();
  return true;
}
bool from_json_value(const json& v, std::string& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_string(), what, ": '", key, "' must be a string, got ", type_name(v));
  out = v.get<std::string>();
  return true;
}
template <typename T>
bool from_json_value(const json& v, std::optional<T>& out, const char* key,
                     const std::string& what) {
  if (v.is_null()) {
    out = std::nullopt;
    return true;
  }
  const json* item = &v;
  // transformers allows a list of token ids (e.g. several eos tokens): the first one is used
  if (v.is_array() && !v.empty() && std::is_same_v<T, int64_t>) item = &v.front();
  T x{};
  from_json_value(*item, x, key, what);
  out = x;
  return true;
}

}  // namespace

std::string config_to_json(const ForgettingTransformerConfig& c) {
  json v = json::object();  // keys sorted, as transformers' to_json_string(sort_keys=True)
#define FOX_PUT(name) v[#name] = to_json_value(c.name(), #name);
  FOX_CONFIG_FIELDS(FOX_PUT)
#undef FOX_PUT
  v["architectures"] = json::array({"ForgettingTransformerForCausalLM"});
  v["model_type"] = "forgetting_transformer";
  try {
    return v.dump(2) + "\n";
  } catch (const json::exception&) {
    TORCH_CHECK(false, "config_to_json: the config's strings must be valid UTF-8");
  }
}

ForgettingTransformerConfig config_from_json(const std::string& text, const std::string& what) {
  const json v = detail::parse_json(text, what);
  TORCH_CHECK(v.is_object(), what, ": the config must be a JSON object, got ", type_name(v));
  if (auto mt = v.find("model_type"); mt != v.end() && !mt->is_null()) {
    TORCH_CHECK(mt->is_string() &&
                    mt->get<std::string>().find("forgetting_transformer") != std::string::npos,
                what, ": model_type ", detail::brief_json(*mt),
                " is not a forgetting_transformer model");
  }
  // the authors' options that this implementation does not have
  if (auto w = v.find("window_size"); w != v.end() && !w->is_null()) {
    TORCH_CHECK(false, what, ": window_size ", detail::brief_json(*w),
                " (sliding-window attention) is not supported");
  }
  if (auto e = v.find("elementwise_affine"); e != v.end() && e->is_boolean() && !e->get<bool>()) {
    TORCH_CHECK(false, what, ": elementwise_affine false (norms without weights) is not supported");
  }
  if (auto b = v.find("attention_bias"); b != v.end() && b->is_boolean() && b->get<bool>()) {
    TORCH_CHECK(false, what, ": attention_bias true (biased q/k/v/o projections) is not supported");
  }
  ForgettingTransformerConfig c;
#define FOX_GET(name)                                                          \
  if (auto item = v.find(#name); item != v.end()) {                            \
    auto value = c.name();                                                     \
    if (from_json_value(*item, value, #name, what)) c.name(std::move(value));  \
  }
  FOX_CONFIG_FIELDS(FOX_GET)
#undef FOX_GET
  return c;
}

ForgettingTransformerConfig load_config(const std::string& path) {
  std::error_code ec;
  const std::string file =
      fs::is_regular_file(path, ec) ? path : (fs::path(path) / "config.json").string();
  return config_from_json(detail::read_file(file, "load_config"), file);
}

}  // namespace fox::nn
