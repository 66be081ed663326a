// Catch2's main for every test executable of fox_torch.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
