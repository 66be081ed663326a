// Umbrella header of fox_torch: the Forgetting Attention op and the fox::nn modules.
#pragma once

#include <fox/ops.h>
#include <fox/nn.h>
