// Register tiles of quantized weights (Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants, the engine's int8/int4): their
// packed layout, the activations quantized to int8 to meet them, and each format's tile.
#pragma once

#include <cstdint>
#include <cstring>

#include "abi.h"
#include "dense_tiles.h"
#include "simd.h"

namespace rs {

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
// their products sum a super-block in integers (tile_ksuper).

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
  constexpr bool nibbles = Format == kQ4 || Format == kQ4K;  // 0..15: a block's sums (simd.h's block_sums)
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
            if constexpr (nibbles) into = block_sums(block_sums(into, lo[j], q.lo), hi[j], q.hi);
            else into = dot_u4(dot_u4(into, lo[j], q.lo), hi[j], q.hi);
          }
        }
      }
      if constexpr (nibbles)
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) dot[0][r][j] = block_total(dot[0][r][j]);
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

// K-quant blocks, their activations quantized per super-block (one dx per 256 k): each block's integer scale
// multiplies its groups' sums (add_scaled), so a super-block sums in integers and the float step runs once per
// 256 k, not once per 32 (Q6_K: 16) as in tile_quant. AVX2: maddubs's int16 pair sums, scaled by a madd (which sums
// pairs anyway); AVX-512: VNNI's int32 sums, scaled by a vpmulld (products of up to kQRowTile rows: products.h) --
// on Zen 4, whose memory outpaces tile_quant's per-block float step at batch 1, a step's products alone 1.17-1.33x
// faster for Q4_K, 1.14-1.27x Q6_K, 1.22-1.44x Q5_K (benchmarks/kernel_ab.py --shape llama-3.2-1b --rows 1), a
// whole Q4_K_M step 1.17x (--model-path). Bounds: a pair of maddubs at most 2 x 63 x 127 < 2^15; a super-block's
// sum at most 256 x 63 x 127 x 127 < 2^31 (Q6_K, |sc| <= 128: 256 x 63 x 127 x 128). The offsets' terms (Q4_K,
// Q5_K: dmin mn per 32 k; Q6_K: -32 d sc per 16 k) are sums of the activations' block sums by those integers, two
// blocks per madd. Output blocks are taken one at a time (MR rows x 1 block: the sums stay in AVX2's 16 registers).
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
          sc[0] = scale_lanes(static_cast<const int8_t*>(lin.scale) + at);
          sc[halves - 1] = scale_lanes(static_cast<const int8_t*>(lin.scale) + at + 16);
        } else {
          sc[0] = scale_lanes(static_cast<const uint8_t*>(lin.scale) + at);
        }
        // groups of 8 k whose sums add up before their scale multiplies them, one scaling per run, not per group:
        // AVX-512, all the groups of a scale (int32 lanes); AVX2, while the int16 pair sums stay below 2^15
        // (simd.h's group_sums: each maddubs pair at most 2 x 15 x 127 for Q4_K's nibbles, 2 x 31 x 127 for Q5_K,
        // 2 x 63 x 127 for Q6_K; a group has 2 to a lane)
        constexpr int run = RS_AVX512 ? 4 / halves : Format == kQ4K ? 4 : Format == kQ5K ? 2 : 1;
#pragma GCC unroll 4
        for (int g0 = 0; g0 < 4; g0 += run) {
          I16 sums[MR];  // int16 lanes (AVX2), int32 (AVX-512)
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) sums[r] = izero16();
#pragma GCC unroll 4
          for (int g = g0; g < g0 + run; ++g) {
            I16 lo, hi;
            group_bytes<Format>(wb, g, &lo, &hi);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
              const Quads q = group_quads(x, m0 + r, k, blk, g);
              sums[r] = group_sums(group_sums(sums[r], lo, q.lo), hi, q.hi);
            }
          }
          const I16& scale = sc[g0 * halves / 4];  // q6k: groups 0-1 make the first 16 k, 2-3 the second
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) dot[r] = add_scaled(dot[r], sums[r], scale);
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

using QuantTileFn = void (*)(const QuantRows&, int, int, const Linear&, int, Acc&, bool);

// Blocks of outputs per quantized tile. A single row of 8-bit weights (a batch-1 decode step's products of a Q8_0
// file) reads kQ8Cols blocks' streams at once: its arithmetic is light, and two streams a thread leave the memory
// short of requests -- measured on Zen 3 (AVX2), a whole step's Q8_0 products read 1.09-1.24x faster with four
// (benchmarks/kernel_ab.py --shape qwen2.5-1.5b / llama-3.2-1b --kinds Q8_0 --rows 1). Not the 4-bit formats
// (Q4_0 0.94x; Q4_K's and Q6_K's super-block tiles read slower with their blocks' streams interleaved: 0.88-0.90x):
// their software prefetch (ahead) keeps the memory busy instead. Nor several rows: the sums outgrow AVX2's registers.
// (Several rows of Q8_0 on AVX2 keep 4 x 2 tiles: 2 x 2 measured 0.88-0.92x at 4 and 8 rows, 4 x 1 1.01-1.02x.)
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
  if constexpr (k_quant(Format))
    if (super) return TileTable<KSuperTiles<Format>, kQRowTile, kQColTile>::at(mr, nb);
  return TileTable<QuantTiles<Format>, kQRowTile, kQColTile>::at(mr, nb);
}

}  // namespace rs
