// The batch-invariant kernels (kernels/invariant/invariant.cpp) built for one target: a linear layer's rows and
// attention rows computed alone and in a batch. Prints how many rows differ (must be 0) and a hash of every
// output bit (tests/test_invariant_isa.py compares it across targets). Driven by that test, not built by itself.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <random>
extern "C" {
void rsi_linear(int32_t w_bf16, int64_t m, int64_t k, int64_t n, const float* x, const void* w, const float* bias, float* y);
void rsi_attention(int32_t bf, int64_t rows, int32_t heads, int32_t kv_heads, int32_t d, const void* q,
                   const void* k_pool, const void* v_pool, const int64_t* slots, const int64_t* first,
                   const int64_t* len, float scale, float softcap, float* out);
}
int main() {
  std::mt19937 g(0); std::normal_distribution<float> nd;
  const int64_t M = 70, K = 1544, N = 96;
  std::vector<float> x(M * K), w(N * K), b(N), y(M * N), y1(N);
  for (auto& v : x) v = nd(g); for (auto& v : w) v = nd(g) * 0.05f; for (auto& v : b) v = nd(g);
  rsi_linear(0, M, K, N, x.data(), w.data(), b.data(), y.data());
  int bad = 0;
  for (int64_t r = 0; r < M; ++r) {
    rsi_linear(0, 1, K, N, x.data() + r * K, w.data(), b.data(), y1.data());
    bad += std::memcmp(y1.data(), y.data() + r * N, N * 4) != 0;
  }
  // attention: 5 rows, 6 heads over 2 kv heads, d 64, scattered slots
  const int S = 400, H = 6, KH = 2, D = 64;
  std::vector<float> kp(S * KH * D), vp(S * KH * D), q(5 * H * D), o(5 * H * D), o1(H * D);
  for (auto& v : kp) v = nd(g); for (auto& v : vp) v = nd(g); for (auto& v : q) v = nd(g);
  std::vector<int64_t> slots(300); for (int i = 0; i < 300; ++i) slots[i] = (i * 7) % S;
  int64_t first[5] = {0, 10, 0, 50, 299}, len[5] = {300, 5, 1, 250, 1};
  rsi_attention(0, 5, H, KH, D, q.data(), kp.data(), vp.data(), slots.data(), first, len, 0.125f, 0.f, o.data());
  for (int r = 0; r < 5; ++r) {
    rsi_attention(0, 1, H, KH, D, q.data() + r * H * D, kp.data(), vp.data(), slots.data(), first + r, len + r, 0.125f, 0.f, o1.data());
    bad += std::memcmp(o1.data(), o.data() + r * H * D, H * D * 4) != 0;
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every output bit: the same on every ISA?
  for (const auto* v : {&y, &o})
    for (float f : *v) { uint32_t u; std::memcpy(&u, &f, 4); h = (h ^ u) * 1099511628211ull; }
  std::printf("%d %016llx\n", bad, (unsigned long long)h);
  return bad != 0;
}
