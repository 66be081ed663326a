// pybind11 bindings of the fox::nn modules (forgetting_transformer._C.nn). Each module is bound
// with torch::python::bind_module, so Python gets a real torch.nn.Module (parameters(),
// state_dict(), .to(), train()/eval()) whose parameters are the C++ module's tensors. Options and
// the config are bound as classes constructible from keyword arguments.
#include <pybind11/functional.h>
#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/python.h>

#include <map>
#include <optional>
#include <string>

#include <fox/nn.h>

namespace py = pybind11;
using namespace fox::nn;

namespace {

template <typename C, typename Getter>
using field_t = std::decay_t<decltype(std::declval<Getter>()(std::declval<const C&>()))>;

// Binds option `name` of struct C as a read/write property.
#define FOX_FIELD(cls, C, name)                                                              \
  cls.def_property(                                                                          \
      #name, [](const C& c) { return c.name(); },                                            \
      [](C& c, std::decay_t<decltype(std::declval<const C&>().name())> v) { c.name(v); })

// Sets the keyword arguments on a fresh options object (unknown names raise AttributeError).
template <typename C>
C apply_kwargs(C c, const py::kwargs& kw) {
  py::object obj = py::cast(c);
  for (auto& item : kw) py::setattr(obj, item.first, item.second);
  return obj.cast<C>();
}

}  // namespace

void init_nn_bindings(py::module_& parent) {
  auto m = parent.def_submodule("nn", "fox::nn modules (C++)");

  // ---- options ---------------------------------------------------------------------------------
  py::class_<ForgettingTransformerConfig> cfg(m, "ForgettingTransformerConfig",
                                              "The authors' ForgettingTransformerConfig fields");
  cfg.def(py::init([](const py::kwargs& kw) {
    return apply_kwargs(ForgettingTransformerConfig(), kw);
  }));
  FOX_FIELD(cfg, ForgettingTransformerConfig, vocab_size);
  FOX_FIELD(cfg, ForgettingTransformerConfig, hidden_size);
  FOX_FIELD(cfg, ForgettingTransformerConfig, hidden_ratio);
  FOX_FIELD(cfg, ForgettingTransformerConfig, intermediate_size);
  FOX_FIELD(cfg, ForgettingTransformerConfig, num_hidden_layers);
  FOX_FIELD(cfg, ForgettingTransformerConfig, num_heads);
  FOX_FIELD(cfg, ForgettingTransformerConfig, num_kv_heads);
  FOX_FIELD(cfg, ForgettingTransformerConfig, hidden_act);
  FOX_FIELD(cfg, ForgettingTransformerConfig, initializer_range);
  FOX_FIELD(cfg, ForgettingTransformerConfig, norm_eps);
  FOX_FIELD(cfg, ForgettingTransformerConfig, pad_token_id);
  FOX_FIELD(cfg, ForgettingTransformerConfig, bos_token_id);
  FOX_FIELD(cfg, ForgettingTransformerConfig, eos_token_id);
  FOX_FIELD(cfg, ForgettingTransformerConfig, tie_word_embeddings);
  FOX_FIELD(cfg, ForgettingTransformerConfig, rope_base);
  FOX_FIELD(cfg, ForgettingTransformerConfig, use_rope);
  FOX_FIELD(cfg, ForgettingTransformerConfig, use_output_gate);
  FOX_FIELD(cfg, ForgettingTransformerConfig, ogate_act);
  FOX_FIELD(cfg, ForgettingTransformerConfig, fgate_type);
  FOX_FIELD(cfg, ForgettingTransformerConfig, fgate_bias_init);
  FOX_FIELD(cfg, ForgettingTransformerConfig, decay_time_min);
  FOX_FIELD(cfg, ForgettingTransformerConfig, decay_time_max);
  FOX_FIELD(cfg, ForgettingTransformerConfig, use_output_norm);
  FOX_FIELD(cfg, ForgettingTransformerConfig, qk_norm);
  FOX_FIELD(cfg, ForgettingTransformerConfig, qk_norm_share_param_across_head);
  FOX_FIELD(cfg, ForgettingTransformerConfig, log_pruning_tolerance);
  FOX_FIELD(cfg, ForgettingTransformerConfig, use_k_shift);
  FOX_FIELD(cfg, ForgettingTransformerConfig, use_v_shift);
  cfg.def("preset", &ForgettingTransformerConfig::preset, py::arg("architecture"),
          "A copy with the architecture flags of fox_llama, fox_pro, transformer_llama or "
          "transformer_pro");

  py::class_<ForgettingAttentionLayerOptions> aopt(m, "ForgettingAttentionLayerOptions");
  aopt.def(py::init([](int64_t hidden_size, int64_t num_heads, const py::kwargs& kw) {
             return apply_kwargs(ForgettingAttentionLayerOptions(hidden_size, num_heads), kw);
           }),
           py::arg("hidden_size"), py::arg("num_heads"));
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, hidden_size);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, num_heads);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, num_kv_heads);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, use_rope);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, rope_base);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, use_output_gate);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, ogate_act);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, fgate_type);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, fgate_bias_init);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, decay_time_min);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, decay_time_max);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, use_output_norm);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, norm_eps);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, qk_norm);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, qk_norm_eps);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, qk_norm_share_param_across_head);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, use_k_shift);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, use_v_shift);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, log_pruning_tolerance);
  FOX_FIELD(aopt, ForgettingAttentionLayerOptions, initializer_range);

  py::class_<GenerationOptions> gopt(m, "GenerationOptions");
  gopt.def(py::init([](const py::kwargs& kw) { return apply_kwargs(GenerationOptions(), kw); }));
  FOX_FIELD(gopt, GenerationOptions, max_new_tokens);
  FOX_FIELD(gopt, GenerationOptions, do_sample);
  FOX_FIELD(gopt, GenerationOptions, temperature);
  FOX_FIELD(gopt, GenerationOptions, top_k);
  FOX_FIELD(gopt, GenerationOptions, top_p);
  FOX_FIELD(gopt, GenerationOptions, stop_tokens);
  FOX_FIELD(gopt, GenerationOptions, pad_token_id);
  FOX_FIELD(gopt, GenerationOptions, seq_start);
  FOX_FIELD(gopt, GenerationOptions, prefill_chunk_size);
  FOX_FIELD(gopt, GenerationOptions, prompt_lengths);
  FOX_FIELD(gopt, GenerationOptions, static_cache);
  FOX_FIELD(gopt, GenerationOptions, cuda_graph);
  FOX_FIELD(gopt, GenerationOptions, max_length);
  gopt.def_property(
      "gate_cache_dtype",
      [](const GenerationOptions& o) -> py::object {
        if (!o.gate_cache_dtype()) return py::none();
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(*o.gate_cache_dtype())));
      },
      [](GenerationOptions& o, py::object dtype) {
        if (dtype.is_none()) o.gate_cache_dtype(std::nullopt);
        else o.gate_cache_dtype(torch::python::detail::py_object_to_dtype(dtype));
      });

  // ---- cache -----------------------------------------------------------------------------------
  py::class_<LayerCache>(m, "LayerCache")
      .def_readwrite("k", &LayerCache::k)
      .def_readwrite("v", &LayerCache::v)
      .def_readwrite("log_fgate", &LayerCache::log_fgate)
      .def_readwrite("key_shift", &LayerCache::key_shift)
      .def_readwrite("value_shift", &LayerCache::value_shift)
      .def("__len__", &LayerCache::length);
  py::class_<KVCache, std::shared_ptr<KVCache>>(m, "KVCache")
      .def(py::init<int64_t>(), py::arg("num_layers") = 0)
      .def_readwrite("seq_start", &KVCache::seq_start)
      .def_property_readonly("lengths", [](KVCache& c) { return c.lengths; })
      .def_property_readonly("max_length", [](KVCache& c) { return c.max_length; })
      .def_property_readonly("is_static", &KVCache::is_static)
      .def(
          "layer", [](KVCache& c, int64_t i) -> LayerCache& { return c.layers.at(i); },
          py::arg("index"), py::return_value_policy::reference_internal)
      .def_property_readonly("num_layers", [](KVCache& c) { return c.layers.size(); })
      .def("__len__", &KVCache::length)
      .def("reset", &KVCache::reset)
      .def("select_batch", &KVCache::select_batch, py::arg("index"));

  // ---- modules ---------------------------------------------------------------------------------
  torch::python::bind_module<RMSNormImpl>(m, "RMSNorm")
      .def(py::init([](int64_t hidden_size, double eps, bool elementwise_affine) {
             return std::make_shared<RMSNormImpl>(
                 RMSNormOptions(hidden_size).eps(eps).elementwise_affine(elementwise_affine));
           }),
           py::arg("hidden_size"), py::arg("eps") = 1e-6, py::arg("elementwise_affine") = true);

  torch::python::bind_module<GroupRMSNormImpl>(m, "GroupRMSNorm")
      .def(py::init([](int64_t num_groups, int64_t hidden_size, double eps, bool affine) {
             return std::make_shared<GroupRMSNormImpl>(
                 GroupRMSNormOptions(num_groups, hidden_size).eps(eps).elementwise_affine(affine));
           }),
           py::arg("num_groups"), py::arg("hidden_size"), py::arg("eps") = 1e-5,
           py::arg("elementwise_affine") = true);

  torch::python::bind_module<ShiftLinearImpl, true>(m, "ShiftLinear")
      .def(py::init([](int64_t in, int64_t out, int64_t heads, bool bias, bool shift_bias) {
             return std::make_shared<ShiftLinearImpl>(
                 ShiftLinearOptions(in, out, heads).bias(bias).shift_bias(shift_bias));
           }),
           py::arg("input_dim"), py::arg("output_dim"), py::arg("num_heads"),
           py::arg("bias") = false, py::arg("shift_bias") = false)
      .def("forward", &ShiftLinearImpl::forward, py::arg("x"), py::arg("prev") = py::none())
      .def("forward_with_state", &ShiftLinearImpl::forward_with_state, py::arg("x"),
           py::arg("prev") = py::none());

  torch::python::bind_module<GatedMLPImpl>(m, "GatedMLP")
      .def(py::init([](int64_t hidden_size, double hidden_ratio,
                       std::optional<int64_t> intermediate_size, const std::string& act) {
             return std::make_shared<GatedMLPImpl>(GatedMLPOptions(hidden_size)
                                                       .hidden_ratio(hidden_ratio)
                                                       .intermediate_size(intermediate_size)
                                                       .hidden_act(act));
           }),
           py::arg("hidden_size"), py::arg("hidden_ratio") = 4.0,
           py::arg("intermediate_size") = py::none(), py::arg("hidden_act") = "swish")
      .def_property_readonly("intermediate_size", &GatedMLPImpl::intermediate_size);

  torch::python::bind_module<ForgettingAttentionLayerImpl, true>(m, "ForgettingAttentionLayer")
      .def(py::init<const ForgettingAttentionLayerOptions&>(), py::arg("options"))
      .def(
          "forward",
          [](ForgettingAttentionLayerImpl& self, const torch::Tensor& x, LayerCache* cache,
             std::optional<torch::Tensor> seq_start) { return self.forward(x, cache, seq_start); },
          py::arg("x"), py::arg("cache") = py::none(), py::arg("seq_start") = py::none())
      .def("log_forget_gate", &ForgettingAttentionLayerImpl::log_forget_gate, py::arg("x"))
      .def("reset_parameters", &ForgettingAttentionLayerImpl::reset_parameters)
      .def_property_readonly("options", [](ForgettingAttentionLayerImpl& s) { return s.options; });

  torch::python::bind_module<ForgettingTransformerBlockImpl, true>(m, "ForgettingTransformerBlock")
      .def(py::init<const ForgettingTransformerConfig&>(), py::arg("config"))
      .def(
          "forward",
          [](ForgettingTransformerBlockImpl& self, const torch::Tensor& x, LayerCache* cache,
             std::optional<torch::Tensor> seq_start) { return self.forward(x, cache, seq_start); },
          py::arg("x"), py::arg("cache") = py::none(), py::arg("seq_start") = py::none());

  torch::python::bind_module<ForgettingTransformerModelImpl, true>(m, "ForgettingTransformerModel")
      .def(py::init<const ForgettingTransformerConfig&>(), py::arg("config"))
      .def(
          "forward",
          [](ForgettingTransformerModelImpl& self, const torch::Tensor& ids, KVCache* cache,
             std::optional<torch::Tensor> seq_start) { return self.forward(ids, cache, seq_start); },
          py::arg("input_ids"), py::arg("cache") = py::none(), py::arg("seq_start") = py::none())
      .def_property_readonly("config", [](ForgettingTransformerModelImpl& s) { return s.config; });

  torch::python::bind_module<ForgettingTransformerForCausalLMImpl, true>(
      m, "ForgettingTransformerForCausalLM")
      .def(py::init<const ForgettingTransformerConfig&>(), py::arg("config"))
      .def(
          "forward",
          [](ForgettingTransformerForCausalLMImpl& self, const torch::Tensor& ids,
             std::optional<torch::Tensor> labels, KVCache* cache,
             std::optional<torch::Tensor> seq_start, const std::string& reduction) {
            return self.forward(ids, labels, cache, seq_start, reduction);
          },
          py::arg("input_ids"), py::arg("labels") = py::none(), py::arg("cache") = py::none(),
          py::arg("seq_start") = py::none(), py::arg("reduction") = "none")
      .def("logits", &ForgettingTransformerForCausalLMImpl::logits, py::arg("hidden_states"))
      .def("loss", &ForgettingTransformerForCausalLMImpl::loss, py::arg("hidden_states"),
           py::arg("labels"), py::arg("reduction") = "none")
      .def("reset_parameters", &ForgettingTransformerForCausalLMImpl::reset_parameters)
      .def("new_cache",
           [](ForgettingTransformerForCausalLMImpl& s) {
             return std::make_shared<KVCache>(s.new_cache());
           })
      .def(
          "new_static_cache",
          [](ForgettingTransformerForCausalLMImpl& s, int64_t batch, int64_t max_length,
             py::object dtype, py::object gate_dtype) {
            std::optional<torch::ScalarType> t, g;
            if (!dtype.is_none()) t = torch::python::detail::py_object_to_dtype(dtype);
            if (!gate_dtype.is_none()) g = torch::python::detail::py_object_to_dtype(gate_dtype);
            return std::make_shared<KVCache>(s.new_static_cache(batch, max_length, t, g));
          },
          py::arg("batch"), py::arg("max_length"), py::arg("dtype") = py::none(),
          py::arg("gate_dtype") = py::none())
      .def(
          "generate",
          [](std::shared_ptr<ForgettingTransformerForCausalLMImpl> self,
             const torch::Tensor& input_ids, const GenerationOptions& options) {
            py::gil_scoped_release no_gil;
            ForgettingTransformerForCausalLM holder(self);
            return generate(holder, input_ids, options);
          },
          py::arg("input_ids"), py::arg("options"))
      .def_property_readonly("config",
                             [](ForgettingTransformerForCausalLMImpl& s) { return s.config; });

  // ---- generation, one step at a time (streaming) ------------------------------------------------
  py::class_<GenerationSession, std::shared_ptr<GenerationSession>>(m, "GenerationSession")
      .def(py::init([](std::shared_ptr<ForgettingTransformerForCausalLMImpl> model,
                       const torch::Tensor& input_ids, const GenerationOptions& options) {
             return std::make_shared<GenerationSession>(ForgettingTransformerForCausalLM(model),
                                                        input_ids, options);
           }),
           py::arg("model"), py::arg("input_ids"), py::arg("options"))
      .def("prefill", &GenerationSession::prefill, py::call_guard<py::gil_scoped_release>())
      .def("step", &GenerationSession::step, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("finished", &GenerationSession::finished)
      .def_property_readonly("steps_left", &GenerationSession::steps_left)
      .def_property_readonly("uses_cuda_graph", &GenerationSession::uses_cuda_graph);

  // ---- checkpoints (HF format: config.json + model.safetensors) --------------------------------
  m.def("config_to_json", &config_to_json, py::arg("config"),
        "config.json text of a config (sorted keys, model_type and architectures added)");
  m.def(
      "config_from_json",
      [](const std::string& text) { return config_from_json(text); }, py::arg("text"),
      "A config from config.json text (unknown keys ignored, missing keys keep the defaults)");
  m.def("load_config", &load_config, py::arg("path"),
        "A config from a config.json file or a checkpoint directory");
  m.def(
      "save_safetensors",
      [](const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
         const std::optional<std::map<std::string, std::string>>& metadata) {
        py::gil_scoped_release no_gil;
        save_safetensors(path, tensors, metadata.value_or(std::map<std::string, std::string>{}));
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = py::none(),
      "Writes a dict of tensors to a safetensors file");
  m.def(
      "load_safetensors",
      [](const std::string& path) {
        py::gil_scoped_release no_gil;
        return load_safetensors(path);
      },
      py::arg("path"), "Reads every tensor of a safetensors file (CPU tensors)");
  m.def("load_safetensors_metadata", &load_safetensors_metadata, py::arg("path"),
        "The __metadata__ of a safetensors file");
  m.def(
      "save_pretrained",
      [](const ForgettingTransformerForCausalLMImpl& model, const std::string& dir) {
        py::gil_scoped_release no_gil;
        save_pretrained(model, dir);
      },
      py::arg("model"), py::arg("save_directory"),
      "Writes config.json and model.safetensors into a directory");
  m.def(
      "load_pretrained_weights",
      [](ForgettingTransformerForCausalLMImpl& model, const std::string& path, bool strict) {
        py::gil_scoped_release no_gil;
        load_pretrained_weights(model, path, strict);
      },
      py::arg("model"), py::arg("path"), py::arg("strict") = false,
      "Copies the weights of a checkpoint directory (or a .safetensors file) into the model");

  // ---- parameters from outside the forward ----------------------------------------------------
  m.def("release_gradients", &release_gradients, py::arg("module"),
        "Sets every parameter's gradient to None (zero_grad(set_to_none=True) without "
        "torch::nn::Module's detach per gradient)");
  m.def("replace_parameter", &replace_parameter, py::arg("module"), py::arg("name"),
        py::arg("value"),
        "Re-points parameter `name` of a C++ module (registered entry and forward's member) to "
        "`value`");
  m.def(
      "set_block_runner",
      [](ForgettingTransformerModelImpl& model,
         std::optional<ForgettingTransformerModelImpl::BlockRunner> runner) {
        // pybind11's std::function holder takes the GIL to call and to release the callable.
        model.set_block_runner(runner.value_or(nullptr));
      },
      py::arg("model"), py::arg("runner"),
      "runner(i, h, layer_cache, seq_start) -> h runs block i in forward (None: call it directly)");

  // ---- context parallelism (forgetting_transformer.distributed.set_context_parallel) ----------
  py::class_<SequenceShard, std::shared_ptr<SequenceShard>>(
      m, "SequenceShard",
      "A sequence split across ranks, as a model's forward sees it: prepare(shard, length, "
      "device) fills positions, piece_lengths and sequence_length once a forward; "
      "previous_tokens(y) and attention(q, k, v, log_fgate, sm_scale, adaptive_threshold) "
      "communicate")
      .def(py::init<>())
      .def_readwrite("prepare", &SequenceShard::prepare)
      .def_readwrite("positions", &SequenceShard::positions)
      .def_readwrite("piece_lengths", &SequenceShard::piece_lengths)
      .def_readwrite("sequence_length", &SequenceShard::sequence_length)
      .def_readwrite("previous_tokens", &SequenceShard::previous_tokens)
      .def_readwrite("attention", &SequenceShard::attention);
  m.def(
      "set_sequence_shard",
      [](ForgettingTransformerModelImpl& model, std::shared_ptr<SequenceShard> shard) {
        model.set_sequence_shard(std::move(shard));
      },
      py::arg("model"), py::arg("shard"),
      "Runs the model context-parallel over `shard` (None: the whole sequence is local)");

  m.def("mlp_intermediate_size", &mlp_intermediate_size, py::arg("hidden_size"),
        py::arg("hidden_ratio"));
  m.def("sample_next_token", &sample_next_token, py::arg("logits"), py::arg("options"));

  // The fused elementwise functions the modules are built from (fox/nn/functional.h).
  auto f = m.def_submodule("functional", "fox::nn::functional: fused norms, KV-shift, gates, loss, few-row linear");
  f.def(
      "rms_norm",
      [](const torch::Tensor& x, const std::optional<torch::Tensor>& weight, int64_t group_size,
         double eps) {
        return functional::rms_norm(x, weight.value_or(torch::Tensor()), group_size, eps);
      },
      py::arg("x"), py::arg("weight"), py::arg("group_size"), py::arg("eps"));
  f.def("shift_mix", &functional::shift_mix, py::arg("cur"), py::arg("shift_logits"),
        py::arg("first") = std::nullopt);
  f.def(
      "log_forget_gate",
      [](const torch::Tensor& logits, const std::optional<torch::Tensor>& bias) {
        return functional::log_forget_gate(logits, bias.value_or(torch::Tensor()));
      },
      py::arg("logits"), py::arg("bias") = std::nullopt);
  f.def("gated", &functional::gated, py::arg("gate"), py::arg("value"), py::arg("act"));
  f.def(
      "add_rms_norm",
      [](const torch::Tensor& x, const torch::Tensor& delta,
         const std::optional<torch::Tensor>& weight, double eps) {
        return functional::add_rms_norm(x, delta, weight.value_or(torch::Tensor()), eps);
      },
      py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  f.def(
      "shift_mix_update",
      [](const torch::Tensor& cur, const torch::Tensor& shift_logits, torch::Tensor state) {
        return functional::shift_mix_update(cur, shift_logits, state);
      },
      py::arg("cur"), py::arg("shift_logits"), py::arg("state"));
  f.def(
      "linear",
      [](const torch::Tensor& x, const torch::Tensor& weight,
         const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual) {
        return functional::linear(x, weight, bias.value_or(torch::Tensor()),
                                  residual.value_or(torch::Tensor()));
      },
      py::arg("x"), py::arg("weight"), py::arg("bias") = std::nullopt,
      py::arg("residual") = std::nullopt);
  f.def("logits", &functional::logits, py::arg("hidden"), py::arg("weight"));
  f.def(
      "gated_linear",
      [](const torch::Tensor& gate, const torch::Tensor& value, const std::string& act,
         const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
         const std::optional<torch::Tensor>& residual) {
        return functional::gated_linear(gate, value, act, weight, bias.value_or(torch::Tensor()),
                                        residual.value_or(torch::Tensor()));
      },
      py::arg("gate"), py::arg("value"), py::arg("act"), py::arg("weight"),
      py::arg("bias") = std::nullopt, py::arg("residual") = std::nullopt);
  f.def(
      "split_gated_linear",
      [](const torch::Tensor& gate_value, const std::string& act, const torch::Tensor& weight,
         const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual) {
        return functional::split_gated_linear(gate_value, act, weight,
                                              bias.value_or(torch::Tensor()),
                                              residual.value_or(torch::Tensor()));
      },
      py::arg("gate_value"), py::arg("act"), py::arg("weight"), py::arg("bias") = std::nullopt,
      py::arg("residual") = std::nullopt);
  f.def(
      "attention_inputs",
      [](const torch::Tensor& y, int64_t q, int64_t k, int64_t v, int64_t q_width,
         int64_t kv_width, int64_t k_shift, int64_t v_shift, int64_t shift_heads, int64_t q_group,
         int64_t k_group, double norm_eps, std::vector<std::pair<int64_t, int64_t>> passed,
         const std::optional<torch::Tensor>& q_norm_weight,
         const std::optional<torch::Tensor>& k_norm_weight) {
        functional::AttentionInputLayout l;
        l.q = q, l.k = k, l.v = v, l.q_width = q_width, l.kv_width = kv_width;
        l.k_shift = k_shift, l.v_shift = v_shift, l.shift_heads = shift_heads;
        l.q_group = q_group, l.k_group = k_group, l.norm_eps = norm_eps;
        l.passed = std::move(passed);
        return functional::attention_inputs(y, l, q_norm_weight.value_or(torch::Tensor()),
                                            k_norm_weight.value_or(torch::Tensor()));
      },
      py::arg("y"), py::kw_only(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_width"),
      py::arg("kv_width"), py::arg("k_shift") = -1, py::arg("v_shift") = -1,
      py::arg("shift_heads") = 0, py::arg("q_group") = 0, py::arg("k_group") = 0,
      py::arg("norm_eps") = 1e-6, py::arg("passed") = std::vector<std::pair<int64_t, int64_t>>(),
      py::arg("q_norm_weight") = std::nullopt, py::arg("k_norm_weight") = std::nullopt);
  f.def("linear_cross_entropy", &functional::linear_cross_entropy, py::arg("hidden"),
        py::arg("weight"), py::arg("labels"), py::arg("ignore_index") = -100,
        py::arg("chunk_rows") = 0, py::arg("reduction") = "none");
  f.def("argmax", &functional::argmax, py::arg("x"));
  f.def("cross_entropy", &functional::cross_entropy, py::arg("logits"), py::arg("labels"),
        py::arg("ignore_index") = -100);
}
