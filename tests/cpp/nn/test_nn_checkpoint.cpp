// fox::nn checkpoints: the JSON reader/writer, config.json, safetensors, save/load_pretrained.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "helpers.h"  // LibTorch first: Catch2 must own CHECK

#include "../catch.h"

using namespace fox::nn;
using fox_test::close;
namespace fs = std::filesystem;
namespace json = fox::nn::json;

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

// ---- JSON ---------------------------------------------------------------------------------------

TEST_CASE("JSON: values, escapes and numbers", "[nn][checkpoint][json]") {
  auto v = json::parse(
      " {\"s\": \"q\\\"b\\\\s\\/n\\n t\\t r\\r b\\b f\\f\", \"u\": \"\\u00e9\\u20ac\\ud83d\\ude00\","
      " \"utf8\": \"\xc3\xa9\", \"i\": -12345678901234567, \"z\": -0, \"f\": 1.5e-6, \"E\": 2E+2,"
      " \"a\": [true, false, null, [], {}], \"nested\": {\"x\": {\"y\": [1, [2, [3]]]}},"
      " \"dup\": 1, \"dup\": 2, \"nan\": NaN, \"inf\": -Infinity, \"big\": 1e400,"
      " \"tiny\": 1e-400, \"huge_int\": 123456789012345678901234567890 }\n");
  REQUIRE(v.is_object());
  CHECK(v.find("s")->string == "q\"b\\s/n\n t\t r\r b\b f\f");
  CHECK(v.find("u")->string == "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  CHECK(v.find("utf8")->string == "\xc3\xa9");
  CHECK(v.find("i")->is_integer);
  CHECK(v.find("i")->integer == -12345678901234567LL);  // exact, beyond 2^53
  CHECK(v.find("z")->is_integer);
  CHECK(v.find("f")->number == 1.5e-6);
  CHECK(!v.find("f")->is_integer);
  CHECK(v.find("E")->number == 200.0);
  CHECK(!v.find("E")->is_integer);
  const auto& a = v.find("a")->array;
  REQUIRE(a.size() == 5);
  CHECK((a[0].is_bool() && a[0].boolean && a[1].is_bool() && !a[1].boolean && a[2].is_null()));
  CHECK((a[3].is_array() && a[3].array.empty() && a[4].is_object() && a[4].object.empty()));
  CHECK(v.find("nested")->find("x")->find("y")->array[1].array[1].array[0].integer == 3);
  CHECK(v.find("dup")->integer == 2);  // last occurrence wins, as Python
  CHECK(std::isnan(v.find("nan")->number));
  CHECK(v.find("inf")->number == -INFINITY);
  CHECK(v.find("big")->number == INFINITY);
  CHECK(v.find("tiny")->number == 0.0);
  CHECK(!v.find("huge_int")->is_integer);
  CHECK(v.find("huge_int")->number == fox_test::Approx(1.2345678901234568e29));
  CHECK(v.find("missing") == nullptr);

  // dump -> parse is the identity
  auto again = json::parse(json::dump(v, 2));
  CHECK(json::dump(again) == json::dump(v));
  CHECK(json::dump(json::parse(json::dump(v))) == json::dump(v));
}

TEST_CASE("JSON: writer output as Python's json", "[nn][checkpoint][json]") {
  CHECK(json::dump(json::Value::from_double(0.02)) == "0.02");
  CHECK(json::dump(json::Value::from_double(4.0)) == "4.0");
  CHECK(json::dump(json::Value::from_double(1e-6)) == "1e-06");
  CHECK(json::dump(json::Value::from_double(500000.0)) == "500000.0");
  CHECK(json::dump(json::Value::from_double(0.1 + 0.2)) == "0.30000000000000004");
  CHECK(json::dump(json::Value::from_double(123.456)) == "123.456");
  CHECK(json::dump(json::Value::from_double(1e-4)) == "0.0001");
  CHECK(json::dump(json::Value::from_double(1e-5)) == "1e-05");
  CHECK(json::dump(json::Value::from_double(1e16)) == "1e+16");
  CHECK(json::dump(json::Value::from_double(1234567890123456.0)) == "1234567890123456.0");
  CHECK(json::dump(json::Value::from_double(-2.5e300)) == "-2.5e+300");
  CHECK(json::dump(json::Value::from_double(0.0)) == "0.0");
  CHECK(json::dump(json::Value::from_double(-0.0)) == "-0.0");
  CHECK(json::dump(json::Value::from_int(-7)) == "-7");
  CHECK(json::dump(json::Value::from_string("a\"b\\c\n\x01")) == "\"a\\\"b\\\\c\\n\\u0001\"");
  for (double d : {0.02, 1e-6, 3.5, -2.5e300, 5e-324, 1.0 / 3.0}) {
    CHECK(json::parse(json::dump(json::Value::from_double(d))).number == d);
  }
  auto o = json::Value::new_object();
  o.set("a", json::Value::from_int(1));
  auto arr = json::Value::new_array();
  arr.array.push_back(json::Value::null());
  arr.array.push_back(json::Value::from_bool(true));
  o.set("b", arr);
  o.set("c", json::Value::new_object());
  CHECK(json::dump(o) == "{\"a\":1,\"b\":[null,true],\"c\":{}}");
  CHECK(json::dump(o, 2) == "{\n  \"a\": 1,\n  \"b\": [\n    null,\n    true\n  ],\n  \"c\": {}\n}");
}

TEST_CASE("JSON: malformed documents are errors", "[nn][checkpoint][json]") {
  const char* bad[] = {"",        "{",          "[1,]",         "{\"a\":1,}",  "01",
                       "1.",      ".5",         "-",            "1e",          "tru",
                       "\"abc",   "\"\\x\"",    "\"\\ud800\"",  "\"\\udc00\"", "\"\\u12\"",
                       "{a:1}",   "[1 2]",      "1 2",          "{\"a\" 1}",   "\"tab\there\"",
                       "+1",      "[nul]",      "{\"a\":}",     "\"\\ud800\\u0041\""};
  for (const char* s : bad) {
    INFO("input: " << s);
    CHECK_THROWS_WITH(json::parse(s, "doc"), fox_test::HasSubstring("doc: invalid JSON"));
  }
  std::string deep(300, '[');
  deep += std::string(300, ']');
  CHECK_THROWS_WITH(json::parse(deep), fox_test::HasSubstring("nesting"));
  std::string ok(200, '[');
  ok += std::string(200, ']');
  CHECK_NOTHROW(json::parse(ok));
}

// ---- config -------------------------------------------------------------------------------------

TEST_CASE("config.json round trip of the four presets", "[nn][checkpoint][config]") {
  for (const char* arch : kArchs) {
    INFO(arch);
    auto c = fox_test::tiny_config(arch);
    c.num_kv_heads(2).pad_token_id(0).eos_token_id(3).norm_eps(1e-5).initializer_range(0.013);
    if (std::string(arch).rfind("fox", 0) == 0) c.log_pruning_tolerance(-10.5);
    auto text = config_to_json(c);
    auto v = json::parse(text);
    CHECK(v.find("model_type")->string == "forgetting_transformer");
    CHECK(v.find("architectures")->array.at(0).string == "ForgettingTransformerForCausalLM");
    CHECK(v.find("bos_token_id")->is_null());
    CHECK(v.find("hidden_ratio")->number == c.hidden_ratio());
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
  auto header = json::parse(bytes.substr(8, n));
  CHECK(header.object.front().first == "__metadata__");
  CHECK(header.find("bf16")->find("dtype")->string == "BF16");
  CHECK(header.find("f16")->find("dtype")->string == "F16");
  CHECK(header.find("i64")->find("dtype")->string == "I64");
  CHECK(header.find("scalar")->find("shape")->array.empty());
  CHECK(header.find("i64")->find("data_offsets")->array[0].integer == 0);  // as the package:
  CHECK(header.find("f64")->find("data_offsets")->array[0].integer == 56);  // I64, F64, F32, ...
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
    CHECK(cj.find("torch_dtype")->string == "float32");
    CHECK(cj.find("model_type")->string == "forgetting_transformer");

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
  CHECK(json::parse(read_bytes(dir / "config.json")).find("torch_dtype")->string == "bfloat16");
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
  auto index = json::Value::new_object();
  index.set("metadata", json::Value::new_object()).set("total_size", json::Value::from_int(0));
  auto& wm = index.set("weight_map", json::Value::new_object());
  int k = 0;
  for (auto& kv : a->named_parameters()) {
    bool first = k++ % 2 == 0;
    (first ? s1 : s2)[kv.key()] = kv.value();
    wm.set(kv.key(), json::Value::from_string(first ? "model-00001-of-00002.safetensors"
                                                    : "model-00002-of-00002.safetensors"));
  }
  save_safetensors(sh / "model-00001-of-00002.safetensors", s1);
  save_safetensors(sh / "model-00002-of-00002.safetensors", s2);
  write_bytes(sh / "model.safetensors.index.json", json::dump(index, 2));
  CHECK(close(load_pretrained(sh.str())(ids), ref, 0.0));
  // an index naming a tensor its shard lacks
  wm.set("model.norm.weight",
         json::Value::from_string(s1.count("model.norm.weight") ? "model-00002-of-00002.safetensors"
                                                                 : "model-00001-of-00002.safetensors"));
  write_bytes(sh / "model.safetensors.index.json", json::dump(index, 2));
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
