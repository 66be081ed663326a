#include <fox/nn/safetensors.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <system_error>

#include <c10/util/Exception.h>

#include "json_files.h"

namespace fs = std::filesystem;

namespace fox::nn {

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

void check_little_endian() {
  TORCH_CHECK(std::endian::native == std::endian::little,
              "safetensors: only little-endian hosts are supported");
}

// A shape entry or data offset: a non-negative integer that fits int64 (torch sizes), else none.
std::optional<uint64_t> as_size(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return u;
  } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(v.get<int64_t>());
  }
  return std::nullopt;
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
    items.push_back({name, t.detach().to(torch::kCPU).contiguous()});
  }
  // as the safetensors package: by dtype (its enum order, descending), then by name
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    const int ra = dtype_rank(a.t.scalar_type()), rb = dtype_rank(b.t.scalar_type());
    return ra != rb ? ra > rb : a.name < b.name;
  });
  // ordered_json keeps insertion order: the header lists entries in data order, as the package
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& it : items) {
    const uint64_t n = it.t.nbytes();
    header[it.name] = {{"dtype", safetensors_dtype_name(it.t.scalar_type())},
                       {"shape", it.t.sizes().vec()},
                       {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h;
  try {
    h = header.dump();  // compact, UTF-8 kept as is (as the package)
  } catch (const nlohmann::json::exception&) {
    TORCH_CHECK(false, "save_safetensors: '", path,
                "': tensor names and metadata must be valid UTF-8");
  }
  h.append((8 - h.size() % 8) % 8, ' ');
  detail::write_file_atomic(path, "save_safetensors", [&](std::ofstream& f) {
    const uint64_t n = h.size();
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
  const auto header = detail::parse_json(h, what, /*unique_top_level_keys=*/true);
  TORCH_CHECK(header.is_object(), what, ": not a JSON object");
  data_start_ = 8 + n;
  const uint64_t data_size = size - data_start_;

  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      TORCH_CHECK(info.is_object(), what, ": __metadata__ must be an object");
      for (const auto& [k, v] : info.items()) {
        TORCH_CHECK(v.is_string(), what, ": __metadata__ value of '", k, "' must be a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    TORCH_CHECK(info.is_object(), what, ": entry of tensor '", name, "' is not an object");
    const auto dt = info.find("dtype");
    const auto sh = info.find("shape");
    const auto of = info.find("data_offsets");
    TORCH_CHECK(dt != info.end() && dt->is_string(), what, ": tensor '", name,
                "' has no string dtype");
    TORCH_CHECK(sh != info.end() && sh->is_array(), what, ": tensor '", name,
                "' has no shape array");
    TORCH_CHECK(of != info.end() && of->is_array() && of->size() == 2, what, ": tensor '", name,
                "' has no data_offsets [begin, end]");
    const auto dtype_name = dt->get<std::string>();
    Entry e;
    try {
      e.dtype = safetensors_dtype(dtype_name);
    } catch (const c10::Error&) {
      TORCH_CHECK(false, what, ": tensor '", name, "' has unsupported dtype '", dtype_name, "'");
    }
    // numel, and the span of the contiguous strides torch will compute (zero-sized dimensions
    // count as 1 there): both must fit, even for a tensor of no elements
    uint64_t numel = 1, span = 1;
    for (const auto& d : *sh) {
      const auto dim = as_size(d);
      TORCH_CHECK(dim, what, ": tensor '", name, "' has a bad shape entry ", detail::brief_json(d));
      e.shape.push_back(static_cast<int64_t>(*dim));
      TORCH_CHECK(!__builtin_mul_overflow(numel, *dim, &numel) &&
                      !__builtin_mul_overflow(span, std::max<uint64_t>(*dim, 1), &span) &&
                      span <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  what, ": tensor '", name, "' shape overflows");
    }
    const auto begin = as_size((*of)[0]), end = as_size((*of)[1]);
    TORCH_CHECK(begin, what, ": tensor '", name, "' has a bad data offset ",
                detail::brief_json((*of)[0]));
    TORCH_CHECK(end, what, ": tensor '", name, "' has a bad data offset ",
                detail::brief_json((*of)[1]));
    e.begin = *begin;
    e.end = *end;
    TORCH_CHECK(e.begin <= e.end, what, ": tensor '", name, "' has data_offsets begin > end");
    uint64_t nbytes = 0;
    TORCH_CHECK(!__builtin_mul_overflow(numel, c10::elementSize(e.dtype), &nbytes), what,
                ": tensor '", name, "' size overflows");
    TORCH_CHECK(nbytes == e.end - e.begin, what, ": tensor '", name, "' has ", e.end - e.begin,
                " bytes for shape ", c10::IntArrayRef(e.shape), " and dtype ", dtype_name,
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

}  // namespace fox::nn
