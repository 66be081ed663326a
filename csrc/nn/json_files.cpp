#include "json_files.h"

#include <filesystem>
#include <cstdio>
#include <set>
#include <sstream>
#include <system_error>
#include <unistd.h>

#include <c10/util/Exception.h>

namespace fs = std::filesystem;

namespace fox::nn::detail {

namespace {

// Thrown from the parser callback to stop at the first violation; turned into a c10::Error.
struct JsonLimit {
  std::string message;
};

// nlohmann's messages quote the input around an error, which may be any bytes: escaped, so the
// message stays valid UTF-8 (Python turns it into a str).
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace

nlohmann::json parse_json(const std::string& text, const std::string& what,
                          bool unique_top_level_keys) {
  std::set<std::string> top_keys;
  auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if ((event == E::object_start || event == E::array_start) && depth >= kMaxJsonDepth) {
      throw JsonLimit{"nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels"};
    }
    // keys of the top-level object are reported at depth 1
    if (unique_top_level_keys && event == E::key && depth == 1 &&
        !top_keys.insert(parsed.get<std::string>()).second) {
      throw JsonLimit{"duplicate entry '" + printable(parsed.get<std::string>()) + "'"};
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text, check);
  } catch (const JsonLimit& e) {
    TORCH_CHECK(false, what, ": invalid JSON: ", e.message);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, what, ": invalid JSON: ", printable(e.what()));
  }
}

std::string brief_json(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string read_file(const std::string& path, const char* who) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), who, ": cannot open '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  TORCH_CHECK(!f.bad(), who, ": error reading '", path, "'");
  return ss.str();
}

void write_file_atomic(const std::string& path, const char* who,
                       const std::function<void(std::ofstream&)>& write) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(f.good(), who, ": cannot create '", tmp, "'");
    write(f);
    f.flush();
    if (!f.good()) {
      f.close();
      std::error_code ec;
      fs::remove(tmp, ec);
      TORCH_CHECK(false, who, ": error writing '", path, "'");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    TORCH_CHECK(false, who, ": cannot rename into '", path, "'");
  }
}

}  // namespace fox::nn::detail
