// ForgettingTransformerConfig <-> config.json, as transformers writes the authors' config: every
// ForgettingTransformerConfig field, "model_type" and "architectures". Every error is a
// c10::Error that names the document (and the key).
#pragma once

#include <string>

#include <fox/nn/model.h>

namespace fox::nn {

/// config.json text: every ForgettingTransformerConfig field (null for unset options),
/// "model_type": "forgetting_transformer", "architectures": ["ForgettingTransformerForCausalLM"];
/// keys sorted, 2-space indentation, a final newline. Non-finite floats are an error (JSON has
/// no spelling for them).
std::string config_to_json(const ForgettingTransformerConfig& config);
/// Reads the fields of a config object. Unknown keys are ignored (the authors' configs have more,
/// e.g. use_cache, fuse_norm, max_position_embeddings); missing keys and null for a non-optional
/// field keep the defaults. A wrong type is an error naming the key. A "model_type" that is not a
/// forgetting_transformer one, and authors' options this model does not implement (a non-null
/// window_size, elementwise_affine false, attention_bias true), are errors. `what` names the
/// document in errors.
ForgettingTransformerConfig config_from_json(const std::string& text,
                                             const std::string& what = "config");
/// Reads `path` (a config.json, or a directory holding one).
ForgettingTransformerConfig load_config(const std::string& path);

}  // namespace fox::nn
