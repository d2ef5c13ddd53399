// Kernel-only cost of PackedAttention's KV-cache decode pieces (kernels/attn_impl.inc, AVX2 copy), in
// ns per cached key, interleaved in one process (not part of the library, not a test):
//
//   c++ -O3 -mavx2 -mfma -mpopcnt -Icpp/src -DORTLEAN_ISA_AVX2 -DORTLEAN_ISA_NS=attn_avx2 \
//       -DORTLEAN_ISA_NAME='"avx2"' -D'ORTLEAN_ISA_TABLE(n)=n##_avx2' tests/bench/attn_kernels.cc -o /tmp/ak
//   /tmp/ak [T=4096] [bits=8] [reps=50] [copies=1] [hugepages=0] [only this case]
//
// Rows of one KV head in the cache-row format (K codes, V codes; D = Dv = 64; the scales in 20-byte
// key-bits rows as the op keeps them, one array shared by the copies),
// 3 query heads: tile = deq_rows + dots_tile + deq_rows + pv_tile (float tiles of 32 rows, the fp32
// rows' path), attend = the library's kv_attend task (the op's decode loop: gather, int16 query .
// codes, online softmax, pv_rows) over all keys, attend_sel8 = the same over a sorted random eighth of
// the keys (as a 0.125 budget selects; still per context key: x8 per selected key; ORTLEAN_SEL=4 in the
// environment keeps a quarter instead), lut = lutscore
// over 8 bytes of key bits (one array, in cache), lut_rows = lutscore + score finish over 20-byte
// key-bits rows of every copy (as the op reads them), lut_rows_nogamma = the same without the gamma words
// (ScoreFinish gword -1, as pq codes are scored), stream = a plain read of the rows.
// Medians of reps; copies > 1 cycles through that many row buffers (copies = 90: the 50 MB of a
// 30-layer SmolLM2 int8 cache at T = 4096, from DRAM; hugepages = 1: madvise(MADV_HUGEPAGE)).
#include <algorithm>
#include <sys/mman.h>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/attn_impl.inc"

using clk = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int bits = argc > 2 ? std::atoi(argv[2]) : 8;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 50;
  const int copies = argc > 4 ? std::atoi(argv[4]) : 1;
  const int huge = argc > 5 ? std::atoi(argv[5]) : 0;
  int cur = 0;
  const ortlean::AttnKernels& ak = ortlean::ORTLEAN_ISA_TABLE(attn_kernels);
  const int64_t D = 64, Dv = 64, nq = 3, nb = 32;
  const int64_t kbytes = D * bits / 8, vbytes = Dv * bits / 8, R = kbytes + vbytes, SB = 20;  // SB: key-bits row bytes (sign bits, gamma, K / V scale)
  std::mt19937 rng(0);
  struct Buf { uint8_t* p; size_t n; uint8_t* data() { return p; } size_t size() const { return n; } };
  std::vector<Buf> bufs(static_cast<size_t>(copies));
  const size_t tot = static_cast<size_t>(T * R) * copies;
  uint8_t* big = static_cast<uint8_t*>(std::aligned_alloc(1 << 21, (tot + (1 << 21)) & ~size_t((1 << 21) - 1)));
  if (huge) madvise(big, tot, MADV_HUGEPAGE);
  for (int c = 0; c < copies; ++c) {
    bufs[c] = Buf{big + static_cast<size_t>(T * R) * c, static_cast<size_t>(T * R)};
    for (size_t i = 0; i < bufs[c].n; ++i) bufs[c].p[i] = static_cast<uint8_t>(rng() & 0x3F);
  }
  auto next = [&]() -> Buf& { cur = (cur + 1) % copies; return bufs[static_cast<size_t>(cur)]; };
  std::vector<float> q(nq * D), L(nq * nb), y(nq * Dv), kf(nb * D), vf(nb * Dv);
  for (auto& x : q) x = static_cast<float>(rng() % 1000) / 1000.0f - 0.5f;
  std::vector<uint32_t> kbits(static_cast<size_t>(T * 3));
  for (auto& x : kbits) x = rng();
  std::vector<int32_t> qi(64), lut(8 * 256), core(static_cast<size_t>(T));
  for (auto& x : qi) x = static_cast<int32_t>(rng() % 255) - 127;
  const uint8_t* kr[nb];
  const uint8_t* vr[nb];
  volatile float sink = 0;
  auto tile = [&] {
    auto& rows = next();
    for (int64_t i0 = 0; i0 < T; i0 += nb) {
      for (int64_t i = 0; i < nb; ++i) {
        kr[i] = rows.data() + (i0 + i) * R;
        vr[i] = kr[i] + kbytes;
      }
      ak.deq_rows(kr, nb, D, bits, kf.data());
      ak.dots_tile(q.data(), nq, D, kf.data(), nb, D, L.data());
      for (auto& x : L) x *= 1e-3f;
      ak.deq_rows(vr, nb, Dv, bits, vf.data());
      ak.pv_tile(L.data(), nq, vf.data(), nb, Dv, y.data(), Dv);
    }
    sink = sink + y[0];
  };
  std::vector<float> pr(nq * (Dv + 2));
  std::vector<int64_t> sel;
  const char* sd = std::getenv("ORTLEAN_SEL");  // keep one key in ORTLEAN_SEL (default 8) at random
  const unsigned sel_every = sd ? static_cast<unsigned>(std::atoi(sd)) : 8u;
  for (int64_t t = 0; t < T; ++t) if (rng() % sel_every == 0) sel.push_back(t);
  std::vector<float> sc(static_cast<size_t>(T * SB / 4), 0.01f);  // the scales' words of the key-bits rows
  // the library's attend task (kv_attend: int16 query . codes, online softmax, pv_rows), all T keys
  std::vector<float> scr(ortlean::kv_attend_scratch(nq, D, Dv));
  auto attend = [&](bool listed) {
    auto& rows = next();
    static std::vector<int32_t> sl;
    sl.assign(sel.begin(), sel.end());
    ortlean::KvAttend a{};
    a.q = q.data(); a.ldq = D; a.nq = nq;
    a.base = rows.data(); a.row_bytes = R; a.kbytes = kbytes; a.vbytes = vbytes;
    a.list = listed ? sl.data() : nullptr; a.start = 0; a.n = listed ? static_cast<int64_t>(sl.size()) : T;
    a.bits = bits; a.D = D; a.Dv = Dv; a.scale = 1e-3f; a.softcap = 0; a.mask = nullptr; a.mst = 0;
    a.sc = reinterpret_cast<const uint8_t*>(sc.data() + 3); a.sc_stride = SB;
    a.part = pr.data(); a.scratch = scr.data();
    ak.kv_attend(a);
    sink = sink + pr[5];
  };
  auto lut_ = [&] {
    ak.lutscore(kbits.data(), 3, T, 8, qi.data(), lut.data(), core.data(), nullptr, nullptr);
    sink = sink + static_cast<float>(core[T / 2]);
  };
  // lutscore as the op runs it: cache-mode key-bits rows (sign words, gamma, K / V scale: 20 bytes) of
  // every copy (from DRAM with copies = 90), the float scores finished per block (ScoreFinish)
  std::vector<uint32_t> kbc(static_cast<size_t>(T * 5) * copies);
  for (size_t i = 0; i < kbc.size(); ++i) kbc[i] = i % 5 >= 2 ? 0x3f000000u : rng();
  std::vector<float> gs(static_cast<size_t>(T));
  auto lutc = [&](bool gamma) {
    cur = (cur + 1) % copies;
    ortlean::ScoreFinish f{};
    f.two = 2; f.qs = 5; f.gword = gamma ? 2 : -1; f.coef = 1e-3f; f.g = gs.data();
    ak.lutscore(kbc.data() + static_cast<size_t>(T * 5) * cur, 5, T, 8, qi.data(), lut.data(), core.data(), &f, nullptr);
    sink = sink + gs[T / 2];
  };
  auto stream = [&] {
    auto& rows = next();
    uint64_t a = 0, b = 0, c = 0, d = 0;
    const uint64_t* p = reinterpret_cast<const uint64_t*>(rows.data());
    const size_t n = rows.size() / 8;
    for (size_t i = 0; i + 4 <= n; i += 4) {
      a ^= p[i];
      b ^= p[i + 1];
      c ^= p[i + 2];
      d ^= p[i + 3];
    }
    sink = sink + static_cast<float>((a ^ b ^ c ^ d) & 1);
  };
  struct Case {
    const char* name;
    std::function<void()> f;
    std::vector<double> ns;
  };
  std::vector<Case> cs = {{"tile", tile, {}}, {"attend", [&] { attend(false); }, {}},
                          {"attend_sel8", [&] { attend(true); }, {}}, {"lutscore", lut_, {}}, {"lut_rows", [&] { lutc(true); }, {}},
                          {"lut_rows_nogamma", [&] { lutc(false); }, {}},
                          {"stream", stream, {}}};
  if (argc > 6)  // only the named case (for perf)
    cs.erase(std::remove_if(cs.begin(), cs.end(), [&](const Case& c) { return std::strcmp(c.name, argv[6]) != 0; }), cs.end());
  for (int r = 0; r < reps + 2; ++r)
    for (auto& c : cs) {
      const auto t0 = clk::now();
      c.f();
      const double dt = std::chrono::duration<double, std::nano>(clk::now() - t0).count();
      if (r >= 2) c.ns.push_back(dt / static_cast<double>(T));
    }
  std::printf("T %lld, int%d rows (%lld B), %lld query heads, D %lld:", static_cast<long long>(T), bits,
              static_cast<long long>(R), static_cast<long long>(nq), static_cast<long long>(D));
  for (auto& c : cs) {
    std::sort(c.ns.begin(), c.ns.end());
    std::printf("  %s %.2f ns/key", c.name, c.ns[c.ns.size() / 2]);
  }
  std::printf("\n");
  return 0;
}
