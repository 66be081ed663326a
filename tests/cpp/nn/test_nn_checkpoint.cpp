// fox::nn checkpoints: config.json, safetensors (corrupted files included), save/load_pretrained.
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "helpers.h"  // LibTorch first: Catch2 must own CHECK

#include "../catch.h"

using namespace fox::nn;
using fox_test::close;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const char* kArchs[] = {"fox_llama", "fox_pro", "transformer_llama", "transformer_pro"};

// A fresh, empty directory removed at scope exit.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() /
           ("fox_ckpt_" + tag + "_" + std::to_string(::getpid()) + "_" +
            std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
  std::string str() const { return path.string(); }
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
// A safetensors file from a raw header and data.
std::string st_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>(n >> (8 * k));
  return out + header + data;
}

std::string exception_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

}  // namespace

// ---- config -------------------------------------------------------------------------------------

TEST_CASE("config.json round trip of the four presets", "[nn][checkpoint][config]") {
  for (const char* arch : kArchs) {
    INFO(arch);
    auto c = fox_test::tiny_config(arch);
    c.num_kv_heads(2).pad_token_id(0).eos_token_id(3).norm_eps(1e-5).initializer_range(0.013);
    if (std::string(arch).rfind("fox", 0) == 0) c.log_pruning_tolerance(-10.5);
    auto text = config_to_json(c);
    auto v = json::parse(text);
    CHECK(v.at("model_type") == "forgetting_transformer");
    CHECK(v.at("architectures").at(0) == "ForgettingTransformerForCausalLM");
    CHECK(v.at("bos_token_id").is_null());
    CHECK(v.at("hidden_ratio").get<double>() == c.hidden_ratio());
    auto d = config_from_json(text);
    CHECK(config_to_json(d) == text);
    CHECK(d.fgate_type() == c.fgate_type());
    CHECK(d.use_rope() == c.use_rope());
    CHECK(d.qk_norm() == c.qk_norm());
    CHECK(d.use_k_shift() == c.use_k_shift());
    CHECK(d.intermediate_size() == c.intermediate_size());
    CHECK(d.num_kv_heads() == c.num_kv_heads());
    CHECK(d.eos_token_id() == c.eos_token_id());
    CHECK(!d.bos_token_id().has_value());
    CHECK(d.norm_eps() == c.norm_eps());
    CHECK(d.initializer_range() == c.initializer_range());
    CHECK(d.log_pruning_tolerance() == c.log_pruning_tolerance());
  }
}

TEST_CASE("config.json: the authors' keys, defaults and errors", "[nn][checkpoint][config]") {
  // as the authors' HF config.json: extra keys of their config class and of transformers
  const std::string authors = R"({
  "_name_or_path": "zhixuan-lin/fox-pro-760m-longcrawl64-48b",
  "architectures": ["ForgettingTransformerForCausalLM"],
  "attention_bias": false, "bos_token_id": 1, "decay_time_max": null, "decay_time_min": null,
  "elementwise_affine": true, "eos_token_id": 2, "fgate_bias_init": false, "fgate_type": "full",
  "fuse_cross_entropy": true, "fuse_norm": true, "hidden_act": "swish", "hidden_ratio": 3.5,
  "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": null,
  "max_position_embeddings": 16384, "model_type": "forgetting_transformer-project_fox",
  "norm_eps": 1e-06, "num_heads": 24, "num_hidden_layers": 24, "num_kv_heads": null,
  "ogate_act": "sigmoid", "qk_norm": true, "rope_base": 500000.0, "tie_word_embeddings": false,
  "torch_dtype": "float32", "transformers_version": "4.44.0", "use_cache": true,
  "use_k_shift": true, "use_output_gate": true, "use_output_norm": true, "use_rope": false,
  "use_v_shift": true, "vocab_size": 50277, "window_size": null
})";
  auto c = config_from_json(authors);
  CHECK(c.vocab_size() == 50277);
  CHECK(c.hidden_size() == 1536);
  CHECK(c.hidden_ratio() == 3.5);
  CHECK(c.num_heads() == 24);
  CHECK((c.qk_norm() && c.use_output_gate() && c.use_output_norm() && c.use_k_shift() &&
         c.use_v_shift() && !c.use_rope() && c.fgate_type() == "full"));
  CHECK(c.bos_token_id() == 1);
  CHECK(c.eos_token_id() == 2);
  CHECK(!c.intermediate_size().has_value());
  CHECK(!c.qk_norm_share_param_across_head());  // missing: default

  // missing keys keep the defaults; integral floats are integers; a list of eos ids gives the first
  auto d = config_from_json(R"({"hidden_size": 64.0, "eos_token_id": [7, 8], "hidden_ratio": null})");
  ForgettingTransformerConfig def;
  CHECK(d.hidden_size() == 64);
  CHECK(d.eos_token_id() == 7);
  CHECK(d.hidden_ratio() == def.hidden_ratio());
  CHECK(d.vocab_size() == def.vocab_size());
  CHECK(d.rope_base() == def.rope_base());
  CHECK(config_to_json(config_from_json("{}")) == config_to_json(def));

  // errors name the key
  CHECK_THROWS_WITH(config_from_json(R"({"hidden_size": "64"})", "cfg.json"),
                    fox_test::HasSubstring("cfg.json") && fox_test::HasSubstring("'hidden_size' must be an integer"));
  CHECK_THROWS_WITH(config_from_json(R"({"hidden_size": 64.5})"),
                    fox_test::HasSubstring("'hidden_size' must be an integer"));
  CHECK_THROWS_WITH(config_from_json(R"({"qk_norm": 1})"), fox_test::HasSubstring("'qk_norm' must be true"));
  CHECK_THROWS_WITH(config_from_json(R"({"norm_eps": "1e-6"})"),
                    fox_test::HasSubstring("'norm_eps' must be a number"));
  CHECK_THROWS_WITH(config_from_json(R"({"fgate_type": 3})"),
                    fox_test::HasSubstring("'fgate_type' must be a string"));
  CHECK_THROWS_WITH(config_from_json("[1]"), fox_test::HasSubstring("must be a JSON object"));
  CHECK_THROWS_WITH(config_from_json(R"({"model_type": "mamba2-project_fox"})"),
                    fox_test::HasSubstring("not a forgetting_transformer"));
  CHECK_THROWS_WITH(config_from_json(R"({"window_size": 512})"), fox_test::HasSubstring("window_size"));
  CHECK_THROWS_WITH(config_from_json(R"({"elementwise_affine": false})"),
                    fox_test::HasSubstring("elementwise_affine"));
  CHECK_THROWS_WITH(config_from_json(R"({"attention_bias": true})"),
                    fox_test::HasSubstring("attention_bias"));
  CHECK_THROWS_WITH(config_from_json("{\"vocab_size\": 3", "cfg.json"),
                    fox_test::HasSubstring("cfg.json: invalid JSON"));
}

TEST_CASE("config.json: numbers as Python writes them, malformed text", "[nn][checkpoint][config]") {
  ForgettingTransformerConfig c;
  c.norm_eps(1e-6).initializer_range(0.02).rope_base(500000.0).hidden_ratio(3.5);
  c.decay_time_min(1e-5).decay_time_max(0.1 + 0.2);
  const auto text = config_to_json(c);
  for (const char* s : {"\"norm_eps\": 1e-06,", "\"initializer_range\": 0.02,",
                        "\"rope_base\": 500000.0,", "\"hidden_ratio\": 3.5,",
                        "\"decay_time_min\": 1e-05,", "\"decay_time_max\": 0.30000000000000004,"}) {
    INFO(s);
    CHECK(text.find(s) != std::string::npos);
  }
  CHECK(text.substr(0, 4) == "{\n  ");  // 2-space indentation, as transformers
  CHECK(text.back() == '\n');
  CHECK_THROWS_WITH(config_to_json(ForgettingTransformerConfig().norm_eps(NAN)),
                    fox_test::HasSubstring("'norm_eps'") && fox_test::HasSubstring("non-finite"));

  const char* bad[] = {"",        "{",          "[1,]",         "{\"a\":1,}",  "01",
                       "1.",      ".5",         "-",            "1e",          "tru",
                       "\"abc",   "\"\\x\"",    "\"\\ud800\"",  "\"\\udc00\"", "\"\\u12\"",
                       "{a:1}",   "[1 2]",      "1 2",          "{\"a\" 1}",   "\"tab\there\"",
                       "+1",      "[nul]",      "{\"a\":}",     "\"\\ud800\\u0041\"",
                       "{\"a\": NaN}", "{\"a\": \"\xff\"}", "{\"a\": 1e400}"};
  for (const char* s : bad) {
    INFO("input: " << s);
    CHECK_THROWS_WITH(config_from_json(s, "doc"), fox_test::HasSubstring("doc: invalid JSON"));
  }
  std::string deep = "{\"x\": " + std::string(300, '[') + std::string(300, ']') + "}";
  CHECK_THROWS_WITH(config_from_json(deep, "doc"), fox_test::HasSubstring("nesting"));
  std::string ok = "{\"x\": " + std::string(200, '[') + std::string(200, ']') + "}";
  CHECK_NOTHROW(config_from_json(ok));
  // a repeated key: the last one wins, as Python's json
  CHECK(config_from_json(R"({"hidden_size": 1, "hidden_size": 64})").hidden_size() == 64);
  CHECK(config_from_json(R"({"hidden_act": "sw\u0069sh"})").hidden_act() == "swish");
}

// ---- safetensors --------------------------------------------------------------------------------

TEST_CASE("safetensors: dtypes, shapes, metadata and layout", "[nn][checkpoint][safetensors]") {
  TempDir dir("st");
  std::map<std::string, torch::Tensor> t;
  t["f32"] = torch::randn({3, 4});
  t["f16"] = torch::randn({5}).to(torch::kFloat16);
  t["bf16"] = torch::randn({2, 3, 2}).to(torch::kBFloat16);
  t["f64"] = torch::randn({2, 2}, torch::kFloat64);
  t["i64"] = torch::arange(-3, 4, torch::kInt64);
  t["i32"] = torch::arange(0, 5, torch::kInt32);
  t["u8"] = torch::arange(0, 7, torch::kUInt8);
  t["bool"] = torch::tensor({true, false, true});
  t["scalar"] = torch::tensor(2.5);
  t["empty"] = torch::zeros({0, 3});
  t["strided"] = torch::randn({4, 6}).t().slice(0, 1, 5, 2);  // not contiguous
  auto path = dir / "t.safetensors";
  save_safetensors(path, t, {{"format", "pt"}, {"note", "héllo \"x\""}});

  auto bytes = read_bytes(path);
  uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[k])) << (8 * k);
  CHECK(n % 8 == 0);  // padded with spaces as the safetensors package
  auto header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  CHECK(header.begin().key() == "__metadata__");
  CHECK(header.at("bf16").at("dtype") == "BF16");
  CHECK(header.at("f16").at("dtype") == "F16");
  CHECK(header.at("i64").at("dtype") == "I64");
  CHECK(header.at("scalar").at("shape").empty());
  CHECK(header.at("i64").at("data_offsets")[0] == 0);  // as the package:
  CHECK(header.at("f64").at("data_offsets")[0] == 56);  // I64, F64, F32, ...
  CHECK(bytes.size() == 8 + n + 12 * 4 + 5 * 2 + 12 * 2 + 4 * 8 + 7 * 8 + 5 * 4 + 7 + 3 + 4 + 0 + 8 * 4);

  auto back = load_safetensors(path);
  CHECK(back.size() == t.size());
  for (auto& [name, x] : t) {
    INFO(name);
    REQUIRE(back.count(name));
    CHECK(back[name].scalar_type() == x.scalar_type());
    CHECK(back[name].sizes() == x.sizes());
    CHECK(torch::equal(back[name], x));
  }
  auto md = load_safetensors_metadata(path);
  CHECK(md.at("format") == "pt");
  CHECK(md.at("note") == "héllo \"x\"");

  SafetensorsFile f(path);
  CHECK(f.contains("bf16"));
  CHECK(f.entries().at("bf16").dtype == torch::kBFloat16);
  CHECK(torch::equal(f.read("i64"), t["i64"]));
  CHECK_THROWS_WITH(f.read("nope"), fox_test::HasSubstring("no tensor 'nope'") && fox_test::HasSubstring(path));
  CHECK_THROWS_WITH(save_safetensors(dir / "c.safetensors", {{"c", torch::zeros({2}, torch::kComplexFloat)}}),
                    fox_test::HasSubstring("no safetensors name"));
  CHECK_THROWS_WITH(save_safetensors(dir / "u.safetensors", {{"a\xff", torch::zeros({1})}}),
                    fox_test::HasSubstring("valid UTF-8"));
}

TEST_CASE("safetensors: corrupted files are errors naming the file", "[nn][checkpoint][safetensors]") {
  TempDir dir("bad");
  auto good = dir / "good.safetensors";
  save_safetensors(good, {{"a", torch::randn({4})}, {"b", torch::randn({2, 2})}});
  auto bytes = read_bytes(good);
  auto p = dir / "x.safetensors";
  auto expect_error = [&](const std::string& content, const std::string& msg) {
    write_bytes(p, content);
    auto e = exception_text([&] { load_safetensors(p); });
    INFO(e);
    CHECK(e.find(p) != std::string::npos);
    CHECK(e.find(msg) != std::string::npos);
  };
  CHECK_THROWS_WITH(load_safetensors(dir / "missing.safetensors"),
                    fox_test::HasSubstring("no such file") && fox_test::HasSubstring("missing.safetensors"));
  expect_error("abc", "too short");
  expect_error(bytes.substr(0, bytes.size() - 3), "runs past the end");              // truncated
  expect_error(bytes + "xx", "trailing");                                              // extra data
  expect_error(std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) + "{}", "header size");
  expect_error(st_file("{\"a\":1}", ""), "not an object");
  expect_error(st_file("[]      ", ""), "does not start with '{'");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]", std::string(8, 0)),
               "invalid JSON");
  expect_error(st_file("{\"a\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", std::string(8, 0)),
               "unsupported dtype 'Q7'");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", std::string(8, 0)),
               "expected 12");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", std::string(8, 0)),
               "bad shape");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]}}", std::string(8, 0)),
               "data_offsets");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", std::string(12, 0)),
               "hole");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                       std::string(12, 0)),
               "overlap");
  expect_error(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                       std::string(8, 0)),
               "duplicate");
  expect_error(st_file("{\"__metadata__\":{\"k\":1}}", ""), "__metadata__");
  // a hand-written file with a zero-sized tensor and no metadata is fine
  write_bytes(p, st_file("{\"e\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[0,0]},"
                         "\"x\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
                         "\x05\x06"));
  auto m = load_safetensors(p);
  CHECK(m.at("e").numel() == 0);
  CHECK(m.at("x")[1].item<int64_t>() == 6);
}

// Loads a possibly corrupt file: true on success, false on a c10::Error. Anything else (another
// exception type, a crash) fails the test.
static bool load_or_clean_error(const std::string& path) {
  try {
    SafetensorsFile f(path);
    for (const auto& [name, e] : f.entries()) f.read(name);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

TEST_CASE("safetensors: fuzzed files load or fail cleanly", "[nn][checkpoint][safetensors]") {
  TempDir dir("fuzz");
  auto good = dir / "good.safetensors";
  save_safetensors(good,
                   {{"a", torch::randn({3, 2})}, {"b", torch::arange(5)},
                    {"c", torch::randn({2}).to(torch::kBFloat16)}, {"e", torch::zeros({0, 4})}},
                   {{"format", "pt"}});
  const auto bytes = read_bytes(good);
  uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[k])) << (8 * k);
  auto p = dir / "x.safetensors";
  auto try_bytes = [&](const std::string& content) {
    write_bytes(p, content);
    CHECK_NOTHROW(load_or_clean_error(p));
  };
  std::mt19937_64 rng(1234);
  // every truncation
  for (size_t len = 0; len < bytes.size(); ++len) try_bytes(bytes.substr(0, len));
  // random byte flips, mostly in the header
  for (int t = 0; t < 400; ++t) {
    auto b = bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % (t % 4 == 0 ? b.size() : 8 + n);
      b[at] = static_cast<char>(rng() % 2 ? rng() % 256 : b[at] ^ (1 << (rng() % 8)));
    }
    try_bytes(b);
  }
  // header length fields: huge, one past the file, off by a few
  const uint64_t size = bytes.size();
  for (uint64_t len : std::vector<uint64_t>{~0ULL, 1ULL << 63, 1ULL << 40, 100'000'001ULL, size,
                                            size - 7, n + 1, n - 1, n + 8, 0}) {
    auto b = bytes;
    for (int k = 0; k < 8; ++k) b[k] = static_cast<char>(len >> (8 * k));
    try_bytes(b);
  }
  // header text mutations: numbers changed, characters dropped, duplicated or swapped
  const std::string header = bytes.substr(8, n), data = bytes.substr(8 + n);
  for (int t = 0; t < 400; ++t) {
    std::string h = header;
    const size_t at = rng() % h.size();
    switch (t % 4) {
      case 0: h.erase(at, 1 + rng() % 4); break;
      case 1: h.insert(at, h.substr(rng() % h.size(), 1 + rng() % 8)); break;
      case 2: std::swap(h[at], h[rng() % h.size()]); break;
      case 3:
        if (std::isdigit(static_cast<unsigned char>(h[at]))) {
          h.replace(at, 1, std::to_string(rng() % 3 == 0 ? rng() : rng() % 100));
        } else {
          h[at] = "{}[]\",:0-1e."[rng() % 12];
        }
        break;
    }
    try_bytes(st_file(h, data));
  }
}

// ---- pretrained checkpoints ---------------------------------------------------------------------

TEST_CASE("save_pretrained / load_pretrained round trip of the four presets",
          "[nn][checkpoint][pretrained]") {
  for (const char* arch : kArchs) {
    INFO(arch);
    torch::manual_seed(11);
    auto cfg = fox_test::tiny_config(arch);
    cfg.num_kv_heads(2);
    ForgettingTransformerForCausalLM a(cfg);
    fox_test::randomize(*a);
    TempDir dir(arch);
    save_pretrained(a, dir.str());
    CHECK(fs::exists(dir / "config.json"));
    CHECK(fs::exists(dir / "model.safetensors"));
    auto cj = json::parse(read_bytes(dir / "config.json"));
    CHECK(cj.at("torch_dtype") == "float32");
    CHECK(cj.at("model_type") == "forgetting_transformer");

    // every parameter, under its module name
    SafetensorsFile f(dir / "model.safetensors");
    auto params = a->named_parameters();
    CHECK(f.entries().size() == params.size() + a->named_buffers().size());
    for (auto& kv : params) {
      REQUIRE(f.contains(kv.key()));
      CHECK(torch::equal(f.read(kv.key()), kv.value()));
    }
    CHECK(f.metadata().at("format") == "pt");

    auto b = load_pretrained(dir.str());
    CHECK(config_to_json(b->config) == config_to_json(cfg));
    auto ids = torch::randint(0, 61, {2, 7});
    torch::NoGradGuard ng;
    CHECK(close(a(ids), b(ids), 0.0));
  }
}

TEST_CASE("bf16 checkpoints", "[nn][checkpoint][pretrained]") {
  torch::manual_seed(12);
  auto cfg = fox_test::tiny_config("fox_pro");
  ForgettingTransformerForCausalLM a(cfg);
  fox_test::randomize(*a);
  a->to(torch::kBFloat16);
  TempDir dir("bf16");
  save_pretrained(a, dir.str());
  CHECK(json::parse(read_bytes(dir / "config.json")).at("torch_dtype") == "bfloat16");
  SafetensorsFile f(dir / "model.safetensors");
  for (auto& [name, e] : f.entries()) {
    INFO(name);
    CHECK(e.dtype == torch::kBFloat16);
  }
  // default: float32 parameters holding the bf16 values
  auto b = load_pretrained(dir.str());
  for (auto& kv : b->named_parameters()) {
    CHECK(kv.value().scalar_type() == torch::kFloat32);
    CHECK(torch::equal(kv.value(), a->named_parameters()[kv.key()].to(torch::kFloat32)));
  }
  // as stored: same dtype and logits
  auto c = load_pretrained(dir.str(), std::nullopt, torch::kBFloat16);
  auto ids = torch::randint(0, 61, {2, 5});
  torch::NoGradGuard ng;
  CHECK(c->model->embeddings->weight.scalar_type() == torch::kBFloat16);
  CHECK(close(a(ids), c(ids), 0.0));
}

TEST_CASE("load_pretrained: tied embeddings, shards, extra tensors", "[nn][checkpoint][pretrained]") {
  torch::manual_seed(13);
  auto cfg = fox_test::tiny_config("fox_llama");
  cfg.tie_word_embeddings(true);
  ForgettingTransformerForCausalLM a(cfg);
  fox_test::randomize(*a);
  auto ids = torch::randint(0, 61, {1, 6});
  torch::NoGradGuard ng;
  auto ref = a(ids);

  TempDir dir("tied");
  save_pretrained(a, dir.str());
  CHECK(!SafetensorsFile(dir / "model.safetensors").contains("lm_head.weight"));
  CHECK(close(load_pretrained(dir.str())(ids), ref, 0.0));

  // a tied checkpoint that also stores lm_head.weight (some writers do): ignored
  auto tensors = load_safetensors(dir / "model.safetensors");
  tensors["lm_head.weight"] = tensors["model.embeddings.weight"].clone();
  tensors["model.layers.0.attn.rotary.inv_freq"] = torch::ones({4});
  save_safetensors(dir / "model.safetensors", tensors);
  CHECK(close(load_pretrained(dir.str())(ids), ref, 0.0));  // extra tensor: a warning
  CHECK_THROWS_WITH(load_pretrained(dir.str(), std::nullopt, std::nullopt, /*strict=*/true),
                    fox_test::HasSubstring("rotary.inv_freq") && fox_test::HasSubstring("does not have"));

  // sharded: model.safetensors.index.json + two shard files
  TempDir sh("shard");
  fs::copy_file(dir / "config.json", sh / "config.json");
  std::map<std::string, torch::Tensor> s1, s2;
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  auto& wm = index["weight_map"];
  int k = 0;
  for (auto& kv : a->named_parameters()) {
    bool first = k++ % 2 == 0;
    (first ? s1 : s2)[kv.key()] = kv.value();
    wm[kv.key()] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  save_safetensors(sh / "model-00001-of-00002.safetensors", s1);
  save_safetensors(sh / "model-00002-of-00002.safetensors", s2);
  write_bytes(sh / "model.safetensors.index.json", index.dump(2));
  CHECK(close(load_pretrained(sh.str())(ids), ref, 0.0));
  // an index naming a tensor its shard lacks
  wm["model.norm.weight"] = s1.count("model.norm.weight") ? "model-00002-of-00002.safetensors"
                                                           : "model-00001-of-00002.safetensors";
  write_bytes(sh / "model.safetensors.index.json", index.dump(2));
  CHECK_THROWS_WITH(load_pretrained(sh.str()),
                    fox_test::HasSubstring("'model.norm.weight' is not in its shard"));
}

TEST_CASE("load_pretrained: missing files, missing tensors, shape mismatches",
          "[nn][checkpoint][pretrained]") {
  torch::manual_seed(14);
  auto cfg = fox_test::tiny_config("fox_pro");
  ForgettingTransformerForCausalLM a(cfg);
  TempDir dir("err");
  CHECK_THROWS_WITH(load_pretrained(dir.str()),
                    fox_test::HasSubstring("cannot open") && fox_test::HasSubstring("config.json"));
  save_pretrained(a, dir.str());
  auto st = dir / "model.safetensors";
  auto tensors = load_safetensors(st);

  // missing tensor
  auto t2 = tensors;
  t2.erase("model.layers.1.attn.q_norm.weight");
  save_safetensors(st, t2);
  CHECK_THROWS_WITH(load_pretrained(dir.str()),
                    fox_test::HasSubstring("missing tensor 'model.layers.1.attn.q_norm.weight'") &&
                        fox_test::HasSubstring("model.safetensors"));
  // shape mismatch
  t2 = tensors;
  t2["model.layers.0.mlp.down_proj.weight"] = torch::zeros({32, 47});
  save_safetensors(st, t2);
  CHECK_THROWS_WITH(load_pretrained(dir.str()),
                    fox_test::HasSubstring("shape mismatch") &&
                        fox_test::HasSubstring("model.layers.0.mlp.down_proj.weight"));
  // a config that does not match the weights
  save_safetensors(st, tensors);
  auto other = cfg;
  other.hidden_size(64);
  write_bytes(dir / "config.json", config_to_json(other));
  CHECK_THROWS_WITH(load_pretrained(dir.str()), fox_test::HasSubstring("shape mismatch"));
  // corrupted config.json / weights
  write_bytes(dir / "config.json", "{\"hidden_size\": 32,");
  CHECK_THROWS_WITH(load_pretrained(dir.str()),
                    fox_test::HasSubstring("config.json") && fox_test::HasSubstring("invalid JSON"));
  write_bytes(dir / "config.json", config_to_json(cfg));
  auto bytes = read_bytes(st);
  write_bytes(st, bytes.substr(0, bytes.size() / 2));
  CHECK_THROWS_WITH(load_pretrained(dir.str()), fox_test::HasSubstring("model.safetensors"));
  fs::remove(st);
  CHECK_THROWS_WITH(load_pretrained(dir.str()), fox_test::HasSubstring("no model.safetensors"));
  // and the intact checkpoint loads again
  save_safetensors(st, tensors);
  CHECK_NOTHROW(load_pretrained(dir.str()));
}
