// Kernel-only measurement of the shipped row-skipping matvec (kernels/gating_impl.inc) with the
// weights coming from DRAM: is the op's efficiency at low keep limited by ORT/op overhead or by
// the memory system? Built and run by tests/bench/bench_gather_dram.py (not part of the library).
//
//   gather_dram K N keep copies reps
//
// `copies` weight matrices are cycled and a 64 MB buffer is read before every timed call (caches
// flushed). Rows kept: a random `keep` share of the K rows (ascending, as the op produces them).
// Prints the median microseconds of the dense call (every row, the op's keep-1.0 path) and of the
// gated call, and eff = keep * dense / gated.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/gating_impl.inc"

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s K N keep copies reps\n", argv[0]);
    return 2;
  }
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]);
  const double keep = std::atof(argv[3]);
  const int copies = std::atoi(argv[4]), reps = std::atoi(argv[5]);
  const ortlean::GatingKernels& gk = ortlean::ORTLEAN_ISA_TABLE(gating_kernels);
  std::vector<float*> Ws;
  for (int c = 0; c < copies; ++c) {
    float* w = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(K * N * 4 + 63) / 64 * 64));
    for (int64_t i = 0; i < K * N; ++i) w[i] = static_cast<float>(i % 97) * 0.01f;
    Ws.push_back(w);
  }
  std::mt19937 rng(1);
  std::vector<int32_t> all(K), iota(K);
  for (int64_t i = 0; i < K; ++i) all[i] = iota[i] = static_cast<int32_t>(i);
  std::shuffle(all.begin(), all.end(), rng);
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(keep * static_cast<double>(K)));
  std::vector<int32_t> idx(all.begin(), all.begin() + n);
  std::sort(idx.begin(), idx.end());
  std::vector<float> v(K, 0.5f), y(N + 16);
  std::vector<float> junk(16 << 20, 1.0f);
  volatile float sink = 0;
  auto bench = [&](const int32_t* ix, int64_t nn) {
    std::vector<double> ts;
    for (int r = 0; r < reps; ++r) {
      float acc = 0;
      for (size_t q = 0; q < junk.size(); q += 16) acc += junk[q];
      sink = acc;
      const float* w = Ws[r % copies];
      const auto t0 = std::chrono::steady_clock::now();
      gk.gather_axpy(ix, v.data(), nn, w, N, y.data(), N, 0);
      ts.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  const double d = bench(iota.data(), K), g = bench(idx.data(), n);
  std::printf("{\"isa\": \"%s\", \"K\": %lld, \"N\": %lld, \"keep\": %.4f, \"dense_us\": %.2f, \"gated_us\": %.2f, \"eff\": %.3f}\n",
              gk.name, static_cast<long long>(K), static_cast<long long>(N), static_cast<double>(n) / K, d, g,
              static_cast<double>(n) / K * d / g);
  return 0;
}
