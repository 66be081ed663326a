// Catch2 v3 or v2 (whichever CMake found: FOX_CATCH2_V3 is defined for v3) behind one include,
// with the few names that differ between them.
#pragma once

#if defined(FOX_CATCH2_V3)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif

#include <string>

namespace fox_test {

#if defined(FOX_CATCH2_V3)
using Catch::Approx;
/// Matches strings (e.g. an exception's message) that contain `s`.
inline auto HasSubstring(const std::string& s) { return Catch::Matchers::ContainsSubstring(s); }
#else
using ::Approx;
inline auto HasSubstring(const std::string& s) { return Catch::Matchers::Contains(s); }
#endif

}  // namespace fox_test
