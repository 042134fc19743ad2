// Register tiles of dense (bf16 / fp32) weights, AMX's tile product, and what every tile shares (Acc, the tile
// tables, software prefetch): the pieces products.h puts together into a linear layer.
#pragma once

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>

#include "abi.h"
#include "simd.h"

namespace rs {

// ---- products: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) ----
// Dense weights are packed once (kernels/cpu_native.py) into blocks of 16 output rows,
//   bf16: [n/16][k/2][16][2] (per k-pair, what one dpbf16 takes per output lane)    fp32: [n/16][k][16],
// so each lane of an accumulator is one output (no horizontal sums) and each weight vector, loaded once, serves a
// tile of up to kRowTile rows of x. A thread owns a contiguous share of the blocks. The same layout serves AVX2
// (lane i of a V16 is output i there too).

// A register tile: up to kRowTile rows of x x kColTile blocks of 16 outputs. AVX-512 holds 4 x 4 accumulators in
// its 32 registers. AVX2 has 16, each half as wide: a tile there is one block of up to 5 rows (10 accumulators,
// the weights' 4 registers and one broadcast) or, for a few rows, two blocks (more weight loads in flight, where
// they stream from memory; fp32's unwidened weights keep 4 rows x 2 blocks busy, measured). The quantized tiles
// (kQRowTile x kQColTile; a single row of 8-bit weights kQ8Cols blocks) share Acc.
constexpr int kRowTile = RS_AVX512 ? 4 : 5, kColTile = RS_AVX512 ? 4 : 2;
// AVX-512 bf16 products of 5 rows or more (where AMX tiles are not granted): tiles of up to 8 rows x 3 blocks (24
// accumulators), so that the weights stream from memory for half as many row tiles -- 8 rows in one pass over
// them, not two. On Zen 4, a 1B shape's step of products 1.22x faster at 8 rows, 1.08x at 32 (8 x 2: 1.16x, 1.04x;
// benchmarks/kernel_ab.py --shape llama-3.2-1b --kinds BF16 --rows 8,32)
constexpr int kTallRows = 8, kTallCols = 3;
constexpr int kQRowTile = 4, kQColTile = 2, kQ8Cols = 4;
using Acc = V16[std::max({kRowTile, kQRowTile, kTallRows})][std::max({kColTile, kQColTile, kQ8Cols})];

struct TileShape {
  int tiles, cols;  // row tiles (tile i: rows rows * i / tiles .. rows * (i + 1) / tiles), blocks of W per tile
};

// The tiles for a product of ``rows`` rows of T: as few row tiles as the shape allows, their sizes differing by
// one at most (32 rows on AVX2: 5 5 5 5 4 4 4, not 5 5 5 5 5 5 2; 8 rows: 4 4)
template <class T>
inline TileShape tile_shape(int rows) {
  if constexpr (RS_AVX512 && std::is_same_v<T, bf16>)
    if (rows > kRowTile) return {(rows + kTallRows - 1) / kTallRows, kTallCols};
  const bool two = RS_AVX512 || rows == 1 || (std::is_same_v<T, float> && rows <= 8);
  const int most = two ? std::min(kRowTile, 4) : kRowTile;
  return {(rows + most - 1) / most, two ? kColTile : 1};
}

// A tile sums into local registers (a[MR][NB]: the vector types alias anything, so sums kept in the caller's
// Acc would go through memory on every step) and hands them over at the end.
template <int MR, int NB>
inline void zero(V16 (&a)[MR][NB]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) a[r][j] = zero16();
}

template <int MR, int NB>
inline void hand_over(const V16 (&a)[MR][NB], Acc& acc) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = a[r][j];
}

// A tile that reads W from memory (``lead``: the first row tile) asks for the weights it will read kAhead bytes on
// in each stream of W (``bytes`` on from p as it reads them): while a tile computes, the hardware's prefetchers
// alone leave the memory idle. Where it pays, measured on Zen 3 (benchmarks/kernel_ab.py, layers of 2048-8192 x
// 8192 cycled out of the caches): dense tiles of a product of several rows (bf16 4 rows 1.22-1.34x, 8 rows
// 1.13-1.17x; one row streams at the memory's pace already: bf16 1.00x, float32 0.8-0.9x with it), quantized tiles
// of 4-bit to 6-bit formats in a product of up to 4 rows (one row: Q4_0 1.10x, Q5_0 1.07x, Q4_K 1.22-1.33x, Q5_K
// 1.31x, Q6_K 1.30x; from 8 rows on they compute longer than their weights take to come: 0.95-1.04x with it);
// not Q8_0's bytes (one row 0.87-0.99x with it). 2, 4 and 8 KB ahead alike.
constexpr int kAhead = 4096;
inline void ahead(const void* p, int bytes) {
  for (int i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + kAhead + i);
}

// k-pair p of NB blocks of bf16 weights (what both bf16 tiles meet x with), asking ahead for what follows
template <int NB>
inline void weight_pairs(const bf16* w, int64_t bstride, int p, bool lead, BF32 (&wv)[NB]) {
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    if (lead) ahead(w + j * bstride + p * 32, 64);
    wv[j] = load_bf32(w + j * bstride + p * 32);
  }
}

// AVX-512 BF16: one vdpbf16ps per block, row and k-pair of x (x read as bf16 pairs)
template <int MR, int NB>
void tile_bf16(const bf16* x, int64_t ldx, int k, const bf16* w, int64_t bstride, Acc& acc, bool lead) {
  V16 a[MR][NB];
  zero<MR, NB>(a);
  const int pairs = k / 2;
  for (int p = 0; p < pairs; ++p) {
    BF32 wv[NB];
    weight_pairs(w, bstride, p, lead, wv);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const BF32 xb = pair_bf32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) a[r][j] = dot_bf16(a[r][j], wv[j], xb);
    }
  }
  hand_over<MR, NB>(a, acc);
}

// AVX2 has no bf16 dot product: x comes widened to fp32 (widen_rows, once per product), each weight pair is widened
// once per tile and each x value is one broadcast load -- where a bf16 pair of x cost a scalar shift and two
// broadcasts per row. The odd value first, then the even one, as dot_bf16 sums them.
template <int MR, int NB>
void tile_wide(const float* x, int64_t ldx, int k, const bf16* w, int64_t bstride, Acc& acc, bool lead) {
  V16 a[MR][NB];
  zero<MR, NB>(a);
  const int pairs = k / 2;
  for (int p = 0; p < pairs; ++p) {
    BF32 wv[NB];
    weight_pairs(w, bstride, p, lead, wv);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V16 xo = set1(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) a[r][j] = fmadd(odds(wv[j]), xo, a[r][j]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V16 xe = set1(x[r * ldx + 2 * p]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) a[r][j] = fmadd(evens(wv[j]), xe, a[r][j]);
    }
  }
  hand_over<MR, NB>(a, acc);
}

template <int MR, int NB>
void tile_f32(const float* x, int64_t ldx, int k, const float* w, int64_t bstride, Acc& acc, bool lead) {
  V16 a[MR][NB];
  zero<MR, NB>(a);
  for (int i = 0; i < k; ++i) {
    V16 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      if (lead) ahead(w + j * bstride + i * 16, 64);
      wv[j] = loadu(w + j * bstride + i * 16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V16 xb = set1(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) a[r][j] = fmadd(wv[j], xb, a[r][j]);
    }
  }
  hand_over<MR, NB>(a, acc);
}

// x's rows as fp32 (exact), every thread taking its share
template <class T>
inline void widen_rows(const T* x, int rows, int k, float* out) {
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m)
    for (int i = 0; i < k; i += 16) {
      const M16 mk = mask16(k - i);
      store16(out + int64_t(m) * k + i, load16(x + int64_t(m) * k + i, mk), mk);
    }
}

// A function per tile shape, table[mr - 1][nb - 1] = Tiles::fn<mr, nb>() for every shape up to R x C
template <class Tiles, int R, int C>
struct TileTable {
  using Fn = typename Tiles::Fn;
  template <int MR, int... NB>
  static constexpr std::array<Fn, C> row(std::integer_sequence<int, NB...>) {
    return {Tiles::template fn<MR, NB + 1>()...};
  }
  template <int... MR>
  static constexpr std::array<std::array<Fn, C>, R> rows(std::integer_sequence<int, MR...>) {
    return {row<MR + 1>(std::make_integer_sequence<int, C>())...};
  }
  static Fn at(int mr, int nb) {
    static constexpr auto table = rows(std::make_integer_sequence<int, R>());
    return table[mr - 1][nb - 1];
  }
};

// The dense tiles for x's type (X: what the tile reads of x) and W's
template <class X, class W>
struct DenseTiles {
  using Fn = void (*)(const X*, int64_t, int, const W*, int64_t, Acc&, bool);
  template <int MR, int NB>
  static constexpr Fn fn() {
    if constexpr (std::is_same_v<W, float>) return &tile_f32<MR, NB>;
    else if constexpr (std::is_same_v<X, float>) return &tile_wide<MR, NB>;
    else return &tile_bf16<MR, NB>;
  }
};

template <class X, class W>
typename DenseTiles<X, W>::Fn tile_for(int mr, int nb) {
  if constexpr (RS_AVX512 && std::is_same_v<X, bf16> && std::is_same_v<W, bf16>)
    if (mr > kRowTile) return TileTable<DenseTiles<X, W>, kTallRows, kTallCols>::at(mr, nb);
  return TileTable<DenseTiles<X, W>, kRowTile, kColTile>::at(mr, nb);
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

constexpr int kAmxRowChunk = 128;
constexpr int64_t kAmxWeightChunk = 1 << 20;  // bytes of W a pass over the rows takes (beside a row chunk, in L2)

template <class F>
inline void product_amx(const bf16* x, int rows, const Linear& lin, const bf16* w, int b0, int b1, F&& out) {
  const int64_t bstride = int64_t(lin.k) * 16, lda = int64_t(lin.k) * 2;
  alignas(64) float c[kColTile][16][16];
  // this thread's share of W in chunks of up to kAmxWeightChunk bytes, each passing over the rows in chunks of
  // kAmxRowChunk: a row chunk and a W chunk stay in L2 while every block of the one meets every row of the other
  // (a prefill's x would otherwise stream from memory once per block group, and a share of W larger than L2 --
  // an MLP's 3072 x 576 halved -- once per row chunk)
  const int span = std::max<int>(kColTile, int(kAmxWeightChunk / (bstride * 2)) / kColTile * kColTile);
  for (int w0 = b0; w0 < b1; w0 += span)
  for (int m0 = 0; m0 < rows; m0 += kAmxRowChunk)
  for (int b = w0; b < std::min(b1, w0 + span); b += kColTile) {
    const int nb = std::min(kColTile, std::min(b1, w0 + span) - b);
    const bf16* wb = w + b * bstride;
    for (int m = m0; m < std::min(rows, m0 + kAmxRowChunk); m += 16) {
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

// Whether x is widened before a dense product: bf16 without AVX-512's bf16 dot, off the AMX path, two rows or more
// (a single row's product streams the weights from memory: its pairs of x cost nothing there)
template <class T>
inline bool widens_x(int rows, const Linear& lin, bool amx) {
  return std::is_same_v<T, bf16> && !RS_AVX512 && rows > 1 && lin.format == kDense &&
         !(amx && kHaveAmx && lin.k % 32 == 0);
}

}  // namespace rs
