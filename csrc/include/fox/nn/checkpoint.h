// Hugging Face-format checkpoints of the causal LM: a directory with
//   config.json        the authors' ForgettingTransformerConfig fields, plus "model_type" and
//                      "architectures" (as transformers' save_pretrained writes them)
//   model.safetensors  the weights, named as the module's parameters (model.layers.0.attn.q_proj
//                      .weight, lm_head.weight, ...); or sharded: model.safetensors.index.json with
//                      a "weight_map" of tensor name -> shard file (read only)
// The file formats have their own headers (config_json.h, safetensors.h), included here.
// Every error is a c10::Error that names the file (and the tensor or config key).
#pragma once

#include <optional>
#include <string>

#include <torch/types.h>

#include <fox/nn/config_json.h>
#include <fox/nn/model.h>
#include <fox/nn/safetensors.h>

namespace fox::nn {

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
