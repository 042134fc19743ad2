// Linear layers: y = x W^T (+ b) for a few rows of x, each thread computing its share of W's output rows, through
// the tiles of dense_tiles.h and quant_tiles.h.
#pragma once

#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "abi.h"
#include "dense_tiles.h"
#include "quant_tiles.h"
#include "simd.h"

namespace rs {

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
  // a fixed contiguous share a thread: runs of blocks handed out in turn (so that a thread another process holds
  // up leaves its blocks to the others) measured no faster on Zen 3 -- whole Q4_K_M steps 0.99-1.00x idle,
  // 0.95-0.97x beside a neighbour taking 1.5 ms of every 26 (libgomp's dynamic schedule, then a lock-free counter)
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
    // K-quants summed in integers a super-block at a time (tile_ksuper): always on AVX2; on AVX-512 up to a row
    // tile (a step's products 1.08-1.44x faster on Zen 4 at 1 to 4 rows; at 8, 0.86-0.95x: tile_quant stays there)
    const bool ksuper = super && (!RS_AVX512 || rows <= kQRowTile);
    for (int b = b0; b < b1; b += cols) {
      const int nb = std::min(cols, b1 - b);
      for (int m = 0; m < rows; m += kQRowTile) {
        const int mr = std::min(kQRowTile, rows - m);
        const QuantTileFn tile = lin.format == kQ8     ? quant_tile_for<kQ8>(mr, nb, ksuper)
                                 : lin.format == kQ8H  ? quant_tile_for<kQ8H>(mr, nb, ksuper)
                                 : lin.format == kQ4   ? quant_tile_for<kQ4>(mr, nb, ksuper)
                                 : lin.format == kQ4K  ? quant_tile_for<kQ4K>(mr, nb, ksuper)
                                 : lin.format == kQ6K  ? quant_tile_for<kQ6K>(mr, nb, ksuper)
                                 : lin.format == kQ5   ? quant_tile_for<kQ5>(mr, nb, ksuper)
                                 : lin.format == kQ5K  ? quant_tile_for<kQ5K>(mr, nb, ksuper)
                                                       : quant_tile_for<kQ8G16>(mr, nb, ksuper);
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
