// Linear layers: y = x W^T (+ b) for a few rows of x, each thread computing its share of W's output rows.
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
constexpr int kQRowTile = 4, kQColTile = 2, kQ8Cols = 4;
using Acc = V16[std::max(kRowTile, kQRowTile)][std::max({kColTile, kQColTile, kQ8Cols})];

struct TileShape {
  int tiles, cols;  // row tiles (tile i: rows rows * i / tiles .. rows * (i + 1) / tiles), blocks of W per tile
};

// The tiles for a product of ``rows`` rows of T: as few row tiles as the shape allows, their sizes differing by
// one at most (32 rows on AVX2: 5 5 5 5 4 4 4, not 5 5 5 5 5 5 2; 8 rows: 4 4)
template <class T>
inline TileShape tile_shape(int rows) {
  const bool two = RS_AVX512 || rows == 1 || (std::is_same_v<T, float> && rows <= 8);
  const int most = two ? std::min(kRowTile, 4) : kRowTile;
  return {(rows + most - 1) / most, two ? kColTile : 1};
}

// A tile sums into local registers (a[MR][NB]: the vector types alias anything, so sums kept in the caller's
// Acc would go through memory on every step) and hands them over at the end.
template <int MR, int NB>
inline void zero(V16 (&a)[MR][NB]) {
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) a[r][j] = zero16();
}

template <int MR, int NB>
inline void hand_over(const V16 (&a)[MR][NB], Acc& acc) {
#pragma GCC unroll 6
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

// AVX-512 BF16: one vdpbf16ps per block, row and k-pair of x (x read as bf16 pairs)
template <int MR, int NB>
void tile_bf16(const bf16* x, int64_t ldx, int k, const bf16* w, int64_t bstride, Acc& acc, bool lead) {
  V16 a[MR][NB];
  zero<MR, NB>(a);
  const int pairs = k / 2;
  for (int p = 0; p < pairs; ++p) {
    BF32 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      if (lead) ahead(w + j * bstride + p * 32, 64);
      wv[j] = load_bf32(w + j * bstride + p * 32);
    }
#pragma GCC unroll 6
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
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      if (lead) ahead(w + j * bstride + p * 32, 64);
      wv[j] = load_bf32(w + j * bstride + p * 32);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const V16 xo = set1(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) a[r][j] = fmadd(odds(wv[j]), xo, a[r][j]);
    }
#pragma GCC unroll 6
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
#pragma GCC unroll 6
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

template <class F>
inline void product_amx(const bf16* x, int rows, const Linear& lin, const bf16* w, int b0, int b1, F&& out) {
  const int64_t bstride = int64_t(lin.k) * 16, lda = int64_t(lin.k) * 2;
  alignas(64) float c[kColTile][16][16];
  // rows in chunks that stay in L2 while every block of this thread's share passes over them (a prefill's x would
  // otherwise stream from memory once per block group)
  for (int m0 = 0; m0 < rows; m0 += kAmxRowChunk)
  for (int b = b0; b < b1; b += kColTile) {
    const int nb = std::min(kColTile, b1 - b);
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

// ---- quantized products ----
// Weights in blocks of 16 output rows x 32 k (packed by model/native_decode.py), each 32 k of a row with a scale d
// (and for q4, and q8 where ``zero`` is given, an offset m): w = d q + m.
//   q8: 8 groups of 4 k, each 16 lanes x 4 bytes of q + 128 (u8)                                  512 bytes
//   q4: 4 groups of 8 k, each 16 lanes x 4 bytes: low nibble q[k0 + b], high nibble q[k0 + 4 + b]  256 bytes
//   scale: q8 fp32, q4 fp16 [n/16][k/32][16] (d); zero: q4 fp16, q8 fp32 or null, the same layout (m)
//   q8h: q8's bytes with fp16 scales and no offsets (GGUF's Q8_0: its own d, 8.5 bits a weight, not q8's 9)
//   q8g16: q8's bytes with a scale (and, where ``zero`` is given, an offset) per 16 k: fp32 [n/16][k/16][16]
// and GGUF's K-quants in their own bits (a scale per 32 or 16 k as an integer times its super-block's float):
//   q4k: q4's nibbles; scale, zero: u8 [n/16][k/32][16] (sc, mn); super_scale, super_zero: fp16 (the file's)
//        [n/16][k/256][16] (d, -dmin): w = d sc q - dmin mn                                      256 bytes
//   q6k: q4's nibbles of u = q + 32 (0..63), then 2 x 16 lanes x 4 bytes of u's top two bits for groups 2p, 2p + 1
//        (byte b of a lane: bits 4s + 2h, 4s + 2h + 1 the top of group 2p + s's k0 + 4h + b); scale: i8
//        [n/16][k/16][16] (sc); super_scale: fp16 [n/16][k/256][16] (d): w = d sc (u - 32)            384 bytes
//   q5k: q4k with q 0..31: q4's nibbles, then 16 lanes x 4 bytes of fifth bits (byte b of a lane: bit 2g + h the
//        fifth bit of group g's k0 + 4h + b); scales as q4k                                           320 bytes
//   q5: GGUF's Q5_0 / Q5_1 (q 0..31, w = d q + m per 32 k): q5k's bytes with q4's fp16 d and m        320 bytes
// The activations are quantized per row and 32 k to int8 (xq = round(x / dx), dx = max|x| / 127, and the sums of
// xq over each 16), as llama.cpp does for its quantized CPU products, so a block's dot product is integer (VNNI's
// u8 x s8 dpbusd; AVX2's maddubs, simd.h):
//   sum_k x w = dx (d sum_k q xq + m sum_k xq);  q8 stores q + 128: sum_k (q + 128) xq - 128 sum_k xq (kQ8Offset).
// For K-quant layers, per row and 256 k (one dx per super-block, as llama.cpp's Q8_K; per_super_block), so that
// AVX2 sums a super-block in integers (tile_ksuper); AVX-512 reads the same dx for each of its 8 blocks.

struct QuantRows {  // a product's input rows, quantized (scratch)
  int8_t* q;        // [rows, k]
  float* d;         // [rows, k / 32]
  int32_t* sum;     // [rows, k / 16]
};

// K-quant layers' activations take one scale per super-block (256 k, as llama.cpp's Q8_K): their products sum a
// super-block in integers (tile_ksuper); every other format one per 32 k
inline bool per_super_block(const Linear& lin) {
  if (lin.format != kParts) return k_quant(lin.format);
  const Linear* part = static_cast<const Linear*>(lin.w);
  for (int i = 0; i < lin.parts; ++i)
    if (!k_quant(part[i].format)) return false;
  return true;
}

template <class T>
inline void quantize_rows(const T* x, int rows, int k, int span, const QuantRows& out) {  // span: k per scale
  const int blocks = k / kBlock, per = span / kBlock;
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m)
    for (int b0 = 0; b0 < blocks; b0 += per) {
      V16 top = zero16();
      for (int b = b0; b < b0 + per; ++b) {
        const int64_t at = int64_t(m) * k + b * kBlock;
        top = vmax(top, vmax(vabs(load16(x + at, 0xffff)), vabs(load16(x + at + 16, 0xffff))));
      }
      const float amax = reduce_max(top);
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      for (int b = b0; b < b0 + per; ++b) {
        const int64_t at = int64_t(m) * k + b * kBlock;
        quantize32(load16(x + at, 0xffff), load16(x + at + 16, 0xffff), inv, out.q + at,
                   out.sum + (int64_t(m) * blocks + b) * 2);
        out.d[int64_t(m) * blocks + b] = d;
      }
    }
}

// Row m's quantized activations of group g (8 k) of block blk as two quads, what the group's two byte vectors
// meet (group_bytes: lo k0 + b, hi k0 + 4 + b)
struct Quads {
  int32_t lo, hi;
};
inline Quads group_quads(const QuantRows& x, int m, int k, int blk, int g) {
  const int8_t* xq = x.q + int64_t(m) * k + blk * kBlock + g * 8;
  Quads q;
  std::memcpy(&q.lo, xq, 4);
  std::memcpy(&q.hi, xq + 4, 4);
  return q;
}

// Group g (8 k) of a block of 16 rows x 32 k at ``wb`` as two vectors of byte weights (lo: k0 + b, hi: k0 + 4 + b):
// the nibbles, with q5 / q5k's fifth bits or q6k's top two bits added
template <int Format>
inline void group_bytes(const uint8_t* wb, int g, I16* lo, I16* hi) {
  split_nibbles(load_i16(wb + g * 64), lo, hi);
  if constexpr (Format == kQ6K) {
    const I16 top = load_i16(wb + 256 + g / 2 * 64);
    if (g % 2) add_top_bits<1>(top, lo, hi);
    else add_top_bits<0>(top, lo, hi);
  } else if constexpr (Format == kQ5 || Format == kQ5K) {
    const I16 top = load_i16(wb + 256);
    switch (g) {  // (unrolled: one case each)
      case 0: add_fifth_bit<0>(top, lo, hi); break;
      case 1: add_fifth_bit<1>(top, lo, hi); break;
      case 2: add_fifth_bit<2>(top, lo, hi); break;
      default: add_fifth_bit<3>(top, lo, hi);
    }
  }
}

template <int Format, int MR, int NB>
void tile_quant(const QuantRows& x, int m0, int k, const Linear& lin, int b, Acc& acc, bool lead) {
  constexpr bool q8 = byte_quant(Format);
  constexpr bool fifth = Format == kQ5 || Format == kQ5K;  // a fifth bit per weight after the nibbles
  constexpr int halves = Format == kQ8G16 || Format == kQ6K ? 2 : 1;  // dot products (and scales) per 32 k
  const int blocks = k / kBlock;
  const int64_t wbytes = q8 ? 512 : Format == kQ6K ? 384 : fifth ? 320 : 256;  // per 16 rows x 32 k
  const uint8_t* w = static_cast<const uint8_t*>(lin.w) + int64_t(b) * blocks * wbytes;
  const uint16_t* super_d = static_cast<const uint16_t*>(lin.super_scale);
  V16 a[MR][NB];
  zero<MR, NB>(a);
  for (int blk = 0; blk < blocks; ++blk) {
    I16 dot[halves][MR][NB];
#pragma GCC unroll 2
    for (int h = 0; h < halves; ++h)
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) dot[h][r][j] = izero16();
    const uint8_t* wb = w + blk * wbytes;
    if constexpr (!q8) {  // (ahead: Q8_0's bytes stream at the memory's pace without it)
      if (lead)
        for (int j = 0; j < NB; ++j) ahead(wb + j * blocks * wbytes, int(wbytes));
    }
    if constexpr (q8) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        constexpr int per_half = 8 / halves;
        I16 wv[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) wv[j] = load_i16(wb + j * blocks * wbytes + g * 64);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, x.q + int64_t(m0 + r) * k + blk * kBlock + g * 4, 4);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) dot[g / per_half][r][j] = dot_q8(dot[g / per_half][r][j], wv[j], quad);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        I16 lo[NB], hi[NB];
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) group_bytes<Format>(wb + j * blocks * wbytes, g, &lo[j], &hi[j]);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const Quads q = group_quads(x, m0 + r, k, blk, g);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) {
            I16& into = dot[g * halves / 4][r][j];  // q6k: groups 0-1 make the first 16 k, 2-3 the second
            into = dot_u4(dot_u4(into, lo[j], q.lo), hi[j], q.hi);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < halves; ++h) {
        const int64_t at = ((int64_t(b + j) * blocks + blk) * halves + h) * 16;
        V16 d, c;
        const int64_t sb = (int64_t(b + j) * (blocks / 8) + blk / 8) * 16;  // K-quants: the super-block's lanes
        if constexpr (Format == kQ4 || Format == kQ5) {
          d = load_halves(static_cast<const uint16_t*>(lin.scale) + at);
          c = load_halves(static_cast<const uint16_t*>(lin.zero) + at);
        } else if constexpr (Format == kQ4K || Format == kQ5K) {  // d sc and -dmin mn: products of 11 and 6 bits, exact in fp32
          d = load_halves(super_d + sb) * bytes_float(static_cast<const uint8_t*>(lin.scale) + at);
          c = load_halves(static_cast<const uint16_t*>(lin.super_zero) + sb) *
              bytes_float(static_cast<const uint8_t*>(lin.zero) + at);
        } else if constexpr (Format == kQ6K) {
          d = load_halves(super_d + sb) * bytes_float(static_cast<const int8_t*>(lin.scale) + at);
          c = d * set1(-32.0f);
        } else if constexpr (Format == kQ8H) {
          d = load_halves(static_cast<const uint16_t*>(lin.scale) + at);
          c = d * set1(-kQ8Offset);
        } else {
          d = loadu(static_cast<const float*>(lin.scale) + at);
          c = d * set1(-kQ8Offset);
          if (lin.zero) c = c + loadu(static_cast<const float*>(lin.zero) + at);
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int64_t xi = int64_t(m0 + r) * blocks + blk;
          const int32_t* sums = x.sum + xi * 2;
          const int32_t sum = halves == 2 ? sums[h] : sums[0] + sums[1];
          const V16 t = fmadd(d, to_float(dot[h][r][j]), c * set1(float(sum)));
          a[r][j] = fmadd(set1(x.d[xi]), t, a[r][j]);
        }
      }
  }
  hand_over<MR, NB>(a, acc);
}

#if !RS_AVX512
// K-quant blocks on AVX2, their activations quantized per super-block (one dx per 256 k): each block's integer
// scale is folded into its pair sums (dot_u4_scaled), so a super-block sums in integers and the float step runs
// once per 256 k, not once per 32 (Q6_K: 16) -- maddubs and madd, which sum pairs anyway, do the scaling. Bounds:
// a pair of maddubs at most 2 x 63 x 127 < 2^15; a super-block's sum at most 256 x 63 x 127 x 127 < 2^31 (Q6_K,
// |sc| <= 128: 256 x 63 x 127 x 128). The offsets' terms (Q4_K, Q5_K: dmin mn per 32 k; Q6_K: -32 d sc per 16 k)
// are sums of the activations' block sums by those integers, two blocks per madd. Output blocks are taken one at
// a time (MR rows x 1 block: the sums stay in AVX2's 16 registers).
template <int Format, int MR, int NB>
void tile_ksuper(const QuantRows& x, int m0, int k, const Linear& lin, int b, Acc& acc, bool lead) {
  constexpr bool q6 = Format == kQ6K, fifth = Format == kQ5K;
  constexpr int halves = q6 ? 2 : 1;  // scales per 32 k
  const int blocks = k / kBlock;
  const int64_t wbytes = q6 ? 384 : fifth ? 320 : 256;  // per 16 rows x 32 k
  for (int j = 0; j < NB; ++j) {
    const uint8_t* w = static_cast<const uint8_t*>(lin.w) + int64_t(b + j) * blocks * wbytes;
    V16 a[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) a[r] = zero16();
    for (int s = 0; s < k / kSuper; ++s) {
      const int first = s * (kSuper / kBlock);
      I16 dot[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) dot[r] = izero16();
      for (int blk = first; blk < first + kSuper / kBlock; ++blk) {
        const uint8_t* wb = w + blk * wbytes;
        if (lead) ahead(wb, int(wbytes));
        const int64_t at = ((int64_t(b + j) * blocks + blk) * halves) * 16;
        I16 sc[halves];
        if constexpr (q6) {
          sc[0] = scale_pairs(static_cast<const int8_t*>(lin.scale) + at);
          sc[halves - 1] = scale_pairs(static_cast<const int8_t*>(lin.scale) + at + 16);
        } else {
          sc[0] = scale_pairs(static_cast<const uint8_t*>(lin.scale) + at);
        }
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          I16 lo, hi;
          group_bytes<Format>(wb, g, &lo, &hi);
          const I16& scale = sc[g * halves / 4];  // q6k: groups 0-1 make the first 16 k, 2-3 the second
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const Quads q = group_quads(x, m0 + r, k, blk, g);
            dot[r] = dot_u4_scaled(dot_u4_scaled(dot[r], lo, q.lo, scale), hi, q.hi, scale);
          }
        }
      }
      // the offsets' term: Q4_K / Q5_K sum mn x (sums per 32 k) over 8 blocks, Q6_K sc x (sums per 16 k) over 16
      constexpr int pairs = q6 ? 8 : 4;
      I16 off[pairs];
#pragma GCC unroll 8
      for (int i = 0; i < pairs; ++i) {
        const int64_t at = (int64_t(b + j) * blocks * halves + first * halves + 2 * i) * 16;
        if constexpr (q6) off[i] = byte_pairs(static_cast<const int8_t*>(lin.scale) + at,
                                              static_cast<const int8_t*>(lin.scale) + at + 16);
        else off[i] = byte_pairs(static_cast<const uint8_t*>(lin.zero) + at,
                                 static_cast<const uint8_t*>(lin.zero) + at + 16);
      }
      const int64_t sb = (int64_t(b + j) * (k / kSuper) + s) * 16;
      const V16 d = load_halves(static_cast<const uint16_t*>(lin.super_scale) + sb);
      const V16 c = q6 ? d * set1(-32.0f) : load_halves(static_cast<const uint16_t*>(lin.super_zero) + sb);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int64_t xi = int64_t(m0 + r) * blocks + first;
        const int32_t* sums = x.sum + xi * 2;  // per 16 k
        I16 low = izero16();
#pragma GCC unroll 8
        for (int i = 0; i < pairs; ++i) {
          const int32_t s0 = q6 ? sums[2 * i] : sums[4 * i] + sums[4 * i + 1];
          const int32_t s1 = q6 ? sums[2 * i + 1] : sums[4 * i + 2] + sums[4 * i + 3];
          low = dot_pairs(low, off[i], int32_t(uint32_t(uint16_t(s0)) | uint32_t(s1) << 16));
        }
        const V16 dx = set1(x.d[xi]);
        a[r] = fmadd(dx * d, to_float(dot[r]), fmadd(dx * c, to_float(low), a[r]));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r][j] = a[r];
  }
}

template <int Format>
struct KSuperTiles {
  using Fn = void (*)(const QuantRows&, int, int, const Linear&, int, Acc&, bool);
  template <int MR, int NB>
  static constexpr Fn fn() {
    return &tile_ksuper<Format, MR, NB>;
  }
};
#endif

using QuantTileFn = void (*)(const QuantRows&, int, int, const Linear&, int, Acc&, bool);

// Blocks of outputs per quantized tile. A single row of 8-bit weights (a batch-1 decode step's products of a Q8_0
// file) reads kQ8Cols blocks' streams at once: its arithmetic is light, and two streams a thread leave the memory
// short of requests -- measured on Zen 3 (AVX2), a whole step's Q8_0 products read 1.09-1.24x faster with four
// (benchmarks/kernel_ab.py --shape qwen2.5-1.5b / llama-3.2-1b --kinds Q8_0 --rows 1). Not the 4-bit formats
// (Q4_0 0.94x; Q4_K's and Q6_K's super-block tiles read slower with their blocks' streams interleaved: 0.88-0.90x):
// their software prefetch (ahead) keeps the memory busy instead. Nor several rows: the sums outgrow AVX2's registers.
inline int q8_cols(int rows, int format) {
  return rows == 1 && byte_quant(format) ? kQ8Cols : kQColTile;
}

template <int Format>
struct QuantTiles {
  using Fn = QuantTileFn;
  template <int MR, int NB>
  static constexpr Fn fn() {
    return &tile_quant<Format, MR, NB>;
  }
};

template <int Format>
QuantTileFn quant_tile_for(int mr, int nb, bool super) {
  if constexpr (byte_quant(Format))
    if (nb > kQColTile) return TileTable<QuantTiles<Format>, 1, kQ8Cols>::at(mr, nb);  // (mr 1: q8_cols)
#if !RS_AVX512
  if constexpr (k_quant(Format))
    if (super) return TileTable<KSuperTiles<Format>, kQRowTile, kQColTile>::at(mr, nb);
#endif
  (void)super;
  return TileTable<QuantTiles<Format>, kQRowTile, kQColTile>::at(mr, nb);
}

// y = x W^T (+ b) for this thread's share of W's blocks. ``emit(m, n, v, mask)`` gets outputs n .. n + 15 of row
// m (lanes past W's last row masked off), the bias added and rounded to T, as an eager linear layer returns them.
// ``in``: x, and what was made of it just before (prepare);
// ``amx``: use the tile product (bf16, k a multiple of 32).
template <class T>
struct Input {
  const T* x;      // [rows, k]
  float* wide;     // x as fp32 (where widens_x)
  QuantRows q;     // x quantized (a quantized W)
};

template <class T, class F>
inline void product_of(const Input<T>& in, int rows, const Linear& lin, bool amx, bool super, F&& emit) {
  const int blocks = (lin.n + 15) / 16, t = omp_get_thread_num(), nt = omp_get_num_threads();
  const int b0 = int(int64_t(blocks) * t / nt), b1 = int(int64_t(blocks) * (t + 1) / nt);
  const int64_t bstride = int64_t(lin.k) * 16;  // elements per block of 16 rows
  const T* w = static_cast<const T*>(lin.w);
  const T* bias = static_cast<const T*>(lin.bias);
  auto out = [&](int m, int n, V16 acc) {
    const M16 mk = mask16(lin.n - n);
    emit(m, n, rnd16<T>(bias ? acc + load16(bias + n, mk) : acc), mk);
  };
  Acc acc;
  if (lin.format != kDense) {
    const int cols = q8_cols(rows, lin.format);
    for (int b = b0; b < b1; b += cols) {
      const int nb = std::min(cols, b1 - b);
      for (int m = 0; m < rows; m += kQRowTile) {
        const int mr = std::min(kQRowTile, rows - m);
        const QuantTileFn tile = lin.format == kQ8     ? quant_tile_for<kQ8>(mr, nb, super)
                                 : lin.format == kQ8H  ? quant_tile_for<kQ8H>(mr, nb, super)
                                 : lin.format == kQ4   ? quant_tile_for<kQ4>(mr, nb, super)
                                 : lin.format == kQ4K  ? quant_tile_for<kQ4K>(mr, nb, super)
                                 : lin.format == kQ6K  ? quant_tile_for<kQ6K>(mr, nb, super)
                                 : lin.format == kQ5   ? quant_tile_for<kQ5>(mr, nb, super)
                                 : lin.format == kQ5K  ? quant_tile_for<kQ5K>(mr, nb, super)
                                                       : quant_tile_for<kQ8G16>(mr, nb, super);
        tile(in.q, m, lin.k, lin, b, acc, rows <= kQRowTile);  // (ahead)
        for (int j = 0; j < nb; ++j)
          for (int r = 0; r < mr; ++r) out(m + r, (b + j) * 16, acc[r][j]);
      }
    }
    return;
  }
  if constexpr (std::is_same_v<T, bf16> && kHaveAmx) {
    if (amx && lin.k % 32 == 0) {
      product_amx(in.x, rows, lin, w, b0, b1, out);
      return;
    }
  }
  const TileShape shape = tile_shape<T>(rows);
  const bool wide = widens_x<T>(rows, lin, amx);
  for (int b = b0; b < b1; b += shape.cols) {
    const int nb = std::min(shape.cols, b1 - b);
    for (int i = 0; i < shape.tiles; ++i) {
      const int m = rows * i / shape.tiles, mr = rows * (i + 1) / shape.tiles - m;
      const bool lead = rows > 1 && i == 0;  // (ahead)
      if (wide)
        tile_for<float, T>(mr, nb)(in.wide + int64_t(m) * lin.k, lin.k, lin.k, w + b * bstride, bstride, acc, lead);
      else
        tile_for<T, T>(mr, nb)(in.x + int64_t(m) * lin.k, lin.k, lin.k, w + b * bstride, bstride, acc, lead);
      for (int j = 0; j < nb; ++j)
        for (int r = 0; r < mr; ++r) out(m + r, (b + j) * 16, acc[r][j]);
    }
  }
}

// What a product needs made of x first, every thread taking part (the implicit barrier ends it): x quantized for a
// quantized W (every part of a kParts one is), widened for a dense one where widens_x
template <class T>
inline void prepare(const Input<T>& in, int rows, const Linear& lin, bool amx) {
  if (lin.format != kDense)
    quantize_rows(in.x, rows, lin.k, per_super_block(lin) ? kSuper : kBlock, in.q);
  else if (widens_x<T>(rows, lin, amx))
    widen_rows(in.x, rows, lin.k, in.wide);
}

// The same for a layer whose rows come in parts of different formats (kParts: a fused q/k/v of a Q4_K_M file,
// Q6_K v beside Q4_K q and k), each part's outputs emitted where its rows sit in the whole
template <class T, class F>
inline void product(const Input<T>& in, int rows, const Linear& lin, bool amx, F&& emit) {
  const bool super = per_super_block(lin);  // how prepare quantized x
  if (lin.format != kParts) return product_of(in, rows, lin, amx, super, emit);
  const Linear* part = static_cast<const Linear*>(lin.w);
  for (int i = 0, n0 = 0; i < lin.parts; n0 += part[i].n, ++i)
    product_of(in, rows, part[i], amx, super, [&](int m, int n, V16 v, M16 mk) { emit(m, n0 + n, v, mk); });
}

}  // namespace rs
