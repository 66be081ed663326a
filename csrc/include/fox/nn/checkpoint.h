// Hugging Face-format checkpoints of the causal LM: a directory with
//   config.json        the authors' ForgettingTransformerConfig fields, plus "model_type" and
//                      "architectures" (as transformers' save_pretrained writes them)
//   model.safetensors  the weights, named as the module's parameters (model.layers.0.attn.q_proj
//                      .weight, lm_head.weight, ...); or sharded: model.safetensors.index.json with
//                      a "weight_map" of tensor name -> shard file (read only)
// The safetensors format and the JSON subset it needs are implemented here (no dependencies):
// 8-byte little-endian header length N, N bytes of JSON header {name: {"dtype", "shape",
// "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the raw little-endian data.
// Every error is a c10::Error that names the file (and the tensor or config key).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include <fox/nn/model.h>

namespace fox::nn {

// ---- JSON (the subset of RFC 8259 that configs and safetensors headers use: all of it) ----------
namespace json {

/// A parsed JSON value. Numbers keep whether they were written as integers (exact int64).
/// Objects keep their key order; lookups find the last occurrence of a key.
struct Value {
  enum class Type { Null, Bool, Number, String, Array, Object };
  Type type = Type::Null;
  bool boolean = false;
  double number = 0.0;
  bool is_integer = false;  // written without fraction/exponent and fits in int64
  int64_t integer = 0;
  std::string string;
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;

  static Value null() { return Value(); }
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_double(double d);
  static Value from_string(std::string s);
  static Value new_array();
  static Value new_object();

  bool is_null() const { return type == Type::Null; }
  bool is_bool() const { return type == Type::Bool; }
  bool is_number() const { return type == Type::Number; }
  bool is_string() const { return type == Type::String; }
  bool is_array() const { return type == Type::Array; }
  bool is_object() const { return type == Type::Object; }
  /// Member of an object (last occurrence), or nullptr.
  const Value* find(const std::string& key) const;
  /// Appends (object) a member; returns it.
  Value& set(const std::string& key, Value v);
};

/// Parses one JSON document (whitespace around it allowed). Accepts Python's NaN, Infinity and
/// -Infinity. Nesting deeper than 256 levels is an error. Errors name `what` and the offset.
Value parse(const std::string& text, const std::string& what = "JSON");
/// Serializes; indent > 0 pretty-prints with that many spaces. Doubles are written with the
/// shortest text that reads back exactly (always with '.' or an exponent, as Python).
std::string dump(const Value& v, int indent = 0);

}  // namespace json

// ---- config ------------------------------------------------------------------------------------

/// The config as a JSON object: every ForgettingTransformerConfig field (null for unset options),
/// "model_type": "forgetting_transformer", "architectures": ["ForgettingTransformerForCausalLM"].
json::Value config_to_json_value(const ForgettingTransformerConfig& config);
/// config_to_json_value, serialized with 2-space indentation.
std::string config_to_json(const ForgettingTransformerConfig& config);
/// Reads the fields of a config object. Unknown keys are ignored (the authors' configs have more,
/// e.g. use_cache, fuse_norm, max_position_embeddings); missing keys and null for a non-optional
/// field keep the defaults. A wrong type is an error naming the key. A "model_type" that is not a
/// forgetting_transformer one, and authors' options this model does not implement (a non-null
/// window_size, elementwise_affine false, attention_bias true), are errors.
ForgettingTransformerConfig config_from_json_value(const json::Value& v,
                                                   const std::string& what = "config");
ForgettingTransformerConfig config_from_json(const std::string& text,
                                             const std::string& what = "config");
/// Reads `path` (a config.json, or a directory holding one).
ForgettingTransformerConfig load_config(const std::string& path);

// ---- safetensors -------------------------------------------------------------------------------

/// safetensors dtype name ("F32", "BF16", ...) of a torch dtype; error if it has none.
std::string safetensors_dtype_name(torch::ScalarType dtype);
/// torch dtype of a safetensors dtype name (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3
/// F8_E5M2); error if unknown.
torch::ScalarType safetensors_dtype(const std::string& name);

/// Writes `tensors` (any device, dtype with a safetensors name, any strides) to `path`, with
/// optional string metadata ("__metadata__"), byte for byte as the safetensors package: data
/// ordered by dtype (I64 F64 F32 I32 BF16 F16 I16 F8 I8 U8 BOOL) then name, compact header padded
/// with spaces to a multiple of 8 bytes. The
/// file is written to a temporary name and renamed into place.
void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
/// Reads every tensor of a safetensors file (CPU tensors of the stored dtypes).
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);
/// Reads the "__metadata__" of a safetensors file (empty if none).
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

/// An open safetensors file with a validated header: tensors are read one at a time.
class SafetensorsFile {
 public:
  struct Entry {
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte range within the data section
  };
  /// Opens and validates the header (sizes, dtypes, shapes against byte ranges, the data section
  /// fully covered without overlaps, the file length).
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  /// Reads one tensor (a fresh CPU tensor); error naming the file if it is not there.
  torch::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// ---- pretrained checkpoints --------------------------------------------------------------------

/// Writes dir/config.json and dir/model.safetensors (every parameter and buffer, in its dtype;
/// metadata {"format": "pt"}); creates `dir` if needed. config.json also gets "torch_dtype".
void save_pretrained(const ForgettingTransformerForCausalLMImpl& model, const std::string& dir);
void save_pretrained(const ForgettingTransformerForCausalLM& model, const std::string& dir);

/// Copies the weights of checkpoint directory `dir` (model.safetensors or a sharded
/// model.safetensors.index.json) into `model`, converting to each parameter's dtype and device.
/// A missing parameter or a shape mismatch is an error naming the tensor and the file; a missing
/// buffer keeps its value (buffers are functions of the config). Tensors the model does not have
/// are ignored with a warning, or are an error when `strict`; lm_head.weight of a model with tied
/// embeddings is always ignored.
void load_pretrained_weights(ForgettingTransformerForCausalLMImpl& model, const std::string& dir,
                             bool strict = false);

/// A model built from dir/config.json with the weights of the directory, moved to `device` and
/// converted to `dtype` (default: float32 parameters on the CPU, whatever the stored dtype).
ForgettingTransformerForCausalLM load_pretrained(
    const std::string& dir, std::optional<torch::Device> device = std::nullopt,
    std::optional<torch::ScalarType> dtype = std::nullopt, bool strict = false);

}  // namespace fox::nn
