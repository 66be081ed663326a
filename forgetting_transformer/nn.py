"""The fox::nn C++ modules as torch.nn.Modules.

    from forgetting_transformer.nn import ForgettingTransformerConfig, ForgettingTransformerForCausalLM
    config = ForgettingTransformerConfig(vocab_size=32768, hidden_size=1536, num_hidden_layers=24,
                                         num_heads=24).preset("fox_pro")
    model = ForgettingTransformerForCausalLM(config)
    logits = model(input_ids)                     # (B, T, vocab)
    loss = model(input_ids, labels=labels)        # per-token loss (B, T), as the authors
    cache = model.new_cache(); model(prompt, cache=cache); model(next_ids, cache=cache)
    out = model.generate(prompt, max_new_tokens=20, do_sample=True, top_p=0.9)
    model.save_pretrained("ckpt")                 # ckpt/config.json + ckpt/model.safetensors
    model = ForgettingTransformerForCausalLM.from_pretrained("ckpt")  # also the authors' HF dirs

The parameters are the C++ module's tensors (shared, not copied): optimizers, state_dict(),
load_state_dict(), .to() and train()/eval() act on the C++ model directly. Module and parameter
names are the authors' (e.g. ``model.layers.0.attn.q_proj.weight``).

Every C++ submodule has one Python module object (``model.model.layers[0].attn.q_proj``), so
named_modules(), forward hooks and FSDP2 work on the tree: once a block has forward hooks, the
model's C++ forward runs the blocks through their Python objects (the hooks fire; hooks on other
submodules do not, their callers are C++), and assigning a parameter (``module.weight = p``, as
``fully_shard`` does with its sharded and unsharded tensors) re-points the C++ module to ``p``.

    from torch.distributed.fsdp import fully_shard
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
"""
import os
import weakref
from collections import OrderedDict
from typing import Iterator, Optional, Tuple, Union

import torch
import torch.utils.checkpoint
from torch.nn.modules.module import _IncompatibleKeys

from . import _C

_nn = _C.nn

ForgettingTransformerConfig = _nn.ForgettingTransformerConfig
ForgettingAttentionLayerOptions = _nn.ForgettingAttentionLayerOptions
GenerationOptions = _nn.GenerationOptions
# Generation one step at a time over a static cache (what generate and stream use).
GenerationSession = _nn.GenerationSession
KVCache = _nn.KVCache
LayerCache = _nn.LayerCache
mlp_intermediate_size = _nn.mlp_intermediate_size
sample_next_token = _nn.sample_next_token
config_to_json = _nn.config_to_json
config_from_json = _nn.config_from_json
load_config = _nn.load_config
save_safetensors = _nn.save_safetensors
load_safetensors = _nn.load_safetensors
load_safetensors_metadata = _nn.load_safetensors_metadata

# Methods that torch.nn.cpp.ModuleWrapper copies from the C++ object onto the instance and that we
# replace by nn.Module-compatible versions (returning self, yielding (name, tensor) pairs, ...).
_SHADOWED = ("to", "cuda", "cpu", "float", "double", "half", "train", "eval", "parameters",
             "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
             "children", "named_children", "zero_grad")


class _CppModuleMixin:
    """Makes a torch::python::bind_module wrapper behave like a Python nn.Module."""

    def _fix_wrapper(self):
        for name in _SHADOWED:
            self.__dict__.pop(name, None)
        # The C++ children as Python modules, made once (the C++ tree is fixed after construction)
        # so that children()/named_modules() return the same objects every time: forward hooks
        # and FSDP2's per-module state live on them.
        self.__dict__["_modules"] = OrderedDict(
            (name, _wrap(child)) for name, child in self.cpp_module._modules.items())

    def __setattr__(self, name, value):
        # FSDP2 swaps parameters with setattr (sharded DTensor <-> unsharded tensor): the C++
        # module must hold, and its forward read, exactly that tensor.
        if isinstance(value, torch.Tensor) and name in self.__dict__.get("_parameters", ()):
            _nn.replace_parameter(self.cpp_module, name, value)
        elif isinstance(value, torch.Tensor) and name in self.__dict__.get("_buffers", ()):
            # A loader that sets every tensor (transformers' from_pretrained): the buffer takes
            # the new data in place, so the C++ module keeps reading it.
            with torch.no_grad():
                self._buffers[name].data = value.detach()
        else:
            super().__setattr__(name, value)

    def register_parameter(self, name: str, param: Optional[torch.nn.Parameter]) -> None:
        if param is None or name not in self._parameters:
            raise KeyError(f"{type(self).__name__}: a C++ module's parameters are fixed; only "
                           f"existing ones ({', '.join(self._parameters.keys())}) can be replaced")
        _nn.replace_parameter(self.cpp_module, name, param)

    def train(self, mode: bool = True):
        self.cpp_module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # nn.Module's walks parameters(), a conversion of the whole C++ tree to Python (~1 ms of
        # host time at 12 layers, before a step's first kernel); the C++ tree releases its own.
        if set_to_none:
            _nn.release_gradients(self.cpp_module)
        else:
            super().zero_grad(set_to_none=False)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        pre = prefix + "." if prefix else ""
        for name, p in self.cpp_module.named_parameters(recurse).items():
            yield pre + name, p

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        pre = prefix + "." if prefix else ""
        for name, b in self.cpp_module.named_buffers(recurse).items():
            yield pre + name, b

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = OrderedDict() if destination is None else destination
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            out[prefix + name] = t if keep_vars else t.detach()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: "
                               f"missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for k, v in state_dict.items():
                if k in own:
                    if own[k].shape != v.shape:
                        raise RuntimeError(f"size mismatch for {k}: checkpoint {tuple(v.shape)}, "
                                           f"model {tuple(own[k].shape)}")
                    own[k].copy_(_like(v, own[k]))
        return _IncompatibleKeys(missing, unexpected)


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """value as target's shard when target is a DTensor (FSDP2) and value a full tensor."""
    if not _is_dtensor(target) or _is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                             src_data_rank=None)  # every rank has the full value: no messages


class _CppModule(_CppModuleMixin, torch.nn.cpp.ModuleWrapper):
    """A C++ submodule without Python bindings of its own (torch::nn Linear, Embedding, ...)."""


class _CppModuleList(_CppModule):
    """torch::nn::ModuleList: indexable and iterable like nn.ModuleList."""

    def __getitem__(self, index: int) -> torch.nn.Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


def _wrap(cpp_module) -> torch.nn.Module:
    """The Python module over an existing C++ module (no new C++ module is made)."""
    cls = _WRAPPERS.get(type(cpp_module))
    if cls is None:
        cls = _CppModuleList if str(cpp_module) == "torch::nn::ModuleListImpl" else _CppModule
    module = cls.__new__(cls)
    torch.nn.cpp.ModuleWrapper.__init__(module, cpp_module)
    module._fix_wrapper()
    return module


class RMSNorm(_CppModuleMixin, _nn.RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__(hidden_size, eps, elementwise_affine)
        self._fix_wrapper()


class GroupRMSNorm(_CppModuleMixin, _nn.GroupRMSNorm):
    def __init__(self, num_groups: int, hidden_size: int, eps: float = 1e-5,
                 elementwise_affine: bool = True):
        super().__init__(num_groups, hidden_size, eps, elementwise_affine)
        self._fix_wrapper()


class ShiftLinear(_CppModuleMixin, _nn.ShiftLinear):
    """KV-shift projection: parameters ``linear.weight`` and ``shift_proj.weight``."""

    def __init__(self, input_dim: int, output_dim: int, num_heads: int, bias: bool = False,
                 shift_bias: bool = False):
        super().__init__(input_dim, output_dim, num_heads, bias, shift_bias)
        self._fix_wrapper()


class GatedMLP(_CppModuleMixin, _nn.GatedMLP):
    def __init__(self, hidden_size: int, hidden_ratio: float = 4.0,
                 intermediate_size: Optional[int] = None, hidden_act: str = "swish"):
        super().__init__(hidden_size, hidden_ratio, intermediate_size, hidden_act)
        self._fix_wrapper()


class ForgettingAttentionLayer(_CppModuleMixin, _nn.ForgettingAttentionLayer):
    """ForgettingAttentionLayer(hidden_size, num_heads, **options) with the authors' keyword names
    (use_output_gate, qk_norm, use_k_shift, fgate_type, log_pruning_tolerance, ...)."""

    def __init__(self, hidden_size: int, num_heads: int, **options):
        super().__init__(ForgettingAttentionLayerOptions(hidden_size, num_heads, **options))
        self._fix_wrapper()


def _config(config, kwargs):
    if config is None:
        return ForgettingTransformerConfig(**kwargs)
    if kwargs:
        raise TypeError("pass either a config or keyword arguments, not both")
    return config


class ForgettingTransformerBlock(_CppModuleMixin, _nn.ForgettingTransformerBlock):
    def __init__(self, config: Optional[ForgettingTransformerConfig] = None, **kwargs):
        super().__init__(_config(config, kwargs))
        self._fix_wrapper()

    # A block of a decoder tells it when it gets forward hooks (FSDP2 adds them in fully_shard):
    # from then on the C++ forward calls the blocks through Python, so that the hooks run.
    def register_forward_pre_hook(self, *args, **kwargs):
        handle = super().register_forward_pre_hook(*args, **kwargs)
        self._hooked()
        return handle

    def register_forward_hook(self, *args, **kwargs):
        handle = super().register_forward_hook(*args, **kwargs)
        self._hooked()
        return handle

    def _hooked(self):
        decoder = self.__dict__.get("_decoder", lambda: None)()
        if decoder is not None:
            decoder._run_blocks_in_python()


class ForgettingTransformerModel(_CppModuleMixin, _nn.ForgettingTransformerModel):
    def __init__(self, config: Optional[ForgettingTransformerConfig] = None, **kwargs):
        super().__init__(_config(config, kwargs))
        self._fix_wrapper()

    def _fix_wrapper(self):
        super()._fix_wrapper()
        for block in self._modules["layers"]:
            block.__dict__["_decoder"] = weakref.ref(self)
        if any(b._forward_hooks or b._forward_pre_hooks for b in self._modules["layers"]):
            self._run_blocks_in_python()

    def set_activation_checkpointing(self, enabled: bool = True):
        """Per-block activation checkpointing: in training (no cache, gradients on) a block keeps
        only its input and recomputes the rest of its activations in the backward pass
        (non-reentrant torch.utils.checkpoint; FSDP2's hooks run in the recompute too). Costs
        one more forward of every block; the blocks then run through Python (~20 us a block)."""
        self.__dict__["_checkpoint_blocks"] = bool(enabled)
        if enabled:
            self._run_blocks_in_python()

    def _run_blocks_in_python(self):
        """Makes the C++ forward call every block through its Python module, so that the block's
        hooks run (FSDP2 unshards a block's parameters in a forward pre-hook) and activation
        checkpointing can wrap it. Only once needed: each call costs a trip through Python
        (~20 us). Weak references: the C++ model holds the runner, which must not keep the
        Python tree alive."""
        if self.__dict__.get("_blocks_in_python"):
            return
        blocks = [weakref.ref(b) for b in self._modules["layers"]]
        decoder = weakref.ref(self)  # its flag is read at every call

        def run(i, h, cache, seq_start):
            block = blocks[i]()
            checkpointing = decoder().__dict__.get("_checkpoint_blocks", False)
            if checkpointing and cache is None and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(block, h, cache, seq_start,
                                                         use_reentrant=False)
            return block(h, cache, seq_start)

        _nn.set_block_runner(self.cpp_module, run)
        weakref.finalize(self, _nn.set_block_runner, self.cpp_module, None)
        self.__dict__["_blocks_in_python"] = True


def _generation_options(options: Optional[GenerationOptions], kwargs) -> GenerationOptions:
    if options is None:
        return GenerationOptions(**kwargs)
    if kwargs:
        raise TypeError("pass either options or keyword arguments, not both")
    return options


class ForgettingTransformerForCausalLM(_CppModuleMixin, _nn.ForgettingTransformerForCausalLM):
    """The causal LM. forward(input_ids, labels=None, cache=None, seq_start=None, reduction="none")
    returns logits (B, T, vocab), or the per-token loss (B, T) when labels are given (no shift,
    ignore -100); with reduction "sum" or "mean" (over the tokens not ignored) a scalar, whose
    gradients are made with the forward (no logits made again in the backward)."""

    def __init__(self, config: Optional[ForgettingTransformerConfig] = None, **kwargs):
        super().__init__(_config(config, kwargs))
        self._fix_wrapper()
        self._cpp_generate = self.__dict__.pop("generate")

    def set_activation_checkpointing(self, enabled: bool = True):
        """Per-block activation checkpointing of the decoder (ForgettingTransformerModel's)."""
        self._modules["model"].set_activation_checkpointing(enabled)

    def generate(self, input_ids: torch.Tensor, options: Optional[GenerationOptions] = None,
                 **kwargs) -> torch.Tensor:
        """Greedy or sampled continuation (B, T + n); kwargs are GenerationOptions fields
        (max_new_tokens, do_sample, temperature, top_k, top_p, stop_tokens, pad_token_id,
        seq_start, prefill_chunk_size, prompt_lengths, static_cache, cuda_graph, max_length).
        On a GPU the decoding step runs as a replayed CUDA graph over a static cache."""
        return self._cpp_generate(input_ids, _generation_options(options, kwargs))

    def stream(self, input_ids: torch.Tensor, options: Optional[GenerationOptions] = None,
               **kwargs) -> Iterator[torch.Tensor]:
        """Yields the new tokens (B,) of each step as they come (same options and tokens as
        generate); ends after max_new_tokens or once every row has stopped."""
        options = _generation_options(options, kwargs)
        if options.max_new_tokens == 0:
            return
        session = _nn.GenerationSession(self.cpp_module, input_ids, options)
        yield session.prefill()
        for _ in range(options.max_new_tokens - 1):
            if bool(session.finished.all()):
                return
            yield session.step()

    # ---- Hugging Face-format checkpoints (config.json + model.safetensors) ----------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_path: Union[str, os.PathLike], *,
                        device: Optional[Union[str, torch.device]] = None,
                        dtype: Optional[torch.dtype] = None, strict: bool = False,
                        **config_overrides) -> "ForgettingTransformerForCausalLM":
        """A model from a checkpoint directory: config.json (the authors' config; unknown keys
        are ignored) and model.safetensors (or a sharded model.safetensors.index.json).
        Parameters are float32 on the CPU unless dtype/device are given, whatever the stored
        dtype. config_overrides set config fields after reading (e.g. log_pruning_tolerance).
        strict: tensors the model does not have are an error (else a warning)."""
        config = load_config(os.fspath(pretrained_model_path))
        for k, v in config_overrides.items():
            setattr(config, k, v)
        model = cls(config)
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        _nn.load_pretrained_weights(model.cpp_module, os.fspath(pretrained_model_path), strict)
        return model

    def save_pretrained(self, save_directory: Union[str, os.PathLike]) -> None:
        """Writes save_directory/config.json and save_directory/model.safetensors (every
        parameter and buffer in its current dtype), loadable by from_pretrained and
        fox::nn::load_pretrained. Under FSDP2 (sharded parameters) every rank must call it: the
        full tensors are gathered and rank 0 writes them."""
        state = self.state_dict()
        if not any(_is_dtensor(t) for t in state.values()):
            _nn.save_pretrained(self.cpp_module, os.fspath(save_directory))
            return
        state = {k: t.full_tensor() if _is_dtensor(t) else t for k, t in state.items()}
        if torch.distributed.get_rank() == 0:
            full = ForgettingTransformerForCausalLM(self.config)
            full.to(dtype=state["model.embeddings.weight"].dtype)
            full.load_state_dict(state)
            _nn.save_pretrained(full.cpp_module, os.fspath(save_directory))


# The fused functions the modules are built from (rms_norm, shift_mix, gated, cross_entropy),
# differentiable; one fused kernel each way on CUDA, the plain formulas elsewhere.
functional = _nn.functional

# The Python class of each bound C++ module type, to wrap existing C++ children.
_WRAPPERS = {getattr(_nn.cpp, c.__name__): c
             for c in (RMSNorm, GroupRMSNorm, ShiftLinear, GatedMLP, ForgettingAttentionLayer,
                       ForgettingTransformerBlock, ForgettingTransformerModel,
                       ForgettingTransformerForCausalLM)}

__all__ = [
    "ForgettingTransformerConfig", "ForgettingAttentionLayerOptions", "GenerationOptions",
    "GenerationSession",
    "KVCache", "LayerCache", "RMSNorm", "GroupRMSNorm", "ShiftLinear", "GatedMLP",
    "ForgettingAttentionLayer", "ForgettingTransformerBlock", "ForgettingTransformerModel",
    "ForgettingTransformerForCausalLM", "mlp_intermediate_size", "sample_next_token",
    "config_to_json", "config_from_json", "load_config", "save_safetensors", "load_safetensors",
    "load_safetensors_metadata", "functional",
]
