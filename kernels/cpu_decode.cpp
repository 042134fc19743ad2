// A whole decode step of a Llama-family model on the CPU, in one call: every layer's norm, projections, RoPE,
// KV store, paged attention, SiLU-mul and residuals, then the final norm and the output projection.
//
// Why C++: a decode step at small batch is bound by streaming the weights once; torch spends as much again on
// hundreds of small ops and the fork/join of every library call. Here the step is one OpenMP region (its
// threads are torch's own: the same libgomp), phases are separated by barriers, and the products are AVX-512
// (BF16 dot products or FP32 FMAs) written for a few rows at a time, reading every weight once per step.
//
// Numerics follow the eager model: values are rounded to the storage type (bf16 or fp32) wherever an eager op
// would round (each product, each element-wise op, each residual), products accumulate in fp32. Only the order
// of summation differs, as between any two GEMM libraries.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

using bf16 = uint16_t;

constexpr int kDense = 0, kQ8 = 1, kQ4 = 2;  // Linear.format
constexpr int kBlock = 32;  // weights per quantization block (along k)
constexpr int kKeys = 64;        // keys per chunk of the online softmax
constexpr int kMaxGroup = 16;    // query heads per kv head handled together
constexpr int kMaxHeadDim = 256;

// ---- the C ABI: mirrored by ctypes structures in kernels/cpu_native.py ----
extern "C" {
struct Linear {
  int32_t format, n, k, pad;
  const void* w;       // dense: T, packed in blocks of 16 rows (see product)
  const void* scale;   // quantized formats: per-block scales; else null
  const void* zero;    // quantized formats: per-block offsets; else null
  const void* bias;    // T [n] or null
};
struct Layer {
  const void* ln1;
  const void* ln2;
  Linear qkv, o, gate_up, down;
  void* k_pool;  // T [slots, kv_heads, head_dim]
  void* v_pool;
};
struct Model {
  int32_t bf16, layers, hidden, heads, kv_heads, head_dim, inter, vocab;
  int32_t amx;  // 1: bf16 products use AMX tiles (rs_request_amx granted them); 0: AVX-512
  float eps, scale;
  const Layer* layer;
  const void* norm;
  Linear lm_head;
};
struct Step {
  int32_t rows, logit_rows;
  void* h;                  // T [rows, hidden]: the embeddings in, the last layer's output out
  const void* cos;          // T [rows, head_dim]
  const void* sin;          // T [rows, head_dim] (the rotate-half sign folded in, as RopeTable keeps it)
  const int64_t* out_slot;  // [rows]
  const int64_t* slots;     // every row's context slots (its new one included), back to back
  const int64_t* starts;    // [rows + 1] offsets into slots
  const int64_t* logit_row; // [logit_rows]
  float* logits;            // [logit_rows, vocab]
  void* scratch;            // scratch_bytes(model, rows)
};
}

// ---- storage types ----
inline float bf2f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 f2bf(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return bf2f(v); }
template <class T> inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline bf16 from_f<bf16>(float v) { return f2bf(v); }
template <class T> inline float rnd(float v) { return to_f(from_f<T>(v)); }

inline __mmask16 mask16(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }
inline __mmask32 mask32(int n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
template <class T> inline __m512 rnd16(__m512 v);
inline void store16(bf16* p, __m512 v, __mmask16 m) {  // rounded to nearest even, as torch (finite values)
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rnd16<bf16>(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
}
template <class T> inline __m512 rnd16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {  // v to bf16 and back, round to nearest even (NaN-free inputs: activations)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
}

inline __m512 exp16(__m512 x) {  // e^x, ~1 ulp (Cephes' polynomial), scaled by 2^n
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// ---- products: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) ----
// Dense weights are packed once (kernels/cpu_native.py) into blocks of 16 output rows,
//   bf16: [n/16][k/2][16][2] (per k-pair, what one dpbf16 takes per output lane)    fp32: [n/16][k][16],
// so each lane of an accumulator is one output (no horizontal sums) and each weight vector, loaded once, serves a
// tile of up to kRowTile rows of x. A thread owns a contiguous share of the blocks.

constexpr int kRowTile = 4, kColTile = 4;  // a register tile: rows of x x blocks of 16 outputs
using Acc = __m512[kRowTile][kColTile];

template <int MR, int NB>
inline void zero(Acc& acc) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
}

template <int MR, int NB>
void tile_bf16(const bf16* x, int64_t ldx, int k, const bf16* w, int64_t bstride, Acc& acc) {
  zero<MR, NB>(acc);
  const int pairs = k / 2;
  for (int p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * bstride + p * 32);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
}

template <int MR, int NB>
void tile_f32(const float* x, int64_t ldx, int k, const float* w, int64_t bstride, Acc& acc) {
  zero<MR, NB>(acc);
  for (int i = 0; i < k; ++i) {
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * bstride + i * 16);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xb, acc[r][j]);
    }
  }
}

template <class T>
using TileFn = void (*)(const T*, int64_t, int, const T*, int64_t, Acc&);

template <class T, int MR, int NB>
constexpr TileFn<T> tile_fn() {
  if constexpr (std::is_same_v<T, bf16>) return &tile_bf16<MR, NB>;
  else return &tile_f32<MR, NB>;
}

template <class T>
TileFn<T> tile_for(int mr, int nb) {  // every (rows, blocks) shape a tile can have
  static const TileFn<T> table[kRowTile][kColTile] = {
      {tile_fn<T, 1, 1>(), tile_fn<T, 1, 2>(), tile_fn<T, 1, 3>(), tile_fn<T, 1, 4>()},
      {tile_fn<T, 2, 1>(), tile_fn<T, 2, 2>(), tile_fn<T, 2, 3>(), tile_fn<T, 2, 4>()},
      {tile_fn<T, 3, 1>(), tile_fn<T, 3, 2>(), tile_fn<T, 3, 3>(), tile_fn<T, 3, 4>()},
      {tile_fn<T, 4, 1>(), tile_fn<T, 4, 2>(), tile_fn<T, 4, 3>(), tile_fn<T, 4, 4>()}};
  return table[mr - 1][nb - 1];
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (built where the compiler targets it, used where the kernel was granted it): a bf16 tile product
// C[rows x 16] += A[rows x 32] B[16 pairs x 16] is exactly one block of the packed layout per 32 k, so a tile
// computes 16 rows x 16 outputs x 32 k in one instruction -- where several rows of x make the AVX-512 tiles
// compute-bound. Tiles 0-3: C (four blocks of outputs), 4: A (rows of x), 5-6: B.
constexpr bool kHaveAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

thread_local int configured_rows = 0;  // the tile configuration is per thread; 0: none loaded

inline void configure_tiles(int rows) {
  if (configured_rows == rows) return;
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = uint8_t(t < 5 ? rows : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
  configured_rows = rows;
}

inline void release_tiles() {
  if (configured_rows) _tile_release();
  configured_rows = 0;
}

template <class F>
inline void product_amx(const bf16* x, int rows, const Linear& lin, const bf16* w, int b0, int b1, F&& out) {
  const int64_t bstride = int64_t(lin.k) * 16, lda = int64_t(lin.k) * 2;
  alignas(64) float c[kColTile][16][16];
  for (int b = b0; b < b1; b += kColTile) {
    const int nb = std::min(kColTile, b1 - b);
    const bf16* wb = w + b * bstride;
    for (int m = 0; m < rows; m += 16) {
      const int mr = std::min(16, rows - m);
      configure_tiles(mr);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int k0 = 0; k0 < lin.k; k0 += 32) {
        _tile_loadd(4, x + int64_t(m) * lin.k + k0, lda);
        const bf16* wk = wb + int64_t(k0) * 16;  // pairs k0/2 .. k0/2 + 15 of the first block: 1 KB
        _tile_loadd(5, wk, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(6, wk + bstride, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (nb > 2) {
          _tile_loadd(5, wk + 2 * bstride, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nb > 3) {
          _tile_loadd(6, wk + 3 * bstride, 64);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      _tile_stored(0, c[0], 64);
      if (nb > 1) _tile_stored(1, c[1], 64);
      if (nb > 2) _tile_stored(2, c[2], 64);
      if (nb > 3) _tile_stored(3, c[3], 64);
      for (int j = 0; j < nb; ++j)
        for (int r = 0; r < mr; ++r) out(m + r, (b + j) * 16, _mm512_load_ps(c[j][r]));
    }
  }
}

bool request_amx() {  // Linux: a process must ask before its threads may use the tile registers
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
#else
constexpr bool kHaveAmx = false;
bool request_amx() { return false; }
inline void release_tiles() {}
#endif

// ---- quantized products ----
// Weights in blocks of 16 output rows x 32 k (packed by kernels/cpu_native.py), each 32 k of a row with a scale d
// (and for q4 an offset m): w = d q + m.
//   q8: 8 groups of 4 k, each 16 lanes x 4 bytes of q + 128 (u8)                                  512 bytes
//   q4: 4 groups of 8 k, each 16 lanes x 4 bytes: low nibble q[k0 + b], high nibble q[k0 + 4 + b]  256 bytes
//   scale: q8 fp32, q4 fp16 [n/16][k/32][16] (d); zero: q4 fp16, the same layout (m)
// The activations are quantized per row and 32 k to int8 (xq = round(x / dx), dx = max|x| / 127, and sum(xq)),
// as llama.cpp does for its quantized CPU products, so a block's dot product is integer (VNNI's u8 x s8 dpbusd):
//   sum_k x w = dx (d sum_k q xq + m sum_k xq);  q8 stores q + 128: sum_k (q + 128) xq - 128 sum_k xq.

struct QuantRows {  // a product's input rows, quantized (scratch)
  int8_t* q;        // [rows, k]
  float* d;         // [rows, k / 32]
  int32_t* sum;     // [rows, k / 32]
};

template <class T>
inline void quantize_rows(const T* x, int rows, int k, const QuantRows& out) {
  const int blocks = k / kBlock;
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m)
    for (int b = 0; b < blocks; ++b) {
      const int64_t at = int64_t(m) * k + b * kBlock;
      const __m512 lo = load16(x + at, 0xffff), hi = load16(x + at + 16, 0xffff);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));  // nearest, ties to even
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + at), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + at + 16), _mm512_cvtsepi32_epi8(qhi));
      out.d[int64_t(m) * blocks + b] = d;
      out.sum[int64_t(m) * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}

constexpr int kQRowTile = 4, kQColTile = 2;  // integer and float accumulators: 2 x 8 registers

template <int Format, int MR, int NB>
void tile_quant(const QuantRows& x, int m0, int k, const Linear& lin, int b, Acc& acc) {
  const int blocks = k / kBlock;
  const int64_t wbytes = Format == kQ8 ? 512 : 256;  // per 16 rows x 32 k
  const uint8_t* w = static_cast<const uint8_t*>(lin.w) + int64_t(b) * blocks * wbytes;
  zero<MR, NB>(acc);
  for (int blk = 0; blk < blocks; ++blk) {
    __m512i dot[MR][NB];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) dot[r][j] = _mm512_setzero_si512();
    const uint8_t* wb = w + blk * wbytes;
    if constexpr (Format == kQ8) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        __m512i wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wb + j * blocks * wbytes + g * 64);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, x.q + int64_t(m0 + r) * k + blk * kBlock + g * 4, 4);
          const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], wv[j], xb);
        }
      }
    } else {
      const __m512i low = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        __m512i lo[NB], hi[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          const __m512i v = _mm512_loadu_si512(wb + j * blocks * wbytes + g * 64);
          lo[j] = _mm512_and_si512(v, low);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          int32_t q0, q1;
          const int8_t* xq = x.q + int64_t(m0 + r) * k + blk * kBlock + g * 8;
          std::memcpy(&q0, xq, 4);
          std::memcpy(&q1, xq + 4, 4);
          const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) {
            dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo[j], x0);
            dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi[j], x1);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const int64_t at = (int64_t(b + j) * blocks + blk) * 16;
      __m512 d, c;
      if constexpr (Format == kQ8) {
        d = _mm512_loadu_ps(static_cast<const float*>(lin.scale) + at);
        c = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
      } else {
        d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(lin.scale) + at)));
        c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(lin.zero) + at)));
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int64_t xi = int64_t(m0 + r) * blocks + blk;
        const __m512 t = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot[r][j]), _mm512_mul_ps(c, _mm512_set1_ps(float(x.sum[xi]))));
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x.d[xi]), t, acc[r][j]);
      }
    }
  }
}

using QuantTileFn = void (*)(const QuantRows&, int, int, const Linear&, int, Acc&);

template <int Format>
QuantTileFn quant_tile_for(int mr, int nb) {
  static const QuantTileFn table[kQRowTile][kQColTile] = {
      {&tile_quant<Format, 1, 1>, &tile_quant<Format, 1, 2>}, {&tile_quant<Format, 2, 1>, &tile_quant<Format, 2, 2>},
      {&tile_quant<Format, 3, 1>, &tile_quant<Format, 3, 2>}, {&tile_quant<Format, 4, 1>, &tile_quant<Format, 4, 2>}};
  return table[mr - 1][nb - 1];
}

// y = x W^T (+ b) for this thread's share of W's blocks. ``emit(m, n, v, mask)`` gets outputs n .. n + 15 of row
// m (lanes past W's last row masked off), the bias added and rounded to T, as an eager linear layer returns them.
// ``amx``: use the tile product (bf16, k a multiple of 32).
template <class T, class F>
inline void product(const T* x, const QuantRows& qx, int rows, const Linear& lin, bool amx, F&& emit) {
  const int blocks = (lin.n + 15) / 16, t = omp_get_thread_num(), nt = omp_get_num_threads();
  const int b0 = int(int64_t(blocks) * t / nt), b1 = int(int64_t(blocks) * (t + 1) / nt);
  const int64_t bstride = int64_t(lin.k) * 16;  // elements per block of 16 rows
  const T* w = static_cast<const T*>(lin.w);
  const T* bias = static_cast<const T*>(lin.bias);
  auto out = [&](int m, int n, __m512 acc) {
    const __mmask16 mk = mask16(lin.n - n);
    emit(m, n, rnd16<T>(bias ? _mm512_add_ps(acc, load16(bias + n, mk)) : acc), mk);
  };
  Acc acc;
  if (lin.format != kDense) {  // qx: x quantized (quantize_rows) just before
    for (int b = b0; b < b1; b += kQColTile) {
      const int nb = std::min(kQColTile, b1 - b);
      for (int m = 0; m < rows; m += kQRowTile) {
        const int mr = std::min(kQRowTile, rows - m);
        (lin.format == kQ8 ? quant_tile_for<kQ8>(mr, nb) : quant_tile_for<kQ4>(mr, nb))(qx, m, lin.k, lin, b, acc);
        for (int j = 0; j < nb; ++j)
          for (int r = 0; r < mr; ++r) out(m + r, (b + j) * 16, acc[r][j]);
      }
    }
    return;
  }
  if constexpr (std::is_same_v<T, bf16> && kHaveAmx) {
    if (amx && lin.k % 32 == 0) {
      product_amx(x, rows, lin, w, b0, b1, out);
      return;
    }
  }
  for (int b = b0; b < b1; b += kColTile) {
    const int nb = std::min(kColTile, b1 - b);
    for (int m = 0; m < rows; m += kRowTile) {
      const int mr = std::min(kRowTile, rows - m);
      tile_for<T>(mr, nb)(x + int64_t(m) * lin.k, lin.k, lin.k, w + b * bstride, bstride, acc);
      for (int j = 0; j < nb; ++j)
        for (int r = 0; r < mr; ++r) out(m + r, (b + j) * 16, acc[r][j]);
    }
  }
}

// ---- the pieces between the products ----

// out = w * round(x * rsqrt(mean(x^2) + eps)) per row: the eager RMSNorm's rounding (out may be x)
template <class T>
inline void rms_norm(const T* x, const T* w, int rows, int dim, float eps, T* out) {
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m) {
    const T* xm = x + int64_t(m) * dim;
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      const __m512 v = load16(xm + i, mask16(dim - i));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(dim) + eps);
    for (int i = 0; i < dim; i += 16) {
      const __mmask16 mk = mask16(dim - i);
      const __m512 v = rnd16<T>(_mm512_mul_ps(load16(xm + i, mk), _mm512_set1_ps(inv)));
      store16(out + int64_t(m) * dim + i, rnd16<T>(_mm512_mul_ps(load16(w + i, mk), v)), mk);
    }
  }
}

// RoPE on a row's q and k heads in place (x * cos + roll(x, half) * sin), then its k and v into the pool
template <class T>
inline void rope_and_store(const Model& md, const Layer& ly, const Step& st, T* qkv) {
  const int hd = md.head_dim, half = hd / 2, nq = md.heads, nkv = md.kv_heads, width = (nq + 2 * nkv) * hd;
#pragma omp for schedule(static)
  for (int t = 0; t < st.rows * (nq + nkv); ++t) {
    const int m = t / (nq + nkv), head = t % (nq + nkv);
    T* x = qkv + int64_t(m) * width + head * hd;
    const T* c = static_cast<const T*>(st.cos) + int64_t(m) * hd;
    const T* s = static_cast<const T*>(st.sin) + int64_t(m) * hd;
    float tmp[kMaxHeadDim];
    for (int i = 0; i < hd; ++i) {
      const float rolled = to_f(x[i < half ? i + half : i - half]);
      tmp[i] = rnd<T>(rnd<T>(to_f(x[i]) * to_f(c[i])) + rnd<T>(rolled * to_f(s[i])));
    }
    for (int i = 0; i < hd; ++i) x[i] = from_f<T>(tmp[i]);
    if (head >= nq) {  // a k head: it and its v go to the row's new slot
      const int g = head - nq;
      const int64_t at = (st.out_slot[m] * nkv + g) * hd;
      std::memcpy(static_cast<T*>(ly.k_pool) + at, x, sizeof(T) * hd);
      std::memcpy(static_cast<T*>(ly.v_pool) + at, x + nkv * hd, sizeof(T) * hd);
    }
  }
}

template <class T>
inline float dot_head(const T* q, const T* k, int hd) {
  __m512 a = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, bf16>) {
    for (int i = 0; i < hd; i += 32) {
      const __mmask32 mk = mask32(hd - i);
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(mk, q + i),
                           (__m512bh)_mm512_maskz_loadu_epi16(mk, k + i));
    }
  } else {
    for (int i = 0; i < hd; i += 16) {
      const __mmask16 mk = mask16(hd - i);
      a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + i), _mm512_maskz_loadu_ps(mk, k + i), a);
    }
  }
  return _mm512_reduce_add_ps(a);
}

// ---- attention: each row's query heads of one kv head over the row's context ----
// A task is (row, kv head, share of the row's keys): an online softmax whose state -- per query head the running
// max, the sum of exp and the weighted sum of values -- is written out normalized when the task has the whole
// row, or as a partial that a merge phase combines (log-sum-exp) when the row's keys were split among tasks
// because there are too few rows x kv heads to keep every thread busy.

struct SoftmaxState {  // one task's state for up to kMaxGroup query heads
  float best[kMaxGroup], total[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
};

// The generic path: any head dim, either storage type.
template <class T>
inline void attend_keys(const T* q, const T* kp, const T* vp, int nkv, int g, const int64_t* row, int len, int hd,
                        int group, float scale, SoftmaxState& st) {
  alignas(64) float score[kMaxGroup][kKeys];
  for (int j0 = 0; j0 < len; j0 += kKeys) {
    const int nj = std::min(kKeys, len - j0);
    for (int j = 0; j < nj; ++j) {
      const T* key = kp + (row[j0 + j] * nkv + g) * hd;
      for (int h = 0; h < group; ++h) score[h][j] = dot_head(q + h * hd, key, hd) * scale;
    }
    for (int h = 0; h < group; ++h) {
      float top = st.best[h];
      for (int j = 0; j < nj; ++j) top = std::max(top, score[h][j]);
      const float fix = std::exp(st.best[h] - top);  // rescales what earlier chunks summed (0 on the first)
      st.best[h] = top;
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < nj; j += 16) {
        const __mmask16 mk = mask16(nj - j);
        const __m512 p = _mm512_maskz_mov_ps(
            mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, &score[h][j]), _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(&score[h][j], mk, p);
        sum = _mm512_add_ps(sum, p);
      }
      st.total[h] = st.total[h] * fix + _mm512_reduce_add_ps(sum);
      for (int i = 0; i < hd; ++i) st.acc[h][i] *= fix;
    }
    for (int j = 0; j < nj; ++j) {
      const T* val = vp + (row[j0 + j] * nkv + g) * hd;
      for (int i = 0; i < hd; i += 16) {
        const __mmask16 mk = mask16(hd - i);
        const __m512 v = load16(val + i, mk);
        for (int h = 0; h < group; ++h)
          _mm512_mask_storeu_ps(&st.acc[h][i], mk, _mm512_fmadd_ps(_mm512_set1_ps(score[h][j]), v,
                                                                   _mm512_maskz_loadu_ps(mk, &st.acc[h][i])));
      }
    }
  }
}

// Sixteen vectors in, one out: lane j = the sum of v[j]'s lanes (a transposing tree: 15 adds, not 16 reductions)
struct SumTree {
  __m512 a[8];
  int n = 0;
  inline void push2(__m512 x, __m512 y) {  // v[2i], v[2i + 1]: halves added, x's 8 partials then y's
    a[n++] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  inline __m512 sums() const {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // block k of b[i]: 4 partials of v[4i + k]
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // block k of c[i]: 2 partials of v[8i + k], then 2 of v[8i + 4 + k]
      c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    // lane 4k + t of d holds v[4t + k]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, d);
  }
};

// bf16, head dim HD (64 or 128), HS query heads of a group: queries and value sums kept in registers, the scores
// of 16 keys at a time summed by one tree.
template <int HD, int HS>
inline void attend_heads_bf16(const bf16* q, const bf16* kp, const bf16* vp, int nkv, int g, const int64_t* row,
                              int len, float scale, float* best, float* total, float (*acc)[kMaxHeadDim]) {
  constexpr int QV = HD / 32, AV = HD / 16;
  __m512bh qv[HS][QV];
  __m512 av[HS][AV];
  for (int h = 0; h < HS; ++h) {
    for (int i = 0; i < QV; ++i) qv[h][i] = (__m512bh)_mm512_loadu_si512(q + h * HD + 32 * i);
    for (int i = 0; i < AV; ++i) av[h][i] = _mm512_loadu_ps(&acc[h][16 * i]);
  }
  alignas(64) float pbuf[HS][16];
  const __m512 zero = _mm512_setzero_ps();
  for (int j0 = 0; j0 < len; j0 += 16) {
    const int nj = std::min(16, len - j0);
    const __mmask16 real = mask16(nj);
    const bf16* key[16];
    for (int j = 0; j < 16; ++j) key[j] = kp + (row[j0 + std::min(j, nj - 1)] * nkv + g) * HD;
    for (int h = 0; h < HS; ++h) {
      SumTree tree;
      for (int j = 0; j < 16; j += 2) {
        __m512 x = zero, y = zero;
        for (int i = 0; i < QV; ++i) {
          x = _mm512_dpbf16_ps(x, qv[h][i], (__m512bh)_mm512_loadu_si512(key[j] + 32 * i));
          y = _mm512_dpbf16_ps(y, qv[h][i], (__m512bh)_mm512_loadu_si512(key[j + 1] + 32 * i));
        }
        tree.push2(x, y);
      }
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), real,
                                          _mm512_mul_ps(tree.sums(), _mm512_set1_ps(scale)));
      const float top = std::max(best[h], _mm512_reduce_max_ps(s));
      const float fix = std::exp(best[h] - top);  // 0 on the first keys
      best[h] = top;
      const __m512 p = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
      total[h] = total[h] * fix + _mm512_reduce_add_ps(p);
      _mm512_store_ps(pbuf[h], p);
      for (int i = 0; i < AV; ++i) av[h][i] = _mm512_mul_ps(av[h][i], _mm512_set1_ps(fix));
    }
    for (int j = 0; j < nj; ++j) {
      const bf16* val = vp + (row[j0 + j] * nkv + g) * HD;
      __m512 v[AV];
      for (int i = 0; i < AV; ++i) v[i] = load16(val + 16 * i, 0xffff);
      for (int h = 0; h < HS; ++h) {
        const __m512 pj = _mm512_set1_ps(pbuf[h][j]);
        for (int i = 0; i < AV; ++i) av[h][i] = _mm512_fmadd_ps(pj, v[i], av[h][i]);
      }
    }
  }
  for (int h = 0; h < HS; ++h)
    for (int i = 0; i < AV; ++i) _mm512_storeu_ps(&acc[h][16 * i], av[h][i]);
}

template <int HD>
inline void attend_keys_bf16(const bf16* q, const bf16* kp, const bf16* vp, int nkv, int g, const int64_t* row,
                             int len, int group, float scale, SoftmaxState& st) {
  constexpr int kHeads = HD == 64 ? 4 : 2;  // query heads whose queries and sums fit the registers at once
  for (int h0 = 0; h0 < group; h0 += kHeads) {
    const bf16* qh = q + h0 * HD;
    float* b = st.best + h0;
    float* t = st.total + h0;
    float(*a)[kMaxHeadDim] = st.acc + h0;
    switch (std::min(kHeads, group - h0)) {
      case 1: attend_heads_bf16<HD, 1>(qh, kp, vp, nkv, g, row, len, scale, b, t, a); break;
      case 2: attend_heads_bf16<HD, 2>(qh, kp, vp, nkv, g, row, len, scale, b, t, a); break;
      case 3: attend_heads_bf16<HD, 3>(qh, kp, vp, nkv, g, row, len, scale, b, t, a); break;
      default: attend_heads_bf16<HD, (HD == 64 ? 4 : 2)>(qh, kp, vp, nkv, g, row, len, scale, b, t, a);
    }
  }
}

// How many tasks share each row's keys: enough tasks for every thread when rows x kv heads are few, never
// shares of fewer than 64 keys, at most kMaxSplit.
constexpr int kMaxSplit = 8;
inline int attention_split(int rows, int nkv, int max_len, int threads) {
  const int tasks = rows * nkv;
  if (tasks >= 2 * threads) return 1;
  const int want = (4 * threads + tasks - 1) / tasks;
  return std::max(1, std::min({want, kMaxSplit, (max_len + 63) / 64}));
}

template <class T>
inline void attention(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out, int split,
                      float* partials) {
  const int hd = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv;
  const int width = (nq + 2 * nkv) * hd;
  const int64_t part = int64_t(group) * (hd + 2);  // floats of one task's partial: best, total, acc per head
  const T* kp = static_cast<const T*>(ly.k_pool);
  const T* vp = static_cast<const T*>(ly.v_pool);
#pragma omp for schedule(dynamic, 1)
  for (int t = 0; t < st.rows * nkv * split; ++t) {
    const int m = t / (nkv * split), g = t / split % nkv, c = t % split;
    const int len = int(st.starts[m + 1] - st.starts[m]);
    const int share = (len + split - 1) / split, j0 = std::min(len, c * share), j1 = std::min(len, j0 + share);
    const int64_t* row = st.slots + st.starts[m] + j0;
    const T* q = qkv + int64_t(m) * width + g * group * hd;
    SoftmaxState s;
    for (int h = 0; h < group; ++h) {
      s.best[h] = -INFINITY;
      s.total[h] = 0.0f;
      for (int i = 0; i < hd; ++i) s.acc[h][i] = 0.0f;
    }
    if constexpr (std::is_same_v<T, bf16>) {
      if (hd == 64) attend_keys_bf16<64>(q, kp, vp, nkv, g, row, j1 - j0, group, md.scale, s);
      else if (hd == 128) attend_keys_bf16<128>(q, kp, vp, nkv, g, row, j1 - j0, group, md.scale, s);
      else attend_keys(q, kp, vp, nkv, g, row, j1 - j0, hd, group, md.scale, s);
    } else {
      attend_keys(q, kp, vp, nkv, g, row, j1 - j0, hd, group, md.scale, s);
    }
    if (split == 1) {
      for (int h = 0; h < group; ++h) {
        T* o = out + int64_t(m) * nq * hd + (g * group + h) * hd;
        const __m512 inv = _mm512_set1_ps(1.0f / s.total[h]);
        for (int i = 0; i < hd; i += 16) {
          const __mmask16 mk = mask16(hd - i);
          store16(o + i, rnd16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, &s.acc[h][i]), inv)), mk);
        }
      }
    } else {
      float* p = partials + int64_t(t) * part;
      for (int h = 0; h < group; ++h) {
        p[h * (hd + 2)] = s.best[h];
        p[h * (hd + 2) + 1] = s.total[h];
        std::memcpy(p + h * (hd + 2) + 2, s.acc[h], sizeof(float) * hd);
      }
    }
  }
  if (split == 1) return;
#pragma omp for schedule(static)
  for (int t = 0; t < st.rows * nkv; ++t) {  // merge a row's shares: rescale each to the largest max, add
    const int m = t / nkv, g = t % nkv;
    for (int h = 0; h < group; ++h) {
      const float* p0 = partials + int64_t(t) * split * part + h * (hd + 2);
      float top = -INFINITY;
      for (int c = 0; c < split; ++c) top = std::max(top, p0[c * part]);
      float total = 0.0f;
      alignas(64) float acc[kMaxHeadDim] = {};
      for (int c = 0; c < split; ++c) {
        const float* p = p0 + c * part;
        if (p[1] == 0.0f) continue;  // an empty share
        const float w = std::exp(p[0] - top);
        total += w * p[1];
        for (int i = 0; i < hd; ++i) acc[i] += w * p[2 + i];
      }
      T* o = out + int64_t(m) * nq * hd + (g * group + h) * hd;
      const __m512 inv = _mm512_set1_ps(1.0f / total);
      for (int i = 0; i < hd; i += 16) {
        const __mmask16 mk = mask16(hd - i);
        store16(o + i, rnd16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, &acc[i]), inv)), mk);
      }
    }
  }
}

// act = round(round(silu(gate)) * up), gate and up the two halves of each row of gu
template <class T>
inline void silu_mul(const T* gu, int rows, int inter, T* act) {
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m) {
    const T* g = gu + int64_t(m) * 2 * inter;
    for (int i = 0; i < inter; i += 16) {
      const __mmask16 mk = mask16(inter - i);
      const __m512 x = load16(g + i, mk);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 silu = rnd16<T>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store16(act + int64_t(m) * inter + i, rnd16<T>(_mm512_mul_ps(silu, load16(g + inter + i, mk))), mk);
    }
  }
}

// A step's intermediates, carved from one buffer the caller owns (rs_scratch_bytes says how big)
struct Scratch {
  void* xn;    // T [rows, hidden]: a norm's output
  void* qkv;   // T [rows, (heads + 2 kv_heads) head_dim]
  void* attn;  // T [rows, heads head_dim]
  void* gu;    // T [rows, 2 inter]
  void* act;   // T [rows, inter]
  QuantRows qx;  // a quantized product's input: [rows, widest k]
  float* partials;  // attention's split shares: [tasks, group, head_dim + 2]
};

Scratch carve(const Model& md, int64_t rows, void* base, int64_t* total) {
  const int64_t es = md.bf16 ? 2 : 4, qkv = int64_t(md.heads + 2 * md.kv_heads) * md.head_dim;
  const int64_t wide = std::max<int64_t>({md.hidden, md.inter, int64_t(md.heads) * md.head_dim});
  // a split happens only with fewer than 2 tasks per thread, so fewer than 2 x threads x kMaxSplit shares
  const int64_t shares = 2 * int64_t(omp_get_max_threads()) * kMaxSplit;
  const int64_t sizes[9] = {rows * md.hidden * es, rows * qkv * es, rows * md.heads * md.head_dim * es,
                            rows * 2 * md.inter * es, rows * md.inter * es, rows * wide,
                            rows * (wide / kBlock) * 4, rows * (wide / kBlock) * 4,
                            shares * (md.heads / md.kv_heads) * (md.head_dim + 2) * 4};
  char* p = static_cast<char*>(base);
  void* parts[9];
  int64_t off = 0;
  for (int i = 0; i < 9; ++i) {
    parts[i] = p ? p + off : nullptr;
    off += (sizes[i] + 63) / 64 * 64;
  }
  if (total) *total = off;
  return {parts[0], parts[1], parts[2], parts[3], parts[4],
          {static_cast<int8_t*>(parts[5]), static_cast<float*>(parts[6]), static_cast<int32_t*>(parts[7])},
          static_cast<float*>(parts[8])};
}

template <class T>
void step(const Model& md, const Step& st) {
  const int rows = st.rows, H = md.hidden, I = md.inter;
  const int64_t qkv_w = int64_t(md.heads + 2 * md.kv_heads) * md.head_dim;
  const Scratch s = carve(md, rows, st.scratch, nullptr);
  T* h = static_cast<T*>(st.h);
  T* xn = static_cast<T*>(s.xn);
  T* qkv = static_cast<T*>(s.qkv);
  T* at = static_cast<T*>(s.attn);
  T* gu = static_cast<T*>(s.gu);
  T* act = static_cast<T*>(s.act);
  const bool amx = md.amx != 0;
  int max_len = 0;
  for (int m = 0; m < rows; ++m) max_len = std::max(max_len, int(st.starts[m + 1] - st.starts[m]));
  const int split = attention_split(rows, md.kv_heads, max_len, omp_get_max_threads());
  auto into = [](T* y, int64_t width) {  // a product's outputs stored as they are
    return [=](int m, int n, __m512 v, __mmask16 mk) { store16(y + m * width + n, v, mk); };
  };
  auto onto_h = [=](int m, int n, __m512 v, __mmask16 mk) {  // h = round(h + y): the residual
    T* r = h + int64_t(m) * H + n;
    store16(r, rnd16<T>(_mm512_add_ps(load16(r, mk), v)), mk);
  };
  // y = x W^T through emit: x quantized first where W is (every thread takes part in both phases)
  auto linear = [&](const T* x, int n_rows, const Linear& lin, auto&& emit) {
    if (lin.format != kDense) quantize_rows(x, n_rows, lin.k, s.qx);
    product(x, s.qx, n_rows, lin, amx, emit);
  };
#pragma omp parallel
  {
    for (int l = 0; l < md.layers; ++l) {
      const Layer& ly = md.layer[l];
      rms_norm(h, static_cast<const T*>(ly.ln1), rows, H, md.eps, xn);
      linear(xn, rows, ly.qkv, into(qkv, qkv_w));
#pragma omp barrier
      rope_and_store(md, ly, st, qkv);
      attention(md, ly, st, qkv, at, split, s.partials);
      linear(at, rows, ly.o, onto_h);
#pragma omp barrier
      rms_norm(h, static_cast<const T*>(ly.ln2), rows, H, md.eps, xn);
      linear(xn, rows, ly.gate_up, into(gu, 2 * int64_t(I)));
#pragma omp barrier
      silu_mul(gu, rows, I, act);
      linear(act, rows, ly.down, onto_h);
#pragma omp barrier
    }
    // the rows that want logits: the final norm, then the output projection (rounded to T as eager, then fp32)
#pragma omp for schedule(static)
    for (int r = 0; r < st.logit_rows; ++r) std::memcpy(xn + int64_t(r) * H, h + st.logit_row[r] * H, sizeof(T) * H);
    rms_norm(xn, static_cast<const T*>(md.norm), st.logit_rows, H, md.eps, xn);
    linear(xn, st.logit_rows, md.lm_head, [&](int m, int n, __m512 v, __mmask16 mk) {
      _mm512_mask_storeu_ps(st.logits + int64_t(m) * md.vocab + n, mk, v);
    });
    release_tiles();
  }
}

// y = x W^T (+ b) alone, for tests: x T [rows, k], y T [rows, n] (as the step computes it inside a layer)
template <class T>
void linear_alone(const Linear& lin, const T* x, int rows, T* y, bool amx, void* scratch) {
  const int64_t blocks = lin.k / kBlock;
  char* p = static_cast<char*>(scratch);
  const QuantRows qx{reinterpret_cast<int8_t*>(p), reinterpret_cast<float*>(p + rows * int64_t(lin.k)),
                     reinterpret_cast<int32_t*>(p + rows * int64_t(lin.k) + rows * blocks * 4)};
#pragma omp parallel
  {
    if (lin.format != kDense) quantize_rows(x, rows, lin.k, qx);
    product(x, qx, rows, lin, amx, [&](int m, int n, __m512 v, __mmask16 mk) {
      store16(y + int64_t(m) * lin.n + n, v, mk);
    });
    release_tiles();
  }
}

// One layer's attention alone, for tests: qkv T [rows, (heads + 2 kv_heads) head_dim] after RoPE (its k and v
// already in the pool), out T [rows, heads head_dim]; scratch as for a step of ``rows``
template <class T>
void attention_alone(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out) {
  const Scratch s = carve(md, st.rows, st.scratch, nullptr);
  int max_len = 0;
  for (int m = 0; m < st.rows; ++m) max_len = std::max(max_len, int(st.starts[m + 1] - st.starts[m]));
  const int split = attention_split(st.rows, md.kv_heads, max_len, omp_get_max_threads());
#pragma omp parallel
  attention(md, ly, st, qkv, out, split, s.partials);
}

// 0, or why a model cannot run here: 1 its heads, 2 a linear layer's format or shape
int32_t check(const Model& md) {
  if (md.heads % md.kv_heads || md.heads / md.kv_heads > kMaxGroup || md.head_dim > kMaxHeadDim) return 1;
  auto bad = [](const Linear& lin) {
    return lin.format == kDense ? lin.k % 2 != 0 : (lin.format != kQ8 && lin.format != kQ4) || lin.k % kBlock != 0;
  };
  for (int l = 0; l < md.layers; ++l) {
    const Layer& ly = md.layer[l];
    if (bad(ly.qkv) || bad(ly.o) || bad(ly.gate_up) || bad(ly.down)) return 2;
  }
  return bad(md.lm_head) ? 2 : 0;
}

}  // namespace

extern "C" {

int64_t rs_scratch_bytes(const Model* md, int32_t rows) {
  int64_t total = 0;
  carve(*md, rows, nullptr, &total);
  return total;
}

int32_t rs_abi_version() { return 1; }

// Whether AMX tile products can be used in this process (asks the kernel for the tile state once).
int32_t rs_request_amx() { return request_amx() ? 1 : 0; }

int32_t rs_check(const Model* md) { return check(*md); }

// One layer's attention (tests)
void rs_attention(const Model* md, int32_t layer, const Step* st, const void* qkv, void* out) {
  if (md->bf16) {
    attention_alone(*md, md->layer[layer], *st, static_cast<const uint16_t*>(qkv), static_cast<uint16_t*>(out));
  } else {
    attention_alone(*md, md->layer[layer], *st, static_cast<const float*>(qkv), static_cast<float*>(out));
  }
}

// One product (tests): scratch of rows * (k + k / 32 * 8) bytes for a quantized W
void rs_linear(const Linear* lin, int32_t bf16, const void* x, int32_t rows, void* y, int32_t amx, void* scratch) {
  if (bf16) {
    linear_alone(*lin, static_cast<const uint16_t*>(x), rows, static_cast<uint16_t*>(y), amx != 0, scratch);
  } else {
    linear_alone(*lin, static_cast<const float*>(x), rows, static_cast<float*>(y), amx != 0, scratch);
  }
}

// One decode step; returns 0, or check()'s code for a model this kernel does not take.
int32_t rs_decode_step(const Model* md, const Step* st) {
  if (const int32_t code = check(*md)) return code;
  if (md->bf16) {
    step<bf16>(*md, *st);
  } else {
    step<float>(*md, *st);
  }
  return 0;
}

}
