// Catch2 v2's main for the test executables (with v3 they link Catch2::Catch2WithMain).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
