// The helpers the checkpoint code shares (private to libfox_torch): JSON text through
// nlohmann-json with the limits untrusted files need, and whole-file reads and atomic writes.
// Every error is a c10::Error naming the file or document.
#pragma once

#include <functional>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace fox::nn::detail {

/// Containers nested deeper than this are an error: a corrupt header of brackets must fail fast
/// instead of building (and later recursing through) a huge tree.
constexpr int kMaxJsonDepth = 256;

/// Parses one JSON document (RFC 8259; whitespace around it allowed). Errors read
/// "<what>: invalid JSON: ...". With `unique_top_level_keys`, a key repeated in the top-level
/// object is an error (elsewhere the last occurrence wins, as in Python).
nlohmann::json parse_json(const std::string& text, const std::string& what,
                          bool unique_top_level_keys = false);

/// A value for an error message: its compact JSON text, cut to about 60 characters.
std::string brief_json(const nlohmann::json& v);

/// The whole content of `path`; `who` prefixes the errors (cannot open, read error).
std::string read_file(const std::string& path, const char* who);

/// Writes `path` through a temporary file in the same directory renamed into place, so readers
/// never see a half-written file. `write` fills the stream.
void write_file_atomic(const std::string& path, const char* who,
                       const std::function<void(std::ofstream&)>& write);

}  // namespace fox::nn::detail
