// The fox::nn modules: layers, blocks, the causal LM, its cache and generation.
#pragma once

#include <fox/nn/attention.h>
#include <fox/nn/cache.h>
#include <fox/nn/checkpoint.h>
#include <fox/nn/config_json.h>
#include <fox/nn/functional.h>
#include <fox/nn/generation.h>
#include <fox/nn/mlp.h>
#include <fox/nn/model.h>
#include <fox/nn/norm.h>
#include <fox/nn/parameters.h>
#include <fox/nn/safetensors.h>
#include <fox/nn/shift_linear.h>
