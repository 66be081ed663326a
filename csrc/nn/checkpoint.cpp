#include <fox/nn/checkpoint.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <system_error>
#include <unistd.h>

#include <c10/util/Exception.h>

namespace fs = std::filesystem;

namespace fox::nn {

// =================================================================================================
// JSON
// =================================================================================================
namespace json {

Value Value::from_bool(bool b) {
  Value v;
  v.type = Type::Bool;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.type = Type::Number;
  v.number = static_cast<double>(i);
  v.is_integer = true;
  v.integer = i;
  return v;
}
Value Value::from_double(double d) {
  Value v;
  v.type = Type::Number;
  v.number = d;
  return v;
}
Value Value::from_string(std::string s) {
  Value v;
  v.type = Type::String;
  v.string = std::move(s);
  return v;
}
Value Value::new_array() {
  Value v;
  v.type = Type::Array;
  return v;
}
Value Value::new_object() {
  Value v;
  v.type = Type::Object;
  return v;
}

const Value* Value::find(const std::string& key) const {
  if (type != Type::Object) return nullptr;
  for (auto it = object.rbegin(); it != object.rend(); ++it) {
    if (it->first == key) return &it->second;
  }
  return nullptr;
}

Value& Value::set(const std::string& key, Value v) {
  TORCH_CHECK(type == Type::Object, "json::Value::set on a non-object");
  object.emplace_back(key, std::move(v));
  return object.back().second;
}

namespace {

constexpr int kMaxDepth = 256;

struct Parser {
  const std::string& s;
  const std::string& what;
  size_t i = 0;

  [[noreturn]] void fail(const std::string& msg) const {
    TORCH_CHECK(false, what, ": invalid JSON at offset ", i, ": ", msg);
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  }
  bool consume(const char* lit) {
    size_t n = std::strlen(lit);
    if (s.compare(i, n, lit) == 0) {
      i += n;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (i >= s.size() || s[i] != c) fail(std::string("expected '") + c + "'");
    ++i;
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 256 levels");
    ws();
    if (i >= s.size()) fail("unexpected end of input");
    char c = s[i];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Value::from_string(string());
    if (consume("true")) return Value::from_bool(true);
    if (consume("false")) return Value::from_bool(false);
    if (consume("null")) return Value::null();
    if (consume("NaN")) return Value::from_double(std::numeric_limits<double>::quiet_NaN());
    if (consume("Infinity")) return Value::from_double(std::numeric_limits<double>::infinity());
    if (consume("-Infinity")) return Value::from_double(-std::numeric_limits<double>::infinity());
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail(std::string("unexpected character '") + c + "'");
  }

  Value object(int depth) {
    expect('{');
    Value v = Value::new_object();
    ws();
    if (i < s.size() && s[i] == '}') {
      ++i;
      return v;
    }
    while (true) {
      ws();
      if (i >= s.size() || s[i] != '"') fail("expected a string key");
      std::string key = string();
      ws();
      expect(':');
      Value item = value(depth + 1);
      v.object.emplace_back(std::move(key), std::move(item));
      ws();
      if (i < s.size() && s[i] == ',') {
        ++i;
        continue;
      }
      expect('}');
      return v;
    }
  }

  Value array(int depth) {
    expect('[');
    Value v = Value::new_array();
    ws();
    if (i < s.size() && s[i] == ']') {
      ++i;
      return v;
    }
    while (true) {
      v.array.push_back(value(depth + 1));
      ws();
      if (i < s.size() && s[i] == ',') {
        ++i;
        continue;
      }
      expect(']');
      return v;
    }
  }

  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t hex4() {
    if (i + 4 > s.size()) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s[i++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else fail("bad hex digit in \\u escape");
    }
    return cp;
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i >= s.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s[i]);
      if (c == '"') {
        ++i;
        return out;
      }
      if (c < 0x20) fail("control character in string");
      if (c != '\\') {
        out += static_cast<char>(c);
        ++i;
        continue;
      }
      ++i;
      if (i >= s.size()) fail("unterminated escape");
      char e = s[i++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a low one must follow
            if (i + 6 <= s.size() && s[i] == '\\' && s[i + 1] == 'u') {
              i += 2;
              uint32_t lo = hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) fail("invalid surrogate pair");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else {
              fail("lone high surrogate");
            }
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("lone low surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default: fail(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  Value number() {
    size_t start = i;
    bool integral = true;
    if (s[i] == '-') ++i;
    if (i >= s.size()) fail("bad number");
    if (s[i] == '0') {
      ++i;
    } else if (s[i] >= '1' && s[i] <= '9') {
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    } else {
      fail("bad number");
    }
    if (i < s.size() && s[i] == '.') {
      integral = false;
      ++i;
      if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) fail("bad fraction");
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    }
    if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
      integral = false;
      ++i;
      if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
      if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) fail("bad exponent");
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    }
    const char* b = s.data() + start;
    const char* e = s.data() + i;
    Value v;
    v.type = Value::Type::Number;
    auto r = std::from_chars(b, e, v.number);
    if (r.ec == std::errc::result_out_of_range) {
      // as Python: overflow gives +-inf, underflow +-0. The decimal order of magnitude of
      // the text decides which: digits before the first significant one, plus the exponent.
      const std::string t(b, e);
      const size_t epos = t.find_first_of("eE");
      const std::string mant = t.substr(0, epos);
      long long exp10 = 0;
      if (epos != std::string::npos) {
        auto ex = std::from_chars(t.data() + epos + 1 + (t[epos + 1] == '+'), t.data() + t.size(),
                                  exp10);
        if (ex.ec != std::errc()) exp10 = t[epos + 1] == '-' ? -(1LL << 40) : (1LL << 40);
      }
      const size_t dot = std::min(mant.find('.'), mant.size());
      const size_t first = mant.find_first_of("123456789");
      long long order = first < dot ? static_cast<long long>(dot - first)
                                    : -static_cast<long long>(first - dot - 1);
      const bool neg = t[0] == '-';
      const double big = std::numeric_limits<double>::infinity();
      v.number = order + exp10 > 0 ? (neg ? -big : big) : (neg ? -0.0 : 0.0);
    } else if (r.ec != std::errc() || r.ptr != e) {
      fail("bad number");
    }
    if (integral) {
      int64_t iv = 0;
      auto ri = std::from_chars(b, e, iv);
      if (ri.ec == std::errc() && ri.ptr == e) {
        v.is_integer = true;
        v.integer = iv;
      }
    }
    return v;
  }
};

void dump_string(std::string& out, const std::string& str) {
  out += '"';
  for (unsigned char c : str) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void dump_number(std::string& out, const Value& v) {
  if (v.is_integer) {
    out += std::to_string(v.integer);
    return;
  }
  double d = v.number;
  if (std::isnan(d)) {
    out += "NaN";
    return;
  }
  if (std::isinf(d)) {
    out += d > 0 ? "Infinity" : "-Infinity";
    return;
  }
  // Python's repr: the shortest digits that read back exactly, fixed notation for decimal
  // exponents in [-4, 16), else scientific with a signed, at least 2-digit exponent.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string t(buf, r.ptr);  // e.g. "-1.5e-06", "5e+05"
  if (t[0] == '-') {
    out += '-';
    t.erase(0, 1);
  }
  const size_t epos = t.find('e');
  const std::string mant = t.substr(0, epos);
  const int exp = std::stoi(t.substr(epos + 1));
  if (exp < -4 || exp >= 16) {
    out += t;
    return;
  }
  std::string digits = mant;
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  if (exp < 0) {
    out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else if (digits.size() <= static_cast<size_t>(exp) + 1) {
    out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
  }
}

void dump_rec(std::string& out, const Value& v, int indent, int level) {
  auto newline = [&](int lvl) {
    if (indent > 0) {
      out += '\n';
      out.append(static_cast<size_t>(indent * lvl), ' ');
    }
  };
  switch (v.type) {
    case Value::Type::Null: out += "null"; break;
    case Value::Type::Bool: out += v.boolean ? "true" : "false"; break;
    case Value::Type::Number: dump_number(out, v); break;
    case Value::Type::String: dump_string(out, v.string); break;
    case Value::Type::Array:
      out += '[';
      for (size_t k = 0; k < v.array.size(); ++k) {
        if (k) out += ",";
        newline(level + 1);
        dump_rec(out, v.array[k], indent, level + 1);
      }
      if (!v.array.empty()) newline(level);
      out += ']';
      break;
    case Value::Type::Object:
      out += '{';
      for (size_t k = 0; k < v.object.size(); ++k) {
        if (k) out += ",";
        newline(level + 1);
        dump_string(out, v.object[k].first);
        out += indent > 0 ? ": " : ":";
        dump_rec(out, v.object[k].second, indent, level + 1);
      }
      if (!v.object.empty()) newline(level);
      out += '}';
      break;
  }
}

}  // namespace

Value parse(const std::string& text, const std::string& what) {
  Parser p{text, what};
  Value v = p.value(0);
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters after the JSON value");
  return v;
}

std::string dump(const Value& v, int indent) {
  std::string out;
  dump_rec(out, v, indent, 0);
  return out;
}

}  // namespace json

// =================================================================================================
// files
// =================================================================================================
namespace {

std::string read_text_file(const std::string& path, const char* who) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), who, ": cannot open '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  TORCH_CHECK(!f.bad(), who, ": error reading '", path, "'");
  return ss.str();
}

// Writes `path` atomically: a temporary file in the same directory, renamed into place.
template <typename Fn>
void write_file_atomic(const std::string& path, const char* who, Fn&& write) {
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

void check_little_endian() {
  TORCH_CHECK(std::endian::native == std::endian::little,
              "safetensors: only little-endian hosts are supported");
}

}  // namespace

// =================================================================================================
// config
// =================================================================================================

// Every ForgettingTransformerConfig field, in declaration order.
#define FOX_CONFIG_FIELDS(X)                                                                     \
  X(vocab_size) X(hidden_size) X(hidden_ratio) X(intermediate_size) X(num_hidden_layers)         \
  X(num_heads) X(num_kv_heads) X(hidden_act) X(initializer_range) X(norm_eps) X(pad_token_id)    \
  X(bos_token_id) X(eos_token_id) X(tie_word_embeddings) X(rope_base) X(use_rope)                \
  X(use_output_gate) X(ogate_act) X(fgate_type) X(fgate_bias_init) X(decay_time_min)             \
  X(decay_time_max) X(use_output_norm) X(qk_norm) X(qk_norm_share_param_across_head)             \
  X(log_pruning_tolerance) X(use_k_shift) X(use_v_shift)

namespace {

json::Value to_value(int64_t v) { return json::Value::from_int(v); }
json::Value to_value(double v) { return json::Value::from_double(v); }
json::Value to_value(bool v) { return json::Value::from_bool(v); }
json::Value to_value(const std::string& v) { return json::Value::from_string(v); }
template <typename T>
json::Value to_value(const std::optional<T>& v) {
  return v ? to_value(*v) : json::Value::null();
}

const char* type_name(const json::Value& v) {
  switch (v.type) {
    case json::Value::Type::Null: return "null";
    case json::Value::Type::Bool: return "a boolean";
    case json::Value::Type::Number: return "a number";
    case json::Value::Type::String: return "a string";
    case json::Value::Type::Array: return "an array";
    case json::Value::Type::Object: return "an object";
  }
  return "?";
}

// from_value(v, out, key, what): false when v is null (keep the default).
bool from_value(const json::Value& v, int64_t& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  if (v.is_number() && v.is_integer) {
    out = v.integer;
    return true;
  }
  TORCH_CHECK(v.is_number() && std::isfinite(v.number) && std::floor(v.number) == v.number &&
                  std::abs(v.number) < 9.2e18,
              what, ": '", key, "' must be an integer, got ",
              v.is_number() ? json::dump(v) : type_name(v));
  out = static_cast<int64_t>(v.number);
  return true;
}
bool from_value(const json::Value& v, double& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_number(), what, ": '", key, "' must be a number, got ", type_name(v));
  out = v.number;
  return true;
}
bool from_value(const json::Value& v, bool& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_bool(), what, ": '", key, "' must be true or false, got ", type_name(v));
  out = v.boolean;
  return true;
}
bool from_value(const json::Value& v, std::string& out, const char* key, const std::string& what) {
  if (v.is_null()) return false;
  TORCH_CHECK(v.is_string(), what, ": '", key, "' must be a string, got ", type_name(v));
  out = v.string;
  return true;
}
template <typename T>
bool from_value(const json::Value& v, std::optional<T>& out, const char* key,
                const std::string& what) {
  if (v.is_null()) {
    out = std::nullopt;
    return true;
  }
  const json::Value* item = &v;
  // transformers allows a list of token ids (e.g. several eos tokens): the first one is used
  if (v.is_array() && !v.array.empty() && std::is_same_v<T, int64_t>) item = &v.array.front();
  T x{};
  from_value(*item, x, key, what);
  out = x;
  return true;
}

const char* torch_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kFloat64: return "float64";
    case torch::kFloat16: return "float16";
    case torch::kBFloat16: return "bfloat16";
    default: return nullptr;
  }
}

}  // namespace

json::Value config_to_json_value(const ForgettingTransformerConfig& c) {
  // keys sorted, as transformers' config.to_json_string(sort_keys=True)
  std::map<std::string, json::Value> fields;
#define FOX_PUT(name) fields[#name] = to_value(c.name());
  FOX_CONFIG_FIELDS(FOX_PUT)
#undef FOX_PUT
  auto arch = json::Value::new_array();
  arch.array.push_back(json::Value::from_string("ForgettingTransformerForCausalLM"));
  fields["architectures"] = std::move(arch);
  fields["model_type"] = json::Value::from_string("forgetting_transformer");
  auto v = json::Value::new_object();
  for (auto& kv : fields) v.set(kv.first, std::move(kv.second));
  return v;
}

std::string config_to_json(const ForgettingTransformerConfig& config) {
  return json::dump(config_to_json_value(config), 2) + "\n";
}

ForgettingTransformerConfig config_from_json_value(const json::Value& v, const std::string& what) {
  TORCH_CHECK(v.is_object(), what, ": the config must be a JSON object, got ", type_name(v));
  if (const auto* mt = v.find("model_type"); mt && !mt->is_null()) {
    TORCH_CHECK(mt->is_string() && mt->string.find("forgetting_transformer") != std::string::npos,
                what, ": model_type ", json::dump(*mt),
                " is not a forgetting_transformer model");
  }
  // the authors' options that this implementation does not have
  if (const auto* w = v.find("window_size"); w && !w->is_null()) {
    TORCH_CHECK(false, what, ": window_size ", json::dump(*w),
                " (sliding-window attention) is not supported");
  }
  if (const auto* e = v.find("elementwise_affine"); e && e->is_bool() && !e->boolean) {
    TORCH_CHECK(false, what, ": elementwise_affine false (norms without weights) is not supported");
  }
  if (const auto* b = v.find("attention_bias"); b && b->is_bool() && b->boolean) {
    TORCH_CHECK(false, what, ": attention_bias true (biased q/k/v/o projections) is not supported");
  }
  ForgettingTransformerConfig c;
#define FOX_GET(name)                                                     \
  if (const auto* item = v.find(#name)) {                                 \
    auto value = c.name();                                                \
    if (from_value(*item, value, #name, what)) c.name(std::move(value));  \
  }
  FOX_CONFIG_FIELDS(FOX_GET)
#undef FOX_GET
  return c;
}

ForgettingTransformerConfig config_from_json(const std::string& text, const std::string& what) {
  return config_from_json_value(json::parse(text, what), what);
}

ForgettingTransformerConfig load_config(const std::string& path) {
  std::error_code ec;
  std::string file =
      fs::is_regular_file(path, ec) ? path : (fs::path(path) / "config.json").string();
  return config_from_json(read_text_file(file, "load_config"), file);
}

// =================================================================================================
// safetensors
// =================================================================================================
namespace {

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};
// In the order of the safetensors package's Dtype enum: its writer puts the data of the later
// dtypes first (descending), then orders by name.
constexpr DtypeName kDtypes[] = {
    {"BOOL", torch::kBool},   {"U8", torch::kUInt8},       {"I8", torch::kInt8},
    {"F8_E5M2", torch::kFloat8_e5m2}, {"F8_E4M3", torch::kFloat8_e4m3fn},
    {"I16", torch::kInt16},   {"F16", torch::kFloat16},    {"BF16", torch::kBFloat16},
    {"I32", torch::kInt32},   {"F32", torch::kFloat32},    {"F64", torch::kFloat64},
    {"I64", torch::kInt64},
};
int dtype_rank(torch::ScalarType t) {
  for (size_t k = 0; k < std::size(kDtypes); ++k) {
    if (kDtypes[k].type == t) return static_cast<int>(k);
  }
  return -1;
}

constexpr uint64_t kMaxHeader = 100'000'000;  // as the safetensors package

bool mul_overflow(uint64_t a, uint64_t b, uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.type == dtype) return d.name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype, " has no safetensors name");
}

torch::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  TORCH_CHECK(false, "safetensors: unsupported dtype '", name, "'");
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  check_little_endian();
  struct Item {
    std::string name;
    torch::Tensor t;
  };
  std::vector<Item> items;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(name != "__metadata__", "save_safetensors: '", path,
                "': '__metadata__' is not a valid tensor name");
    TORCH_CHECK(t.defined(), "save_safetensors: '", path, "': tensor '", name, "' is undefined");
    safetensors_dtype_name(t.scalar_type());  // check early
    auto c = t.detach().to(torch::kCPU).contiguous();
    items.push_back({name, c});
  }
  // as the safetensors package: by dtype (its enum order, descending), then by name
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    const int ra = dtype_rank(a.t.scalar_type()), rb = dtype_rank(b.t.scalar_type());
    return ra != rb ? ra > rb : a.name < b.name;
  });
  auto header = json::Value::new_object();
  if (!metadata.empty()) {
    auto md = json::Value::new_object();
    for (const auto& [k, v] : metadata) md.set(k, json::Value::from_string(v));
    header.set("__metadata__", std::move(md));
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    auto info = json::Value::new_object();
    info.set("dtype", json::Value::from_string(safetensors_dtype_name(it.t.scalar_type())));
    auto shape = json::Value::new_array();
    for (auto s : it.t.sizes()) shape.array.push_back(json::Value::from_int(s));
    info.set("shape", std::move(shape));
    uint64_t n = it.t.nbytes();
    auto offs = json::Value::new_array();
    offs.array.push_back(json::Value::from_int(static_cast<int64_t>(offset)));
    offs.array.push_back(json::Value::from_int(static_cast<int64_t>(offset + n)));
    info.set("data_offsets", std::move(offs));
    header.set(it.name, std::move(info));
    offset += n;
  }
  std::string h = json::dump(header);
  h.append((8 - h.size() % 8) % 8, ' ');
  write_file_atomic(path, "save_safetensors", [&](std::ofstream& f) {
    uint64_t n = h.size();
    unsigned char len[8];
    for (int k = 0; k < 8; ++k) len[k] = static_cast<unsigned char>(n >> (8 * k));
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& it : items) {
      if (it.t.nbytes() == 0) continue;
      f.write(static_cast<const char*>(it.t.const_data_ptr()),
              static_cast<std::streamsize>(it.t.nbytes()));
    }
  });
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  check_little_endian();
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(path, ec), "safetensors: no such file '", path, "'");
  const uint64_t size = fs::file_size(path, ec);
  TORCH_CHECK(!ec, "safetensors: cannot stat '", path, "'");
  TORCH_CHECK(size >= 8, "safetensors: '", path, "' is too short (", size,
              " bytes) to hold a header");
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "safetensors: cannot open '", path, "'");
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  TORCH_CHECK(f.good(), "safetensors: cannot read the header size of '", path, "'");
  uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= static_cast<uint64_t>(len[k]) << (8 * k);
  TORCH_CHECK(n <= kMaxHeader, "safetensors: bad header in '", path, "': header size ", n,
              " is larger than 100 MB");
  TORCH_CHECK(n <= size - 8, "safetensors: bad header in '", path, "': header size ", n,
              " exceeds the file size ", size);
  std::string h(n, '\0');
  f.read(h.data(), static_cast<std::streamsize>(n));
  TORCH_CHECK(f.good(), "safetensors: cannot read the header of '", path, "'");
  TORCH_CHECK(n > 0 && h[0] == '{', "safetensors: bad header in '", path,
              "': it does not start with '{'");
  const std::string what = "safetensors header of '" + path + "'";
  json::Value header = json::parse(h, what);
  TORCH_CHECK(header.is_object(), what, ": not a JSON object");
  data_start_ = 8 + n;
  const uint64_t data_size = size - data_start_;

  std::set<std::string> seen;
  for (const auto& [name, info] : header.object) {
    TORCH_CHECK(seen.insert(name).second, what, ": duplicate entry '", name, "'");
    if (name == "__metadata__") {
      TORCH_CHECK(info.is_object(), what, ": __metadata__ must be an object");
      for (const auto& [k, v] : info.object) {
        TORCH_CHECK(v.is_string(), what, ": __metadata__ value of '", k, "' must be a string");
        metadata_[k] = v.string;
      }
      continue;
    }
    TORCH_CHECK(info.is_object(), what, ": entry of tensor '", name, "' is not an object");
    const auto* dt = info.find("dtype");
    const auto* sh = info.find("shape");
    const auto* of = info.find("data_offsets");
    TORCH_CHECK(dt && dt->is_string(), what, ": tensor '", name, "' has no string dtype");
    TORCH_CHECK(sh && sh->is_array(), what, ": tensor '", name, "' has no shape array");
    TORCH_CHECK(of && of->is_array() && of->array.size() == 2, what, ": tensor '", name,
                "' has no data_offsets [begin, end]");
    Entry e;
    try {
      e.dtype = safetensors_dtype(dt->string);
    } catch (const c10::Error&) {
      TORCH_CHECK(false, what, ": tensor '", name, "' has unsupported dtype '", dt->string, "'");
    }
    uint64_t numel = 1;
    for (const auto& d : sh->array) {
      TORCH_CHECK(d.is_number() && d.is_integer && d.integer >= 0, what, ": tensor '", name,
                  "' has a bad shape entry ", json::dump(d));
      e.shape.push_back(d.integer);
      TORCH_CHECK(!mul_overflow(numel, static_cast<uint64_t>(d.integer), numel), what,
                  ": tensor '", name, "' shape overflows");
    }
    for (int k = 0; k < 2; ++k) {
      const auto& o = of->array[k];
      TORCH_CHECK(o.is_number() && o.is_integer && o.integer >= 0, what, ": tensor '", name,
                  "' has a bad data offset ", json::dump(o));
    }
    e.begin = static_cast<uint64_t>(of->array[0].integer);
    e.end = static_cast<uint64_t>(of->array[1].integer);
    TORCH_CHECK(e.begin <= e.end, what, ": tensor '", name, "' has data_offsets begin > end");
    uint64_t nbytes = 0;
    TORCH_CHECK(!mul_overflow(numel, c10::elementSize(e.dtype), nbytes), what, ": tensor '", name,
                "' size overflows");
    TORCH_CHECK(nbytes == e.end - e.begin, what, ": tensor '", name, "' has ", e.end - e.begin,
                " bytes for shape ", c10::IntArrayRef(e.shape), " and dtype ", dt->string,
                " (expected ", nbytes, ")");
    TORCH_CHECK(e.end <= data_size, what, ": tensor '", name, "' data [", e.begin, ", ", e.end,
                ") runs past the end of the file (data section of ", data_size,
                " bytes): truncated file?");
    entries_.emplace(name, std::move(e));
  }
  // the data section must be covered exactly, without holes or overlaps
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : entries_) ranges.emplace_back(e.begin, e.end);
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (const auto& [b, e] : ranges) {
    TORCH_CHECK(b == pos, what, ": tensor data ranges overlap or leave a hole at byte ", pos);
    pos = e;
  }
  TORCH_CHECK(pos == data_size, what, ": the data section has ", data_size,
              " bytes but the tensors cover ", pos, " (truncated or trailing data)");
}

torch::Tensor SafetensorsFile::read(const std::string& name) const {
  auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "safetensors: no tensor '", name, "' in '", path_, "'");
  const Entry& e = it->second;
  auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  const uint64_t n = e.end - e.begin;
  if (n == 0) return t;
  std::ifstream f(path_, std::ios::binary);
  TORCH_CHECK(f.good(), "safetensors: cannot open '", path_, "'");
  f.seekg(static_cast<std::streamoff>(data_start_ + e.begin));
  f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(n));
  TORCH_CHECK(f.good() && static_cast<uint64_t>(f.gcount()) == n, "safetensors: cannot read tensor '",
              name, "' from '", path_, "' (file changed or truncated?)");
  return t;
}

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  SafetensorsFile file(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, e] : file.entries()) out.emplace(name, file.read(name));
  return out;
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  return SafetensorsFile(path).metadata();
}

// =================================================================================================
// pretrained checkpoints
// =================================================================================================

void save_pretrained(const ForgettingTransformerForCausalLMImpl& model, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec && fs::is_directory(dir), "save_pretrained: cannot create directory '", dir,
              "'");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& kv : model.named_parameters(true)) tensors[kv.key()] = kv.value();
  for (const auto& kv : model.named_buffers(true)) tensors[kv.key()] = kv.value();
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  auto cfg = config_to_json_value(model.config);
  if (const char* dt = torch_dtype_name(model.model->embeddings->weight.scalar_type())) {
    // insert keeping the keys sorted
    auto& obj = cfg.object;
    auto pos = std::find_if(obj.begin(), obj.end(), [](const auto& kv) {
      return kv.first > std::string("torch_dtype");
    });
    obj.insert(pos, {"torch_dtype", json::Value::from_string(dt)});
  }
  const std::string text = json::dump(cfg, 2) + "\n";
  write_file_atomic((fs::path(dir) / "config.json").string(), "save_pretrained",
                    [&](std::ofstream& f) { f << text; });
}

void save_pretrained(const ForgettingTransformerForCausalLM& model, const std::string& dir) {
  save_pretrained(*model, dir);
}

void load_pretrained_weights(ForgettingTransformerForCausalLMImpl& model, const std::string& dir,
                             bool strict) {
  // the files and which one holds each tensor
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const SafetensorsFile*> where;
  std::string source;
  const fs::path d(dir);
  if (fs::is_regular_file(d)) {
    files.push_back(std::make_unique<SafetensorsFile>(d.string()));
    source = d.string();
  } else if (fs::is_regular_file(d / "model.safetensors")) {
    files.push_back(std::make_unique<SafetensorsFile>((d / "model.safetensors").string()));
    source = (d / "model.safetensors").string();
  } else if (fs::is_regular_file(d / "model.safetensors.index.json")) {
    source = (d / "model.safetensors.index.json").string();
    auto index = json::parse(read_text_file(source, "load_pretrained"), source);
    const auto* wm = index.find("weight_map");
    TORCH_CHECK(wm && wm->is_object(), source, ": no \"weight_map\" object");
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& [name, file] : wm->object) {
      TORCH_CHECK(file.is_string(), source, ": weight_map entry of '", name,
                  "' is not a file name");
      auto& f = by_file[file.string];
      if (!f) {
        files.push_back(std::make_unique<SafetensorsFile>((d / file.string).string()));
        f = files.back().get();
      }
      TORCH_CHECK(f->contains(name), source, ": tensor '", name, "' is not in its shard '",
                  f->path(), "'");
      where[name] = f;
    }
  } else {
    bool bin = fs::exists(d / "pytorch_model.bin");
    TORCH_CHECK(false, "load_pretrained: no model.safetensors or model.safetensors.index.json in '",
                dir, "'",
                bin ? " (pytorch_model.bin is not supported: convert it to safetensors)" : "");
  }
  if (files.size() == 1 && where.empty()) {
    for (const auto& [name, e] : files[0]->entries()) where[name] = files[0].get();
  }

  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  auto load_into = [&](const std::string& name, torch::Tensor& dst, bool required) {
    auto it = where.find(name);
    if (it == where.end()) {
      TORCH_CHECK(!required, "load_pretrained: missing tensor '", name, "' in '", source, "'");
      return;
    }
    auto t = it->second->read(name);
    TORCH_CHECK(t.sizes() == dst.sizes(), "load_pretrained: shape mismatch for tensor '", name,
                "' in '", it->second->path(), "': checkpoint ", t.sizes(), ", model ",
                dst.sizes());
    dst.copy_(t);
    used.insert(name);
  };
  for (auto& kv : model.named_parameters(true)) load_into(kv.key(), kv.value(), true);
  for (auto& kv : model.named_buffers(true)) load_into(kv.key(), kv.value(), false);

  std::vector<std::string> unexpected;
  for (const auto& [name, f] : where) {
    if (used.count(name)) continue;
    if (name == "lm_head.weight" && model.config.tie_word_embeddings()) continue;
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t k = 0; k < unexpected.size() && k < 8; ++k) list += (k ? ", " : "") + unexpected[k];
    if (unexpected.size() > 8) list += ", ...";
    TORCH_CHECK(!strict, "load_pretrained: ", unexpected.size(), " tensor(s) in '", source,
                "' that the model does not have: ", list);
    TORCH_WARN("load_pretrained: ignoring ", unexpected.size(), " tensor(s) in '", source,
               "' that the model does not have: ", list);
  }
}

ForgettingTransformerForCausalLM load_pretrained(const std::string& dir,
                                                 std::optional<torch::Device> device,
                                                 std::optional<torch::ScalarType> dtype,
                                                 bool strict) {
  auto config = load_config(dir);
  ForgettingTransformerForCausalLM model(config);
  if (dtype) model->to(*dtype);
  if (device) model->to(*device);
  load_pretrained_weights(*model, dir, strict);
  return model;
}

}  // namespace fox::nn
