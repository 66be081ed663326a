// fox::PerDevice (csrc/ops/per_device.h): the per-GPU cache of the CUDA host code (device
// attributes, occupancy, kernel attributes). Plain C++: the device is an index, so it runs
// without a GPU.
#include <stdexcept>
#include <thread>
#include <vector>

#include "../catch.h"

#include "../../../csrc/ops/per_device.h"

TEST_CASE("PerDevice computes a device's value once and keeps devices apart", "[per_device]") {
  fox::PerDevice<int, 4> cache;
  int calls = 0;
  auto value_of = [&](int device) {
    return cache.get(device, [&] {
      ++calls;
      return 10 * device + 1;
    });
  };
  CHECK(value_of(0) == 1);
  CHECK(value_of(2) == 21);
  CHECK(value_of(0) == 1);
  CHECK(value_of(2) == 21);
  CHECK(calls == 2);
  // A value of zero is a value (not "unknown"): looked up once too.
  fox::PerDevice<int, 4> zeros;
  int zero_calls = 0;
  for (int i = 0; i < 3; ++i) CHECK(zeros.get(1, [&] { ++zero_calls; return 0; }) == 0);
  CHECK(zero_calls == 1);
}

TEST_CASE("PerDevice computes at every call outside its range", "[per_device]") {
  fox::PerDevice<int, 4> cache;
  int calls = 0;
  for (int device : {-1, 4, 4, 100}) CHECK(cache.get(device, [&] { ++calls; return 7; }) == 7);
  CHECK(calls == 4);
}

TEST_CASE("PerDevice leaves a device unknown when its computation throws", "[per_device]") {
  fox::PerDevice<int, 4> cache;
  CHECK_THROWS_AS(cache.get(3, []() -> int { throw std::runtime_error("no device"); }),
                  std::runtime_error);
  CHECK(cache.get(3, [] { return 5; }) == 5);
  CHECK(cache.get(3, [] { return 6; }) == 5);
}

TEST_CASE("PerDevice gives every thread the same value", "[per_device]") {
  fox::PerDevice<long long, 8> cache;
  std::vector<long long> seen(16, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t)
    threads.emplace_back([&, t] { seen[t] = cache.get(t % 8, [t] { return 1000LL + t % 8; }); });
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 16; ++t) CHECK(seen[t] == 1000 + t % 8);
}
