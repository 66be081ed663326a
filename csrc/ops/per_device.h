// A value looked up once per GPU and process: device attributes, occupancy figures, attributes set
// on a kernel. The decoding path asks for them on every call, and a machine may mix GPU models,
// so one process-wide value is not enough. Lock-free: two threads that race on a device's first
// call both compute it and store the same value. Devices outside [0, kMaxDevices) are computed at
// every call.
#pragma once

#include <array>
#include <atomic>

namespace fox {

template <typename T, int kMaxDevices = 64>
class PerDevice {
 public:
  template <typename Compute>
  T get(int device, Compute&& compute) {
    if (device < 0 || device >= kMaxDevices) return compute();
    Slot& slot = slots_[static_cast<size_t>(device)];
    if (slot.known.load(std::memory_order_acquire)) return slot.value.load(std::memory_order_relaxed);
    const T value = compute();  // an exception leaves the slot unknown
    slot.value.store(value, std::memory_order_relaxed);
    slot.known.store(true, std::memory_order_release);
    return value;
  }

 private:
  struct Slot {
    std::atomic<T> value{};
    std::atomic<bool> known{false};
  };
  std::array<Slot, kMaxDevices> slots_{};
};

}  // namespace fox
