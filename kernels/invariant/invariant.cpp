// Batch-invariant CPU kernels for --deterministic: every value a row gets is computed by the same arithmetic, in
// the same order, whatever else is in the batch -- by construction, on any CPU this compiles for.
//
// How: each output element is a reduction written out here, in a fixed order that depends only on the reduced
// length (never on the number of rows, a tile's place, the thread that runs it or the vector width):
//
//   dot(a, b) over K:  lane l (0..15) sums a[k] b[k] for k = l, l + 16, l + 32, ... in increasing k,
//                      then the 16 lanes add pairwise: (0+8, 1+9, ..) -> (0+4, ..) -> (0+2, 1+3) -> 0+1
//   softmax over keys: max (exact), e_j = exp(s_j - max) with the exp below, sum e_j in the 16 lanes as above,
//                      out[d] = sum_j e_j v_j[d] in increasing j, divided by the sum at the end
//
// The 16 lanes are a vector of the language (GCC/Clang vector extensions), not of the machine, so an AVX2 build
// (two 8-float registers a vector), an AVX-512 one (one) and a NEON one (four) compute the same sums. Tiles of
// rows x columns only decide which products run together; each element's own sequence of operations is the one
// above. A multiply-add is a product, then a sum (-ffp-contract=off: never fused), so even machines with and
// without FMA units round alike.
//
// Threads split rows, columns and (row, head) pairs, never a reduction, so the thread count changes nothing.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = uint16_t;
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const bf16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);  // bf16 is float32's upper half
}

inline float lane_sum(vf acc) {  // the fixed pairwise tree over the 16 lanes
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// e^x for x <= 0 (softmax, SiLU of either sign via exp(-|x|)): Cody-Waite reduction and a degree-6 polynomial,
// ~1 ulp; every step an IEEE operation, so the vectorised and the scalar copies of a loop agree.
inline float exp_f(float x) {
  x = std::max(x, -87.3f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest, in float
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + (r + 1.0f);
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// One MR x NR tile of y = x W^T: element (r, c) is the dot of x row r and W row c as described at the top, its
// lanes interleaved with its neighbours' (MR = NR = 1: one element, the same operations).
template <int MR, int NR, class TX, class TW>
void tile(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
          const float* bias) {
  vf acc[MR][NR] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    vf xv[MR], wv[NR];
    for (int r = 0; r < MR; ++r) xv[r] = load(x + r * ldx + i);
    for (int c = 0; c < NR; ++c) wv[c] = load(w + c * ldw + i);
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) acc[r][c] = xv[r] * wv[c] + acc[r][c];
  }
  for (int l = 0; i + l < k; ++l)  // the tail: lanes 0.. of one more round
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) acc[r][c][l] = to_f(x[r * ldx + i + l]) * to_f(w[c * ldw + i + l]) + acc[r][c][l];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) y[r * ldy + c] = lane_sum(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

template <class TA, class TB>
float dot(const TA* a, const TB* b, int64_t k) {
  float out;
  tile<1, 1>(a, 0, b, 0, k, &out, 0, nullptr);
  return out;
}

#if defined(__AVX512F__)
constexpr int kMR = 4, kNR = 4;  // 16 accumulators: the 32 vector registers hold them and the operands
#else
constexpr int kMR = 2, kNR = 2;  // AVX2 / NEON: a vector takes 2 / 4 registers of 16 / 32
#endif
constexpr int64_t kRowChunk = 64, kColChunk = 64;  // a unit of work: its x rows and W rows stay in cache

template <class TX, class TW>
void linear(int64_t m, int64_t k, int64_t n, const TX* x, const TW* w, const float* bias, float* y) {
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk, col_chunks = (n + kColChunk - 1) / kColChunk;
#pragma omp parallel for schedule(static)
  for (int64_t unit = 0; unit < row_chunks * col_chunks; ++unit) {
    const int64_t m0 = unit / col_chunks * kRowChunk, m1 = std::min(m, m0 + kRowChunk);
    const int64_t n0 = unit % col_chunks * kColChunk, n1 = std::min(n, n0 + kColChunk);
    for (int64_t c = n0; c < n1; c += kNR) {
      const float* b = bias ? bias + c : nullptr;
      const bool full_cols = c + kNR <= n1;
      for (int64_t r = m0; r < m1; r += kMR) {
        const TX* xr = x + r * k;
        float* yr = y + r * n + c;
        if (full_cols && r + kMR <= m1) {
          tile<kMR, kNR>(xr, k, w + c * k, k, k, yr, n, b);
        } else {  // edges: a row or a column at a time, each element the same dot
          for (int64_t rr = r; rr < std::min(m1, r + kMR); ++rr)
            for (int64_t cc = c; cc < std::min(n1, c + kNR); ++cc)
              tile<1, 1>(x + rr * k, k, w + cc * k, k, k, y + rr * n + cc, n, bias ? bias + cc : nullptr);
        }
      }
    }
  }
}

template <class T>
void attention(int64_t rows, int32_t heads, int32_t kv_heads, int32_t d, const T* q, const T* k_pool,
               const T* v_pool, const int64_t* slots, const int64_t* first, const int64_t* len, float scale,
               float softcap, float* out) {
  const int group = heads / kv_heads;
#pragma omp parallel
  {
    std::vector<float> s;  // one row's scores, reused
    std::vector<float> acc(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * heads; ++task) {
      const int64_t row = task / heads;
      const int h = int(task % heads), kh = h / group;
      const T* qh = q + (row * heads + h) * d;
      const int64_t n = len[row];
      const int64_t* ctx = slots + first[row];
      s.resize(n);
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        float v = dot(qh, k_pool + (ctx[j] * kv_heads + kh) * d, d) * scale;
        if (softcap > 0) v = softcap * std::tanh(v / softcap);
        s[j] = v;
        mx = std::max(mx, v);
      }
      for (int64_t j = 0; j < n; ++j) s[j] = exp_f(s[j] - mx);
      std::vector<float>& o = acc;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const T* vj = v_pool + (ctx[j] * kv_heads + kh) * d;
        const float p = s[j];
#pragma omp simd
        for (int i = 0; i < d; ++i) o[i] = p * to_f(vj[i]) + o[i];
      }
      vf lanes = {};
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) lanes += load(s.data() + j);
      for (int l = 0; j + l < n; ++l) lanes[l] += s[j + l];
      const float total = lane_sum(lanes);
      float* dst = out + (row * heads + h) * d;
      for (int i = 0; i < d; ++i) dst[i] = o[i] / total;
    }
  }
}

}  // namespace

extern "C" {

int32_t rsi_abi_version() { return 1; }

// y [m, n] float32 = x [m, k] W [n, k]^T (+ bias [n], float32); x and W float32 or bf16 (flags).
void rsi_linear(int32_t x_bf16, int32_t w_bf16, int64_t m, int64_t k, int64_t n, const void* x, const void* w,
                const float* bias, float* y) {
  if (x_bf16 && w_bf16) linear(m, k, n, static_cast<const bf16*>(x), static_cast<const bf16*>(w), bias, y);
  else if (x_bf16) linear(m, k, n, static_cast<const bf16*>(x), static_cast<const float*>(w), bias, y);
  else if (w_bf16) linear(m, k, n, static_cast<const float*>(x), static_cast<const bf16*>(w), bias, y);
  else linear(m, k, n, static_cast<const float*>(x), static_cast<const float*>(w), bias, y);
}

// inv_rms [m] = 1 / sqrt(mean(x^2) + eps) over each float32 row of x [m, k].
void rsi_inv_rms(int64_t m, int64_t k, const float* x, float eps, float* inv_rms) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) inv_rms[r] = 1.0f / std::sqrt(dot(x + r * k, x + r * k, k) / float(k) + eps);
}

// out [n] = act(gate) * up, float32: act 0 = SiLU (x / (1 + e^-x)), 1 = GELU, tanh approximation.
void rsi_act_mul(int32_t act, int64_t n, const float* gate, const float* up, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    float a;
    if (act == 0) {
      const float e = exp_f(-std::fabs(g));  // e^-|g|: no overflow either way
      a = g >= 0 ? g / (1.0f + e) : g * e / (1.0f + e);
    } else {
      a = 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    }
    out[i] = a * up[i];
  }
}

// out [n] = tanh(x), float32 (soft-capping: c * tanh(x / c) around it)
void rsi_tanh(int64_t n, const float* x, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(x[i]);
}

// out [rows, heads, d] float32: each row's queries q [rows, heads, d] attend to the keys of pool slots
// slots[first[r] .. first[r] + len[r]); pools [slots, kv_heads, d] (bf16 or float32, as q); softcap 0: none.
void rsi_attention(int32_t bf, int64_t rows, int32_t heads, int32_t kv_heads, int32_t d, const void* q,
                   const void* k_pool, const void* v_pool, const int64_t* slots, const int64_t* first,
                   const int64_t* len, float scale, float softcap, float* out) {
  if (bf)
    attention(rows, heads, kv_heads, d, static_cast<const bf16*>(q), static_cast<const bf16*>(k_pool),
              static_cast<const bf16*>(v_pool), slots, first, len, scale, softcap, out);
  else
    attention(rows, heads, kv_heads, d, static_cast<const float*>(q), static_cast<const float*>(k_pool),
              static_cast<const float*>(v_pool), slots, first, len, scale, softcap, out);
}

}  // extern "C"
