// The safetensors file format (as the `safetensors` package writes and validates it): an 8-byte
// little-endian header length N, N bytes of JSON header {name: {"dtype", "shape",
// "data_offsets": [begin, end]}, "__metadata__": {str: str}} padded with spaces, then the raw
// little-endian tensor data. Every error is a c10::Error that names the file (and the tensor).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

namespace fox::nn {

/// safetensors dtype name ("F32", "BF16", ...) of a torch dtype; error if it has none.
std::string safetensors_dtype_name(torch::ScalarType dtype);
/// torch dtype of a safetensors dtype name (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3
/// F8_E5M2); error if unknown.
torch::ScalarType safetensors_dtype(const std::string& name);

/// Writes `tensors` (any device, dtype with a safetensors name, any strides) to `path`, with
/// optional string metadata ("__metadata__"), byte for byte as the safetensors package: data
/// ordered by dtype (I64 F64 F32 I32 BF16 F16 I16 F8 I8 U8 BOOL) then name, compact header in
/// that order ("__metadata__" first) padded with spaces to a multiple of 8 bytes. Names and
/// metadata must be valid UTF-8. The file is written to a temporary name and renamed into place.
void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
/// Reads every tensor of a safetensors file (CPU tensors of the stored dtypes).
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);
/// Reads the "__metadata__" of a safetensors file (empty if none).
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

/// An open safetensors file with a validated header: tensors are read one at a time.
class SafetensorsFile {
 public:
  struct Entry {
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte range within the data section
  };
  /// Opens and validates the header (sizes, dtypes, shapes against byte ranges, the data section
  /// fully covered without overlaps, the file length).
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  /// Reads one tensor (a fresh CPU tensor); error naming the file if it is not there.
  torch::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fox::nn
