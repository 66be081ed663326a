// pybind11 module forgetting_transformer._C. Importing it loads libfox_torch, which registers
// the torch.ops.fox.* operators.
#include <torch/extension.h>

#include <fox/fox.h>

void init_nn_bindings(pybind11::module_& m);  // nn_bindings.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "fox_torch: Forgetting Transformer ops (C++/CUDA)";
  m.def("built_with_cuda", &fox::built_with_cuda,
        "True when the library was compiled with its CUDA kernels");
  init_nn_bindings(m);
}
