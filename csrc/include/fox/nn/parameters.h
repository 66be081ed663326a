// A module's parameters from outside its forward: their gradients released, and one swapped for
// another tensor.
//
// Swapping a module's parameter for another tensor, as FSDP2 (torch.distributed.fsdp.fully_shard)
// does: it replaces every parameter by a sharded DTensor, and around forward/backward by the
// unsharded (all-gathered) tensor. A torch::nn module keeps each parameter twice, in its
// registered parameters (what named_parameters() returns) and in the member its forward reads
// (e.g. LinearImpl::weight); both must be re-pointed so that forward uses, and autograd
// accumulates into, exactly the new tensor.
#pragma once

#include <string>

#include <torch/nn/module.h>
#include <torch/types.h>

namespace fox::nn {

/// Replaces the registered parameter `name` (no dots: a direct parameter) of `module` by `value`
/// and re-points the member that the module's forward reads. `value` must have the parameter's
/// shape; it is stored as is (no copy, requires_grad untouched). Supported: the fox::nn modules
/// and the torch::nn Linear and Embedding they contain; other modules throw.
void replace_parameter(torch::nn::Module& module, const std::string& name,
                       const torch::Tensor& value);

/// Sets the gradient of every parameter of `module` and its descendants to undefined, as
/// nn.Module.zero_grad(set_to_none=True) does. torch::nn::Module::zero_grad detaches each
/// gradient first (a dispatcher call and a tensor made per parameter): this host time comes
/// before a training step's first kernel, while the GPU waits.
void release_gradients(torch::nn::Module& module);

}  // namespace fox::nn
