// Two builds of the Hopper prefill kernels in one process, timed call by call in alternation: build
// A (namespace fox) and build B (the same program compiled with -Dfox=fox_b, from another source
// tree or with other -D switches). Separate processes of one build move together by several
// percent (clocks, the machine's state: 7-11% at N=16k over a run of rounds, bench/NOTES.md
// version 90); alternating single calls puts both builds under the same conditions, and the
// median of the per-pair ratios B / A resolves changes well under 1%.
//
//   fox_attention_kernel_ab [--reps N] [--d 64|128] [--heads H] [--fused | --nondeterministic] [N ...]
//
// Prints, per cell, each build's median forward and backward time, the medians of the pair ratios
// with their quartiles, and whether the checksums of out, dq, dk, dv agree. Built by CMake with
// both builds from this tree (an A/A program: the ratios then show the method's own spread). For
// a real comparison, bench/kernel_ab.sh builds A from a git revision and B from the working tree
// (with a patch or -D switches if given):
//
//   bash bench/kernel_ab.sh [--base REV] [--patch FILE] [-- -DSWITCH=VALUE ...]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernel_timing.cuh"

// The two builds' cells (attention_kernel_timing.cu).
#define FOX_TIMING_CELL_API                                                           \
  void* attention_cell_create(int d, int n, int heads, bool fused, bool in_turns);    \
  void attention_cell_step(void* cell, float* fwd_us, float* bwd_us);                 \
  void attention_cell_checksums(void* cell, double sums[4]);                          \
  double attention_cell_flops(void* cell);                                            \
  void attention_cell_shape(void* cell, int* heads, int* batch);                      \
  void attention_cell_destroy(void* cell);
namespace fox::bench {
FOX_TIMING_CELL_API
}
namespace fox_b::bench {
FOX_TIMING_CELL_API
}

namespace {

struct Build {
  const char* name;
  void* (*create)(int, int, int, bool, bool);
  void (*step)(void*, float*, float*);
  void (*checksums)(void*, double*);
  void (*destroy)(void*);
};
const Build kBuilds[2] = {
    {"A", fox::bench::attention_cell_create, fox::bench::attention_cell_step, fox::bench::attention_cell_checksums,
     fox::bench::attention_cell_destroy},
    {"B", fox_b::bench::attention_cell_create, fox_b::bench::attention_cell_step,
     fox_b::bench::attention_cell_checksums, fox_b::bench::attention_cell_destroy},
};

float quantile(std::vector<float> x, double q) {
  std::sort(x.begin(), x.end());
  return x[static_cast<size_t>(q * (x.size() - 1) + 0.5)];
}

void run(int d, int n, int reps, bool fused, bool in_turns, int heads) {
  void* cell[2];
  for (int b = 0; b < 2; ++b) cell[b] = kBuilds[b].create(d, n, heads, fused, in_turns);
  const double flops = fox::bench::attention_cell_flops(cell[0]);
  std::vector<float> fwd[2], bwd[2], fwd_ratio, bwd_ratio;
  for (int r = 0; r < reps + 3; ++r) {
    float f[2], g[2];
    const int first = r & 1;  // A then B, B then A, ...
    for (int k = 0; k < 2; ++k) {
      const int b = first ^ k;
      kBuilds[b].step(cell[b], &f[b], &g[b]);
    }
    if (r < 3) continue;  // (warm-up)
    for (int b = 0; b < 2; ++b) {
      fwd[b].push_back(f[b]);
      bwd[b].push_back(g[b]);
    }
    fwd_ratio.push_back(f[1] / f[0]);
    bwd_ratio.push_back(g[1] / g[0]);
  }
  double sums[2][4];
  for (int b = 0; b < 2; ++b) kBuilds[b].checksums(cell[b], sums[b]);
  const bool same = std::memcmp(sums[0], sums[1], sizeof(sums[0])) == 0;
  int heads_used = 0, batch = 0;
  fox::bench::attention_cell_shape(cell[0], &heads_used, &batch);
  std::printf("D=%d H=%d N=%d B=%d: fwd A %.1f us B %.1f us (%.0f / %.0f TFLOP/s), B/A %+.2f%% [%+.2f, %+.2f]; "
              "bwd A %.1f us B %.1f us, B/A %+.2f%% [%+.2f, %+.2f]; checksums %s\n",
              d, heads_used, n, batch, quantile(fwd[0], 0.5), quantile(fwd[1], 0.5),
              flops / quantile(fwd[0], 0.5) * 1e-6, flops / quantile(fwd[1], 0.5) * 1e-6,
              100 * (quantile(fwd_ratio, 0.5) - 1), 100 * (quantile(fwd_ratio, 0.25) - 1),
              100 * (quantile(fwd_ratio, 0.75) - 1), quantile(bwd[0], 0.5), quantile(bwd[1], 0.5),
              100 * (quantile(bwd_ratio, 0.5) - 1), 100 * (quantile(bwd_ratio, 0.25) - 1),
              100 * (quantile(bwd_ratio, 0.75) - 1), same ? "equal" : "DIFFER");
  if (!same)
    for (int b = 0; b < 2; ++b)
      std::printf("  %s: out %.9e dq %.9e dk %.9e dv %.9e\n", kBuilds[b].name, sums[b][0], sums[b][1], sums[b][2],
                  sums[b][3]);
  std::fflush(stdout);
  for (int b = 0; b < 2; ++b) kBuilds[b].destroy(cell[b]);
}

}  // namespace

int main(int argc, char** argv) {
  fox::bench::AttentionTimingOptions o;
  o.reps = 40;
  if (!fox::bench::parse_attention_timing_options(argc, argv, o)) return 2;
  if (o.lengths.empty()) o.lengths = {2048, 16384};
  if (!fox::bench::hopper_device()) return 1;
  for (int d : {128, 64}) {
    if (o.only_d != 0 && d != o.only_d) continue;
    for (int n : o.lengths) run(d, n, o.reps, o.fused, o.in_turns, o.heads);
  }
  return 0;
}
