"""The authors' Hugging Face classes (``forgetting_transformer.model``) over our C++ modules.

    import forgetting_transformer.model   # registers the classes with AutoConfig / AutoModel*
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("fox-pro-760m")   # the authors' checkpoints
    out = model(input_ids=input_ids, labels=labels)   # out.loss (B, T) per token, out.logits None
    ids = model.generate(prompt, max_new_tokens=30)

Same names, signatures and outputs as the authors' package (``ForgettingTransformerConfig``,
``ForgettingTransformerModel``, ``ForgettingTransformerForCausalLM``, ``ForgettingAttentionLayer``),
but there is no second model here: the modules are those of ``forgetting_transformer.nn`` (the
C++ ``fox::nn`` modules), registered directly as children, so parameter names are the authors'
(``model.layers.0.attn.q_proj.weight``, ``lm_head.weight``) and an ``nn`` model and its wrapper
share their tensors. ``past_key_values`` is a transformers ``Cache`` over the C++ ``KVCache``.

``generate`` runs our C++ generation (static cache; on a GPU the decoding step is a replayed CUDA
graph) when the request is greedy or plain sampling (temperature, top_k, top_p), with or without
left padding, stop tokens, stopping criteria and a streamer; anything else (beam search, logits
processors, returned scores, ...) runs transformers' own loop over our cache.

Needs the ``hf`` extra: ``pip install 'forgetting_transformer[hf]'``.
"""
from __future__ import annotations

import json
from typing import Optional, Union

import torch
import torch.nn.functional as F

try:
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig,
                              PretrainedConfig, PreTrainedModel)
    from transformers.cache_utils import Cache
    from transformers.generation import GenerationMixin, StoppingCriteriaList
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("forgetting_transformer.model needs transformers and safetensors: "
                      "pip install 'forgetting_transformer[hf]'") from e

from . import nn as fox_nn

__all__ = [
    "ForgettingTransformerConfig", "ForgettingTransformerPreTrainedModel",
    "ForgettingTransformerModel", "ForgettingTransformerForCausalLM", "ForgettingAttentionLayer",
    "ForgettingTransformerCache",
]


# ---- config -------------------------------------------------------------------------------------

class ForgettingTransformerConfig(PretrainedConfig):
    """The authors' config (same model_type, fields and defaults); unknown fields are kept."""

    model_type = "forgetting_transformer-project_fox"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        hidden_ratio: Optional[float] = 4,
        intermediate_size: Optional[int] = None,
        num_hidden_layers: int = 24,
        num_heads: int = 32,
        num_kv_heads: Optional[int] = None,
        hidden_act: str = "swish",
        window_size: Optional[int] = None,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        elementwise_affine: Optional[bool] = True,
        norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = 1,
        eos_token_id: Optional[int] = 2,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        fuse_norm: bool = True,
        fuse_cross_entropy: bool = True,
        rope_base: float = 500000.0,
        use_rope: bool = False,
        use_output_gate: bool = False,
        ogate_act: str = "sigmoid",
        fgate_type: str = "full",
        fgate_bias_init: bool = False,
        decay_time_min: Optional[float] = None,
        decay_time_max: Optional[float] = None,
        use_output_norm: bool = False,
        qk_norm: bool = False,
        qk_norm_share_param_across_head: bool = False,
        use_k_shift: bool = False,
        use_v_shift: bool = False,
        log_pruning_tolerance: Optional[float] = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.window_size = window_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_norm = fuse_norm
        self.rope_base = rope_base
        self.use_rope = use_rope
        self.use_output_gate = use_output_gate
        self.ogate_act = ogate_act
        self.fgate_type = fgate_type
        self.fgate_bias_init = fgate_bias_init
        self.decay_time_min = decay_time_min
        self.decay_time_max = decay_time_max
        self.use_output_norm = use_output_norm
        self.qk_norm = qk_norm
        self.qk_norm_share_param_across_head = qk_norm_share_param_across_head
        self.use_k_shift = use_k_shift
        self.use_v_shift = use_v_shift
        self.log_pruning_tolerance = log_pruning_tolerance
        # Set here too: transformers 5 no longer keeps the token ids on every config.
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)

    def to_fox_config(self) -> fox_nn.ForgettingTransformerConfig:
        """The C++ config (fox::nn::ForgettingTransformerConfig) of these fields. The C++ parser
        rejects what the modules do not implement (window_size, attention_bias, no affine norms)
        with an error that names the field."""
        fields = {k: v for k, v in self.to_dict().items()
                  if k in _FOX_CONFIG_FIELDS or k in _CHECKED_FIELDS}
        return fox_nn.config_from_json(json.dumps(fields))

    @classmethod
    def from_fox_config(cls, config: fox_nn.ForgettingTransformerConfig,
                        **kwargs) -> "ForgettingTransformerConfig":
        """The config of a forgetting_transformer.nn (C++) config; kwargs override fields."""
        fields = json.loads(fox_nn.config_to_json(config))
        for key in ("model_type", "architectures"):
            fields.pop(key, None)
        fields.update(kwargs)
        return cls(**fields)


# The C++ config's fields (what config_to_json writes), read once, and the authors' fields whose
# other values the C++ parser rejects.
_FOX_CONFIG_FIELDS = frozenset(json.loads(fox_nn.config_to_json(
    fox_nn.ForgettingTransformerConfig()))) - {"model_type", "architectures"}
_CHECKED_FIELDS = frozenset({"model_type", "window_size", "attention_bias", "elementwise_affine"})


# ---- cache --------------------------------------------------------------------------------------

def _autocast_cache_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype K and V come out in: a float32 model under autocast computes them in the autocast
    dtype, and a static cache of that dtype avoids a conversion per step (None: the weights')."""
    weight = next(model.parameters())
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return None


class ForgettingTransformerCache(Cache):
    """``past_key_values`` of the models: our C++ KVCache (per layer the keys, values and log
    forget gates of the past tokens and the KV-shift states; the left padding ``seq_start``).
    Static (preallocated to ``max_length`` tokens per row, what generate uses) or growing.
    ``fox_cache`` is the C++ cache; ``layer(i)`` its tensors of layer i (k, v, log_fgate,
    key_shift, value_shift)."""

    def __init__(self, fox_cache: Union[fox_nn.KVCache, int]):
        """fox_cache: a C++ KVCache, or a number of layers for a new growing one."""
        super().__init__(layers=[])
        if isinstance(fox_cache, int):
            fox_cache = fox_nn.KVCache(fox_cache)
        if not isinstance(fox_cache, fox_nn.KVCache):
            raise TypeError("fox_cache must be a forgetting_transformer.nn.KVCache or a number of "
                            f"layers, got {type(fox_cache).__name__}")
        self.fox_cache = fox_cache

    @classmethod
    def for_model(cls, model: "ForgettingTransformerForCausalLM", batch_size: Optional[int] = None,
                  max_length: Optional[int] = None) -> "ForgettingTransformerCache":
        """An empty cache for `model`: static for `batch_size` rows of `max_length` tokens when
        both are given, else growing."""
        fox = model.fox_model
        if batch_size is None and max_length is None:
            return cls(fox.new_cache())
        if batch_size is None or max_length is None:
            raise ValueError("ForgettingTransformerCache.for_model: give both batch_size and "
                             f"max_length for a static cache, got {batch_size} and {max_length}")
        return cls(fox.new_static_cache(batch_size, max_length, _autocast_cache_dtype(model)))

    def layer(self, layer_idx: int) -> fox_nn.LayerCache:
        return self.fox_cache.layer(layer_idx)

    @property
    def is_static(self) -> bool:
        return self.fox_cache.is_static

    def __len__(self) -> int:
        return self.fox_cache.num_layers

    def __repr__(self) -> str:
        kind = f"static, max_length={self.fox_cache.max_length}" if self.is_static else "dynamic"
        return (f"{type(self).__name__}(layers={len(self)}, {kind}, "
                f"seq_length={self.get_seq_length()})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.fox_cache)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.fox_cache.max_length if self.is_static else -1

    @property
    def max_cache_len(self) -> int:
        return self.get_max_cache_shape()

    @property
    def batch_size(self) -> int:
        cache = self.fox_cache
        if cache.is_static:
            return cache.lengths.shape[0]
        return cache.layer(0).k.shape[0] if len(cache) else 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return len(self.fox_cache) > 0

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def update(self, *args, **kwargs):
        raise NotImplementedError("ForgettingTransformerCache is written by the model's forward "
                                  "(keys, values, forget gates and KV-shift states together)")

    def reset(self) -> None:
        self.fox_cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_static:
            raise NotImplementedError("a static ForgettingTransformerCache keeps its rows; use a "
                                      "growing cache (ForgettingTransformerCache.for_model(model))")
        self.fox_cache.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        index = torch.arange(self.batch_size).repeat_interleave(repeats)
        self.batch_select_indices(index)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("ForgettingTransformerCache cannot be cropped")


# ---- models -------------------------------------------------------------------------------------

def _seq_start(attention_mask: Optional[torch.Tensor], batch: int, length: int,
               device: torch.device) -> Optional[torch.Tensor]:
    """The (B,) first non-padding positions of a left-padding attention_mask (B, length), or None
    when no row is padded. One host synchronization (the check)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask must be (batch, seqlen) = ({batch}, {length}) (2D, left "
                         f"padding), got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device)
    tokens = mask != 0
    ones = tokens.sum(-1)
    # All checks in one host synchronization. Left padding: no 0 after a 1 in a row (the kernels
    # take one start per row).
    flags = torch.stack([((mask != 0) & (mask != 1)).any(), (tokens[:, :-1] & ~tokens[:, 1:]).any(),
                         (ones == 0).any(), (ones < length).any()]).tolist()
    not_binary, not_left, empty_row, padded = flags
    if not_binary:
        raise ValueError("attention_mask must hold only 0 and 1")
    if not_left:
        raise ValueError("attention_mask must be left padding (zeros only before the tokens of "
                         "each row); right or inner padding is not supported")
    if empty_row:
        raise ValueError("attention_mask: every row needs at least one token (a row is all zeros)")
    if not padded:
        return None
    return length - ones


def _cache_for_forward(model, past_key_values, use_cache: bool):
    """(the ForgettingTransformerCache to return or None, the C++ cache to pass or None)."""
    if past_key_values is None:
        if not use_cache:
            return None, None
        cache = ForgettingTransformerCache(model.new_cache())
        return cache, cache.fox_cache
    if isinstance(past_key_values, ForgettingTransformerCache):
        return past_key_values, past_key_values.fox_cache
    if isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0:
        # An empty transformers cache (e.g. the DynamicCache that generate makes): ours instead.
        cache = ForgettingTransformerCache(model.new_cache())
        return cache, cache.fox_cache
    raise TypeError("past_key_values must be a ForgettingTransformerCache (as returned by the "
                    f"model) or None, got {type(past_key_values).__name__}")


class _EmbeddingLookup(torch.nn.Module):
    """``get_input_embeddings()``: a callable view of the C++ embedding table (which has no Python
    forward). Not registered as a child: the weight stays ``model.embeddings.weight``."""

    def __init__(self, table: torch.nn.Module, padding_idx: Optional[int]):
        super().__init__()
        self.__dict__["_table"] = table
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        return self._table.weight

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight, self.padding_idx)


def _describe(module: torch.nn.Module) -> str:
    """One module of the tree as the authors' print shows it (the C++ modules print only their
    type): leaves with their shapes, containers with their children, repeats folded."""
    params = dict(module.named_parameters(recurse=False))
    cpp = repr(module.cpp_module) if hasattr(module, "cpp_module") else ""
    name = type(module).__name__ if not cpp.startswith("torch::nn::") else (
        cpp.replace("torch::nn::", "").replace("Impl", ""))
    if name == "Linear":
        w = params["weight"]
        return (f"Linear(in_features={w.shape[1]}, out_features={w.shape[0]}, "
                f"bias={'bias' in params})")
    if name == "Embedding":
        return "Embedding({}, {})".format(*params["weight"].shape)
    if name in ("RMSNorm", "GroupRMSNorm"):
        return f"{name}({params['weight'].shape[0]})"
    if name == "ShiftLinear":
        w = dict(module.named_parameters())["linear.weight"]
        return f"ShiftLinear({w.shape[1]}, {w.shape[0]})"
    children = [(k, _describe(m)) for k, m in module._modules.items() if m is not None]
    if not children:
        return f"{name}()"
    lines, i = [], 0
    while i < len(children):  # fold runs of identical list items: (0-23): 24 x Block(...)
        j = i
        while (j + 1 < len(children) and children[j + 1][1] == children[i][1]
               and children[i][0].isdigit()):
            j += 1
        key = children[i][0] if j == i else f"{children[i][0]}-{children[j][0]}"
        text = children[i][1] if j == i else f"{j - i + 1} x {children[i][1]}"
        lines.append(f"({key}): " + text.replace("\n", "\n  "))
        i = j + 1
    return name + "(\n  " + "\n  ".join(lines) + "\n)"


def _forward_setup(model, attention_mask, past_key_values, use_cache, output_attentions,
                   output_hidden_states, batch, length, device):
    """What both forwards resolve first: (output_hidden_states, cache, its C++ cache, seq_start);
    the left padding of attention_mask is read on the first chunk of a cache only."""
    if output_attentions:
        raise ValueError("output_attentions=True is not supported (the attention kernels "
                         "never form the attention matrix)")
    output_hidden_states = (output_hidden_states if output_hidden_states is not None
                            else model.config.output_hidden_states)
    use_cache = use_cache if use_cache is not None else (
        model.config.use_cache and not model.training)
    cache, fox_cache = _cache_for_forward(model, past_key_values, use_cache)
    seq_start = None
    if fox_cache is None or len(fox_cache) == 0:
        seq_start = _seq_start(attention_mask, batch, length, device)
    return output_hidden_states, cache, fox_cache, seq_start


class ForgettingTransformerPreTrainedModel(PreTrainedModel):
    config_class = ForgettingTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["ForgettingTransformerBlock"]
    _supports_cache_class = True

    def _init_weights(self, module):
        # The C++ modules initialize themselves (the authors' init) when they are built, and
        # from_pretrained overwrites every tensor; nothing to do per module.
        pass

    def get_parameter(self, target: str) -> torch.Tensor:
        # The C++ modules' tensors are not nn.Parameter attributes (torch's lookup walks
        # attributes); transformers' loader looks tensors up by name (caching_allocator_warmup with
        # an accelerator device_map, among others).
        found = dict(self.named_parameters()).get(target)
        return found if found is not None else super().get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        found = dict(self.named_buffers()).get(target)
        return found if found is not None else super().get_buffer(target)

    def _adopt_children(self, fox_module: torch.nn.Module, names) -> None:
        """Registers the children of an nn (C++) module as our own, so that parameter names are
        the authors' and the tensors are shared (no copy). The nn module is kept unregistered."""
        self.__dict__["_fox"] = fox_module
        for name in names:
            child = fox_module._modules.get(name)
            if child is not None:
                setattr(self, name, child)

    def train(self, mode: bool = True):
        super().train(mode)
        self._fox.train(mode)
        return self

    def __repr__(self) -> str:
        return _describe(self)

    def _run_blocks(self, decoder, inputs_embeds, cache, seq_start, keep_states: bool):
        """The decoder's forward, block by block from Python (for inputs_embeds and
        output_hidden_states); the same C++ blocks the C++ forward runs."""
        if cache is not None and cache.is_static:
            raise ValueError("inputs_embeds / output_hidden_states need a growing cache "
                             "(ForgettingTransformerCache.for_model(model)), not a static one")
        if cache is not None:
            if seq_start is not None and cache.seq_start is None:
                cache.seq_start = seq_start
            elif seq_start is None:
                seq_start = cache.seq_start
        h = inputs_embeds
        states = []
        for i, block in enumerate(decoder._modules["layers"]):
            if keep_states:
                states.append(h)
            h = block(h, cache.layer(i) if cache is not None else None, seq_start)
        h = decoder._modules["norm"](h)
        if keep_states:
            states.append(h)
        return h, (tuple(states) if keep_states else None)


def _check_inputs(input_ids, inputs_embeds):
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids (batch, seqlen) and inputs_embeds "
                         "(batch, seqlen, hidden_size)")
    x = input_ids if input_ids is not None else inputs_embeds
    want = 2 if input_ids is not None else 3
    if x.dim() != want:
        name = "input_ids" if input_ids is not None else "inputs_embeds"
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")
    return x.shape[0], x.shape[1], x.device


class ForgettingTransformerModel(ForgettingTransformerPreTrainedModel):
    """The decoder (embeddings, blocks, final norm): forward returns BaseModelOutputWithPast."""

    def __init__(self, config: ForgettingTransformerConfig, fox_model=None):
        super().__init__(config)
        if fox_model is None:
            fox_model = fox_nn.ForgettingTransformerModel(config.to_fox_config())
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self._adopt_children(fox_model, ("embeddings", "layers", "norm"))
        self.post_init()

    def get_input_embeddings(self) -> _EmbeddingLookup:
        if "_lookup" not in self.__dict__:
            self.__dict__["_lookup"] = _EmbeddingLookup(self.embeddings, self.padding_idx)
        return self._lookup

    def new_cache(self) -> fox_nn.KVCache:
        return fox_nn.KVCache(self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[ForgettingTransformerCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        batch, length, device = _check_inputs(input_ids, inputs_embeds)
        output_hidden_states, cache, fox_cache, seq_start = _forward_setup(
            self, attention_mask, past_key_values, use_cache, output_attentions,
            output_hidden_states, batch, length, device)
        hidden_states = None
        if inputs_embeds is None and not output_hidden_states:
            h = self._fox.forward(input_ids, fox_cache, seq_start)
        else:
            if inputs_embeds is None:
                inputs_embeds = self.get_input_embeddings()(input_ids)
            h, hidden_states = self._run_blocks(self._fox, inputs_embeds, fox_cache, seq_start,
                                                bool(output_hidden_states))
        out = BaseModelOutputWithPast(last_hidden_state=h, past_key_values=cache,
                                      hidden_states=hidden_states)
        return out if return_dict is not False else out.to_tuple()


class ForgettingTransformerForCausalLM(ForgettingTransformerPreTrainedModel, GenerationMixin):
    """The causal LM. ``forward(input_ids, labels=...)`` returns CausalLMOutputWithPast with the
    per-token loss (B, T) (labels[t] is the target of position t: no shift, -100 ignored) and
    ``logits`` None, as the authors; without labels ``logits`` (B, T, vocab)."""

    _tied_weights_keys = None

    def __init__(self, config: ForgettingTransformerConfig, fox_model=None):
        """fox_model: an existing forgetting_transformer.nn.ForgettingTransformerForCausalLM to
        wrap (its tensors are shared, not copied); default: a new one from config."""
        super().__init__(config)
        if fox_model is None:
            fox_model = fox_nn.ForgettingTransformerForCausalLM(config.to_fox_config())
        self.__dict__["_fox"] = fox_model
        self.model = ForgettingTransformerModel(config, fox_model=fox_model._modules["model"])
        if "lm_head" in fox_model._modules:
            self.lm_head = fox_model._modules["lm_head"]
        self.vocab_size = config.vocab_size
        self.post_init()

    @classmethod
    def from_fox(cls, fox_model: fox_nn.ForgettingTransformerForCausalLM,
                 **config_kwargs) -> "ForgettingTransformerForCausalLM":
        """The wrapper of an nn model (shared tensors); config_kwargs set extra config fields."""
        config = ForgettingTransformerConfig.from_fox_config(fox_model.config, **config_kwargs)
        return cls(config, fox_model=fox_model)

    @property
    def fox_model(self) -> fox_nn.ForgettingTransformerForCausalLM:
        """The forgetting_transformer.nn model behind this one (same tensors)."""
        return self._fox

    def get_input_embeddings(self) -> _EmbeddingLookup:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self._modules.get("lm_head")

    def get_decoder(self):
        return self.model

    def new_cache(self) -> fox_nn.KVCache:
        return self._fox.new_cache()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[ForgettingTransformerCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        batch, length, device = _check_inputs(input_ids, inputs_embeds)
        if labels is not None and tuple(labels.shape) != (batch, length):
            raise ValueError(f"labels must be (batch, seqlen) = ({batch}, {length}) like the "
                             f"input, got {tuple(labels.shape)}")
        output_hidden_states, cache, fox_cache, seq_start = _forward_setup(
            self, attention_mask, past_key_values, use_cache, output_attentions,
            output_hidden_states, batch, length, device)

        fox = self._fox
        hidden_states = loss = logits = None
        if inputs_embeds is None and not output_hidden_states and not logits_to_keep:
            # The nn model's forward, as is (one C++ call; the fused loss with labels).
            out = fox.forward(input_ids, labels, fox_cache, seq_start)
            if labels is None:
                logits = out
            else:
                loss = out
        else:
            if inputs_embeds is None and not output_hidden_states:
                h = self.model._fox.forward(input_ids, fox_cache, seq_start)
            else:
                if inputs_embeds is None:
                    inputs_embeds = self.get_input_embeddings()(input_ids)
                h, hidden_states = self._run_blocks(self.model._fox, inputs_embeds, fox_cache,
                                                    seq_start, bool(output_hidden_states))
            if labels is not None:
                loss = fox.loss(h, labels.to(device))  # as forward's: the logits not kept
            else:
                logits = fox.logits(h[:, -logits_to_keep:] if logits_to_keep else h)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache,
                                     hidden_states=hidden_states)
        return out if return_dict is not False else out.to_tuple()

    # ---- generation -----------------------------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                      batch_size, max_cache_length, *args, **kwargs):
        # Our cache instead of transformers' DynamicCache: static (every step the same shapes,
        # attention by per-row lengths) for greedy and sampling, growing where rows are
        # reordered (beam search).
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                *args, **kwargs)
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        # The block-by-block route (embeddings in, hidden states out) appends to a growing cache.
        blockwise = (model_kwargs.get("inputs_embeds") is not None
                     or generation_config.output_hidden_states)
        if (generation_config.num_beams or 1) == 1 and not blockwise:
            fox_cache = self._fox.new_static_cache(batch_size * expand, max_cache_length + 1,
                                                   _autocast_cache_dtype(self))
        else:
            fox_cache = self._fox.new_cache()
        model_kwargs["past_key_values"] = ForgettingTransformerCache(fox_cache)

    def generate(self, inputs: Optional[torch.Tensor] = None,
                 generation_config: Optional[GenerationConfig] = None,
                 logits_processor=None, stopping_criteria=None, prefix_allowed_tokens_fn=None,
                 synced_gpus=None, assistant_model=None, streamer=None, negative_prompt_ids=None,
                 negative_prompt_attention_mask=None, custom_generate=None, **kwargs):
        """transformers' generate. Greedy and plain sampling requests run our C++ generation
        (static cache, CUDA graph on a GPU), stopping criteria and streamers included; the rest
        runs transformers' loop over our cache."""
        plan = None
        if not (logits_processor or prefix_allowed_tokens_fn or synced_gpus
                or assistant_model is not None or negative_prompt_ids is not None
                or negative_prompt_attention_mask is not None or custom_generate is not None):
            plan = self._fast_generation_plan(inputs, generation_config, kwargs)
        if plan is None:
            return super().generate(
                inputs, generation_config, logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, synced_gpus=synced_gpus,
                assistant_model=assistant_model, streamer=streamer,
                negative_prompt_ids=negative_prompt_ids,
                negative_prompt_attention_mask=negative_prompt_attention_mask,
                custom_generate=custom_generate, **kwargs)
        input_ids, options = plan
        if streamer is None and not stopping_criteria:
            return self._fox.generate(input_ids, options)
        return self._generate_stepwise(input_ids, options, streamer, stopping_criteria)

    def _fast_generation_plan(self, inputs, generation_config, kwargs):
        """(input_ids, GenerationOptions) when our generation does exactly what transformers'
        would (up to the random draws of sampling), else None."""
        has_default_max_length = (
            kwargs.get("max_length") is None
            and (generation_config is None or generation_config.max_length is None)
            and self.generation_config.max_length is None)
        gc, model_kwargs = self._prepare_generation_config(generation_config, **dict(kwargs))
        input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
        attention_mask = model_kwargs.pop("attention_mask", None)
        if (model_kwargs or input_ids is None or not isinstance(input_ids, torch.Tensor)
                or input_ids.dim() != 2 or input_ids.shape[1] == 0
                or input_ids.is_floating_point()):
            return None
        defaults = GenerationConfig._get_default_generation_params()
        for key, value in gc.__dict__.items():
            if key.startswith("_") or key in _FAST_GENERATION_FIELDS or value in (None, False):
                continue
            if key not in defaults or value != defaults[key]:
                return None
        if gc.use_cache is False or (gc.num_beams or 1) != 1:
            return None
        if (gc.num_return_sequences or 1) != 1 or (gc.min_length or 0) > 0:
            return None
        length = input_ids.shape[1]
        if gc.max_new_tokens is not None:
            max_new_tokens = gc.max_new_tokens
        elif has_default_max_length:  # transformers: 20 new tokens, within the positions
            max_length = gc.max_length + length
            if getattr(self.config, "max_position_embeddings", None) is not None:
                max_length = min(max_length, self.config.max_position_embeddings)
            max_new_tokens = max_length - length
        else:
            max_new_tokens = gc.max_length - length
        if max_new_tokens <= 0:
            return None  # transformers explains what is wrong
        eos = gc.eos_token_id
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else
                                      [int(e) for e in torch.as_tensor(eos).flatten().tolist()])
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
        seq_start = _seq_start(attention_mask, input_ids.shape[0], length, input_ids.device)
        options = fox_nn.GenerationOptions(
            max_new_tokens=int(max_new_tokens),
            # [-1] (never produced): no stop token, not the C++ config's eos_token_id.
            stop_tokens=eos or [-1],
            pad_token_id=int(pad) if pad is not None else 0,
            seq_start=seq_start,
        )
        if gc.prefill_chunk_size:
            options.prefill_chunk_size = int(gc.prefill_chunk_size)
        if gc.do_sample:
            options.do_sample = True
            options.temperature = float(gc.temperature if gc.temperature is not None else 1.0)
            options.top_k = int(gc.top_k or 0)
            options.top_p = float(gc.top_p if gc.top_p is not None else 1.0)
        return input_ids, options

    def _generate_stepwise(self, input_ids, options, streamer, stopping_criteria):
        """Our generation one step at a time (the same tokens as generate): each step's tokens
        (B,) go to the streamer, and the stopping criteria see the sequences so far, as in
        transformers' loop: a row they stop gets pad tokens from then on if there are stop
        tokens (transformers pads only then), and generation ends once every row has stopped."""
        if streamer is not None:
            streamer.put(input_ids.cpu())
        session = fox_nn.GenerationSession(self._fox.cpp_module, input_ids, options)
        pad_stopped = options.stop_tokens != [-1]
        ids, unfinished = input_ids, None
        for step in range(options.max_new_tokens):
            tokens = (session.step() if step else session.prefill()).to(ids.device, ids.dtype)
            if unfinished is not None and pad_stopped:
                tokens = torch.where(unfinished, tokens, options.pad_token_id)
            ids = torch.cat([ids, tokens[:, None]], 1)
            if streamer is not None:
                streamer.put(tokens.cpu())
            stopped = session.finished.to(ids.device)
            if stopping_criteria:
                done = StoppingCriteriaList(stopping_criteria)(ids, None).to(ids.device)
                unfinished = ~done if unfinished is None else unfinished & ~done
                stopped = stopped | ~unfinished
            if bool(stopped.all()):
                break
        if streamer is not None:
            streamer.end()
        return ids


# Generation settings the fast path implements (the rest must keep transformers' defaults).
_FAST_GENERATION_FIELDS = frozenset({
    "max_length", "max_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "num_beams", "num_return_sequences", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "decoder_start_token_id", "prefill_chunk_size", "transformers_version",
    "compile_config", "disable_compile", "cache_implementation_kwargs", "cache_config",
})


# ---- the attention layer ------------------------------------------------------------------------

class ForgettingAttentionLayer(fox_nn.ForgettingAttentionLayer):
    """The authors' ForgettingAttentionLayer(hidden_size, num_heads, ...): the C++ layer, with
    ``forward(hidden_states, attention_mask=None, past_key_values=None, ...)`` returning
    ``(out, attentions=None, past_key_values)`` as theirs."""

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32,
                 num_kv_heads: Optional[int] = None, window_size: Optional[int] = None,
                 max_position_embeddings: Optional[int] = None, layer_idx: Optional[int] = None,
                 **options):
        if window_size is not None:
            raise ValueError(f"window_size={window_size}: sliding-window attention is not "
                             "supported (expected None)")
        if num_kv_heads is not None:
            options["num_kv_heads"] = num_kv_heads
        super().__init__(hidden_size, num_heads, **options)
        self.__dict__.pop("forward", None)  # the method below, not the bound C++ one
        self.layer_idx = layer_idx

    def __repr__(self) -> str:
        return _describe(self)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[ForgettingTransformerCache] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs):
        if hidden_states.dim() != 3:
            raise ValueError("hidden_states must be (batch, seqlen, hidden_size), got "
                             f"{tuple(hidden_states.shape)}")
        if output_attentions:
            raise ValueError("output_attentions=True is not supported (the attention kernels "
                             "never form the attention matrix)")
        fox_cache = layer_cache = None
        if past_key_values is not None:
            if not isinstance(past_key_values, ForgettingTransformerCache):
                raise TypeError("past_key_values must be a ForgettingTransformerCache, got "
                                f"{type(past_key_values).__name__}")
            if past_key_values.is_static:
                raise ValueError("a single layer needs a growing cache, not a static one")
            if self.layer_idx is None:
                raise ValueError("past_key_values needs the layer's layer_idx (constructor)")
            fox_cache = past_key_values.fox_cache
            layer_cache = fox_cache.layer(self.layer_idx)
        batch, length = hidden_states.shape[:2]
        seq_start = None
        if layer_cache is None or len(layer_cache) == 0:  # the mask counts at the first call
            seq_start = _seq_start(attention_mask, batch, length, hidden_states.device)
        if fox_cache is not None:  # kept for the later calls, as the model does
            if fox_cache.seq_start is None:
                fox_cache.seq_start = seq_start
            seq_start = fox_cache.seq_start
        out = self.cpp_module.forward(hidden_states, layer_cache, seq_start)
        return out, None, past_key_values


# ---- checkpoints of forgetting_transformer.nn (fox train) ---------------------------------------

class FoxTorchConfig(ForgettingTransformerConfig):
    """The same config under the model_type that forgetting_transformer.nn and ``fox train``
    write ("forgetting_transformer"), so that AutoModelForCausalLM loads those checkpoints too."""

    model_type = "forgetting_transformer"

    def __init__(self, **kwargs):  # an own __init__: transformers makes one for classes without
        super().__init__(**kwargs)


class FoxTorchModel(ForgettingTransformerModel):
    config_class = FoxTorchConfig


class FoxTorchForCausalLM(ForgettingTransformerForCausalLM):
    config_class = FoxTorchConfig


# ---- registration -------------------------------------------------------------------------------

AutoConfig.register(ForgettingTransformerConfig.model_type, ForgettingTransformerConfig,
                    exist_ok=True)
AutoModel.register(ForgettingTransformerConfig, ForgettingTransformerModel, exist_ok=True)
AutoModelForCausalLM.register(ForgettingTransformerConfig, ForgettingTransformerForCausalLM,
                              exist_ok=True)
AutoConfig.register(FoxTorchConfig.model_type, FoxTorchConfig, exist_ok=True)
AutoModel.register(FoxTorchConfig, FoxTorchModel, exist_ok=True)
AutoModelForCausalLM.register(FoxTorchConfig, FoxTorchForCausalLM, exist_ok=True)
