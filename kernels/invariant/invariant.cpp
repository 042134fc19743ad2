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
// above. Every multiply-add is fused where the target has FMA units (fma_v and fma_s below, one rule for vector
// and scalar code) and a product then a sum where it has none; -ffp-contract=off keeps the compiler from fusing
// anything on its own. So machines with FMA (every AVX2, AVX-512 and ARMv8 CPU) even round alike.
//
// Threads split rows, columns and (row, head) pairs, never a reduction, so the thread count changes nothing.
#include <omp.h>

#if defined(__FMA__)
#include <immintrin.h>
#define RS_FUSED 1
#elif defined(__ARM_FEATURE_FMA)
#include <arm_neon.h>
#define RS_FUSED 1
#else
#define RS_FUSED 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// a * b + c, lane by lane: one rounding where the target fuses (RS_FUSED), two where it cannot
inline vf fma_v(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof a), std::memcpy(y, &b, sizeof b), std::memcpy(z, &c, sizeof c);
  for (int i = 0; i < 2; ++i) z[i] = _mm256_fmadd_ps(x[i], y[i], z[i]);
  std::memcpy(&c, z, sizeof c);
  return c;
#elif defined(__ARM_FEATURE_FMA)
  float32x4_t x[4], y[4], z[4];
  std::memcpy(x, &a, sizeof a), std::memcpy(y, &b, sizeof b), std::memcpy(z, &c, sizeof c);
  for (int i = 0; i < 4; ++i) z[i] = vfmaq_f32(z[i], x[i], y[i]);
  std::memcpy(&c, z, sizeof c);
  return c;
#else
  return a * b + c;
#endif
}
inline float fma_s(float a, float b, float c) {
#if RS_FUSED
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
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
// W's rows are given by pointer (a linear layer's are evenly spaced, attention's keys are scattered in the pool).
template <int MR, int NR, class TX, class TW>
void tile(const TX* x, int64_t ldx, const TW* const* w, int64_t k, float* y, int64_t ldy, const float* bias) {
  vf acc[MR][NR] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    vf xv[MR], wv[NR];
    for (int r = 0; r < MR; ++r) xv[r] = load(x + r * ldx + i);
    for (int c = 0; c < NR; ++c) wv[c] = load(w[c] + i);
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) acc[r][c] = fma_v(xv[r], wv[c], acc[r][c]);
  }
  for (int l = 0; i + l < k; ++l)  // the tail: lanes 0.. of one more round
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) acc[r][c][l] = fma_s(to_f(x[r * ldx + i + l]), to_f(w[c][i + l]), acc[r][c][l]);
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) y[r * ldy + c] = lane_sum(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

template <class TA, class TB>
float dot(const TA* a, const TB* b, int64_t k) {
  float out;
  tile<1, 1>(a, 0, &b, k, &out, 0, nullptr);
  return out;
}

// y [mr, nr] (row stride ldy) = x [mr, k] (row stride ldx) times the nr rows w[c]: a full MR x NR tile where it
// fits, else an element at a time -- each element the same dot either way.
template <int MR, int NR, class TX, class TW>
void block(int mr, int nr, const TX* x, int64_t ldx, const TW* const* w, int64_t k, float* y, int64_t ldy,
           const float* bias) {
  if (mr == MR && nr == NR) return tile<MR, NR>(x, ldx, w, k, y, ldy, bias);
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c)
      tile<1, 1>(x + r * ldx, ldx, w + c, k, y + r * ldy + c, ldy, bias ? bias + c : nullptr);
}

#if defined(__AVX512F__)
constexpr int kMR = 4, kNR = 4;  // 16 accumulators: the 32 vector registers hold them and the operands
#else
constexpr int kMR = 2, kNR = 2;  // AVX2 / NEON: a vector takes 2 / 4 registers of 16 / 32
#endif
constexpr int64_t kRowChunk = 64, kColChunk = 64;  // a unit of work: its x rows and W rows stay in cache

// Rows [m0, m1) x columns [n0, n1) of y = x W^T; w points at W's row n0 (rows of k).
template <class TW>
void unit(const float* x, const TW* w, int64_t k, int64_t n, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
          const float* bias, float* y) {
  for (int64_t c = n0; c < n1; c += kNR) {
    const int nr = int(std::min<int64_t>(kNR, n1 - c));
    const TW* rows[kNR];
    for (int i = 0; i < nr; ++i) rows[i] = w + (c - n0 + i) * k;
    for (int64_t r = m0; r < m1; r += kMR)
      block<kMR, kNR>(int(std::min<int64_t>(kMR, m1 - r)), nr, x + r * k, k, rows, k, y + r * n + c, n,
                      bias ? bias + c : nullptr);
  }
}

template <class TW>
void linear(int64_t m, int64_t k, int64_t n, const float* x, const TW* w, const float* bias, float* y) {
  const int64_t row_chunks = (m + kRowChunk - 1) / kRowChunk, col_chunks = (n + kColChunk - 1) / kColChunk;
#pragma omp parallel
  {
    std::vector<float> wf;  // a unit's bf16 W rows as float32, where several row tiles read them (exact values)
#pragma omp for schedule(static)
    for (int64_t u = 0; u < row_chunks * col_chunks; ++u) {
      const int64_t m0 = u / col_chunks * kRowChunk, m1 = std::min(m, m0 + kRowChunk);
      const int64_t n0 = u % col_chunks * kColChunk, n1 = std::min(n, n0 + kColChunk);
      if (!std::is_same_v<TW, float> && m1 - m0 > kMR) {
        wf.resize((n1 - n0) * k);
        const int64_t count = (n1 - n0) * k, whole = count / kLanes * kLanes;
        for (int64_t i = 0; i < whole; i += kLanes) {
          const vf v = load(w + n0 * k + i);
          std::memcpy(wf.data() + i, &v, sizeof v);
        }
        for (int64_t i = whole; i < count; ++i) wf[i] = to_f(w[n0 * k + i]);
        unit(x, wf.data(), k, n, m0, m1, n0, n1, bias, y);
      } else {
        unit(x, w + n0 * k, k, n, m0, m1, n0, n1, bias, y);
      }
    }
  }
}

constexpr int kKeys = 4, kHeads = 4;  // a score tile: up to 4 query heads of a kv head x 4 keys

// Task (row, kv head): the group's query heads score every key of the row's context (tiles of heads x keys, each
// score one dot), then per head: max, e = exp(s - max), its sum in 16 lanes, out = sum_j e_j v_j / sum.
template <class T>
void attention(int64_t rows, int32_t heads, int32_t kv_heads, int32_t d, const T* q, const T* k_pool,
               const T* v_pool, const int64_t* slots, const int64_t* first, const int64_t* len, float scale,
               float softcap, float* out) {
  const int group = heads / kv_heads;
#pragma omp parallel
  {
    std::vector<float> s;    // [group, n] scores, then weights
    std::vector<float> o(group * d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * kv_heads; ++task) {
      const int64_t row = task / kv_heads;
      const int kh = int(task % kv_heads);
      const T* qg = q + (row * heads + kh * group) * d;  // the group's heads, d apart
      const int64_t n = len[row];
      const int64_t* ctx = slots + first[row];
      s.resize(group * n);
      for (int64_t j = 0; j < n; j += kKeys) {
        const int nk = int(std::min<int64_t>(kKeys, n - j));
        const T* keys[kKeys];
        for (int c = 0; c < nk; ++c) keys[c] = k_pool + (ctx[j + c] * kv_heads + kh) * d;
        for (int h = 0; h < group; h += kHeads)
          block<kHeads, kKeys>(std::min(kHeads, group - h), nk, qg + h * d, d, keys, d, s.data() + h * n + j, n,
                               nullptr);
      }
      std::fill(o.begin(), o.end(), 0.0f);
      for (int h = 0; h < group; ++h) {
        float* sh = s.data() + h * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          float v = sh[j] * scale;
          if (softcap > 0) v = softcap * std::tanh(v / softcap);
          sh[j] = v;
          mx = std::max(mx, v);
        }
        for (int64_t j = 0; j < n; ++j) sh[j] = exp_f(sh[j] - mx);
      }
      for (int64_t j = 0; j < n; ++j) {  // every head of the group reads v_j while it is in cache
        const T* vj = v_pool + (ctx[j] * kv_heads + kh) * d;
        for (int h = 0; h < group; ++h) {
          const float p = s[h * n + j];
          float* oh = o.data() + h * d;
#pragma omp simd
          for (int i = 0; i < d; ++i) oh[i] = fma_s(p, to_f(vj[i]), oh[i]);
        }
      }
      for (int h = 0; h < group; ++h) {
        const float* sh = s.data() + h * n;
        vf lanes = {};
        int64_t j = 0;
        for (; j + kLanes <= n; j += kLanes) lanes += load(sh + j);
        for (int l = 0; j + l < n; ++l) lanes[l] += sh[j + l];
        const float total = lane_sum(lanes);
        float* dst = out + (row * heads + kh * group + h) * d;
        for (int i = 0; i < d; ++i) dst[i] = o[h * d + i] / total;
      }
    }
  }
}

}  // namespace

extern "C" {

int32_t rsi_abi_version() { return 2; }

// y [m, n] float32 = x [m, k] W [n, k]^T (+ bias [n]); x float32, W float32 or bf16 (w_bf16), bias float32.
void rsi_linear(int32_t w_bf16, int64_t m, int64_t k, int64_t n, const float* x, const void* w, const float* bias,
                float* y) {
  if (w_bf16) linear(m, k, n, x, static_cast<const bf16*>(w), bias, y);
  else linear(m, k, n, x, static_cast<const float*>(w), bias, y);
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
