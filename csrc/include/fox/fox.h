// Umbrella header of fox_torch: the Forgetting Attention op and (later) the fox::nn modules.
#pragma once

#include <fox/ops.h>
