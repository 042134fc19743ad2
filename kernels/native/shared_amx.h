// Shared-prefix attention in AMX tiles (bf16, head dim 64), steps 1 and 2 (attention_shared.h): the queries
// gathered into tiles, then a task per run of query tiles packing the shared keys and values as B tiles and
// taking two passes over them per tile of 16 queries
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dense_tiles.h"
#include "shared_groups.h"

namespace rs {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// A 16 x 16 matrix of dwords, a row to a register, transposed in place: pairs of rows interleaved by dwords, then
// by qwords, then 128-bit lanes exchanged twice
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The indices that interleave words from+0 .. from+15 of two registers (permutex2var): a's word, then b's
inline __m512i pair_words(int from) {
  alignas(64) int16_t at[32];
  for (int i = 0; i < 16; ++i) {
    at[2 * i] = int16_t(from + i);
    at[2 * i + 1] = int16_t(32 + from + i);
  }
  return _mm512_load_si512(at);
}

// S[16 queries][16 keys] of one 16-key block: two tile products over the halves of the head dim, stored at s
// (rows ``stride`` bytes apart)
inline void shared_scores(const bf16* qt, const uint32_t* kt_block, float* s, int stride) {
  _tile_zero(0);
  _tile_loadd(1, qt, kSharedDim * 2);
  _tile_loadd(2, kt_block, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_loadd(1, qt + 32, kSharedDim * 2);
  _tile_loadd(2, kt_block + 256, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, s, stride);
}

// 32 shared keys j0 .. j0 + 31 of kv head g (zeros past ``shared``) as the B tiles of S = Q K^T, two per 16 keys:
// kt [2 sub-blocks][2 halves of the head dim][16 dim pairs][16 keys] dwords
inline void pack_keys(const bf16* kp, const int64_t* head, int j0, int shared, int g, int nkv, uint32_t* kt) {
  constexpr int D = kSharedDim;
  for (int sub = 0; sub < 2; ++sub) {  // 16 keys' 32 dim pairs, as two 16 x 16 transposes of dwords
    __m512i half[2][16];
    for (int n = 0; n < 16; ++n) {
      const int j = j0 + sub * 16 + n;
      const bf16* key = kp + (j < shared ? head[j] * nkv + g : 0) * D;
      for (int h = 0; h < 2; ++h) half[h][n] = j < shared ? _mm512_loadu_si512(key + 32 * h) : _mm512_setzero_si512();
    }
    for (int h = 0; h < 2; ++h) {
      transpose16(half[h]);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + (sub * 2 + h) * 256 + p * 16, half[h][p]);
    }
  }
}

// The same keys' values, paired as the B tiles of O = P V: v [4 groups of 16 dims][16 key pairs][16 dims x 2]
inline void pack_values(const bf16* vp, const int64_t* head, int j0, int shared, int g, int nkv, uint32_t* v) {
  constexpr int D = kSharedDim;
  const __m512i low = pair_words(0), high = pair_words(16);  // two keys' values interleaved, 16 dims at a time
  for (int kpair = 0; kpair < 16; ++kpair) {
    const int ja = j0 + 2 * kpair, jb = ja + 1;
    for (int h = 0; h < 2; ++h) {  // dims 32h .. 32h + 31 of both keys
      const __m512i zero = _mm512_setzero_si512();
      const __m512i a = ja < shared ? _mm512_loadu_si512(vp + (head[ja] * nkv + g) * D + 32 * h) : zero;
      const __m512i b = jb < shared ? _mm512_loadu_si512(vp + (head[jb] * nkv + g) * D + 32 * h) : zero;
      _mm512_store_si512(v + (2 * h) * 256 + kpair * 16, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(v + (2 * h + 1) * 256 + kpair * 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// A query tile's rows: how many are live, how far into its group's shared run each sees (query_reach), the furthest
struct TileReach {
  int live, far, of[16];
};
inline TileReach tile_reach(const Step& st, int grp, int i0, int live, int group) {
  TileReach t{live, 0, {}};
  for (int r = 0; r < live; ++r) t.far = std::max(t.far, t.of[r] = query_reach(st, grp, i0 + r, group));
  return t;
}

// Pass 1 over one packed block of 32 shared keys (kt, from key j0) for ``tiles`` query tiles (q: bf16 [tiles][16][64];
// reach[u]: tile u's rows): their scores kept in s (float [tiles][16][cols]), each query's maximum over the keys it
// sees in most (float [tiles][16][16 lanes]: the maximum across them; scale > 0, so taken before scaling). A tile
// whose rows all end before the block skips it.
inline void score_block(const bf16* q, int tiles, const TileReach* reach, const uint32_t* kt, int j0, int cols,
                        float* s, float* most) {
  for (int u = 0; u < tiles; ++u) {
    float* su = s + int64_t(u) * 16 * cols;
    const TileReach& t = reach[u];
    for (int sub = 0; sub < 2 && j0 + sub * 16 < t.far; ++sub) {
      shared_scores(q + int64_t(u) * 16 * kSharedDim, kt + sub * 512, su + j0 + sub * 16, cols * 4);
      for (int r = 0; r < t.live; ++r) {
        const __mmask16 seen = mask16(t.of[r] - j0 - sub * 16);
        float* m = most + (u * 16 + r) * 16;
        const __m512 was = _mm512_load_ps(m);
        _mm512_store_ps(m, _mm512_mask_max_ps(was, seen, was, _mm512_loadu_ps(su + int64_t(r) * cols + j0 + sub * 16)));
      }
    }
  }
}

// Pass 2 for one tile (reach: its rows): exp of its kept scores s (float [16][cols]) less each query's maximum
// (most), over the keys each sees, the sums, and the value sums as tile products over the packed values v (uint32
// [blocks][4][16][16]), written to the queries' parts (query i0 + r of group grp)
inline void tile_values(const Model& md, const Step& st, const SharedScratch& sc, int g, int grp, int i0,
                        const TileReach& reach, const float* s, const float* most, const uint32_t* v, int cols) {
  constexpr int D = kSharedDim;
  const int group = md.heads / md.kv_heads, queries = st.rows * group, live = reach.live;
  const __m512 scale = _mm512_set1_ps(md.scale);
  alignas(64) float top[16], sum[16];
  __m512 total[16];
  for (int r = 0; r < 16; ++r) total[r] = _mm512_setzero_ps();
  for (int r = 0; r < live; ++r) top[r] = _mm512_reduce_max_ps(_mm512_load_ps(most + r * 16)) * md.scale;
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  alignas(64) bf16 p[16][32] = {};  // rows past the live ones stay 0
  for (int blk = 0; blk < (reach.far + 31) / 32; ++blk) {
    for (int r = 0; r < live; ++r) {
      __m512 e[2];
      for (int sub = 0; sub < 2; ++sub) {  // (keys past the row's reach, never scored for it, are masked out)
        const __mmask16 seen = mask16(reach.of[r] - blk * 32 - sub * 16);
        const __m512 sr = _mm512_maskz_loadu_ps(seen, s + int64_t(r) * cols + blk * 32 + sub * 16);
        e[sub] = _mm512_maskz_mov_ps(seen, exp_probability(_mm512_sub_ps(_mm512_mul_ps(sr, scale), _mm512_set1_ps(top[r]))));
      }
      total[r] = _mm512_add_ps(total[r], _mm512_add_ps(e[0], e[1]));
      store16(&p[r][0], e[0], 0xffff);  // probabilities as bf16: the A tile of O += P V
      store16(&p[r][16], e[1], 0xffff);
    }
    _tile_loadd(1, p, 64);
    const uint32_t* vb = v + int64_t(blk) * 4 * 256;
    _tile_loadd(2, vb, 64);
    _tile_dpbf16ps(3, 1, 2);
    _tile_loadd(2, vb + 256, 64);
    _tile_dpbf16ps(4, 1, 2);
    _tile_loadd(2, vb + 512, 64);
    _tile_dpbf16ps(5, 1, 2);
    _tile_loadd(2, vb + 768, 64);
    _tile_dpbf16ps(6, 1, 2);
  }
  for (int r = 0; r < live; ++r) sum[r] = _mm512_reduce_add_ps(total[r]);
  alignas(64) float o[16][D];
  _tile_stored(3, &o[0][0], D * 4);
  _tile_stored(4, &o[0][16], D * 4);
  _tile_stored(5, &o[0][32], D * 4);
  _tile_stored(6, &o[0][48], D * 4);
  for (int r = 0; r < live; ++r) {
    float* part = sc.part + (int64_t(g) * queries + group_query(st, grp, i0 + r, group)) * (2 + D);
    part[0] = top[r];
    part[1] = sum[r];
    std::memcpy(part + 2, o[r], D * 4);
  }
}

// Whether every group's query tiles fit one run (as in decode, a few rows a group): then a task per run packs its
// group's keys and values itself (read from the pool once a run, nothing packed through memory the step shares);
// otherwise (prefill: a request's hundreds of rows on one prefix) each group's keys and values are packed once for
// the step, a task per block of 32, and scored by a task per query tile
inline bool amx_runs(const SharedScratch& sc, int groups) {
  for (int grp = 0; grp < groups; ++grp)
    if (sc.tile_at[grp + 1] - sc.tile_at[grp] > kAmxRun) return false;
  return true;
}

template <class T>
inline void amx_shared_scores(const Model& md, const Layer& ly, const Step& st, const T* qkv,
                              const SharedScratch& sc) {
  constexpr int D = kSharedDim;
  const int nq = md.heads, nkv = md.kv_heads, group = nq / nkv;
  const int groups = st.groups, blocks = sc.block_at[groups], qtiles = sc.tile_at[groups];
  const bf16* kp = static_cast<const bf16*>(ly.k_pool);
  const bf16* vp = static_cast<const bf16*>(ly.v_pool);
  const bool runs = amx_runs(sc, groups);
  uint32_t* kt = static_cast<uint32_t*>(sc.kt);
  uint32_t* vt = static_cast<uint32_t*>(sc.v);
  // 1. (prefill) each group's shared keys and values packed for the step, 32 keys a task; the queries gathered
  //    into tiles
  if (!runs) {
#pragma omp for schedule(static) nowait
    for (int t = 0; t < nkv * blocks; ++t) {  // a block's kv heads one after another: its slots' rows read whole
      const int g = t % nkv, blk = t / nkv, grp = group_of(sc.block_at, groups, blk);
      const int64_t at = int64_t(g) * blocks + blk;  // kv head-major in the scratch, as step 2 reads it
      const int shared = st.group_shared[grp], j0 = (blk - sc.block_at[grp]) * 32;
      const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
      prefetch_rows(kp, vp, head, j0 + 32, std::min(j0 + 64, shared), nkv, g, D);
      pack_keys(kp, head, j0, shared, g, nkv, kt + at * 1024);
      pack_values(vp, head, j0, shared, g, nkv, vt + at * 1024);
    }
  }
#pragma omp for schedule(static)
  for (int t = 0; t < nkv * qtiles; ++t) {
    bf16* q = static_cast<bf16*>(sc.q) + int64_t(t) * 16 * D;
    for (int r = 0; r < 16; ++r) {
      const T* from = tile_query(md, st, sc, qkv, t / qtiles, t % qtiles, r);
      if (from)
        std::memcpy(q + r * D, from, D * 2);
      else
        std::memset(q + r * D, 0, D * 2);
    }
  }
  // 2. a task per run of query tiles of a group and kv head -- all the group's (runs), or one -- pass 1 over the
  //    group's blocks (in runs: each packed by the task as it goes, its values kept for pass 2), then pass 2 per
  //    tile. No barrier after: step 3's tasks run beside these.
  const int tasks = runs ? groups : qtiles;
#pragma omp for schedule(dynamic, 1) nowait
  for (int t = 0; t < nkv * tasks; ++t) {
    const int g = t % nkv, grp = runs ? t / nkv : group_of(sc.tile_at, groups, t / nkv);
    const int qt0 = runs ? sc.tile_at[grp] : t / nkv, tiles = runs ? sc.tile_at[grp + 1] - qt0 : 1;
    const int shared = st.group_shared[grp], cols = (shared + 31) / 32 * 32;
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group;
    TileReach reach[kAmxRun];  // each tile's rows (where a request's rows see their own slots, fewer than the run)
    int far = 0;
    for (int u = 0; u < tiles; ++u) {
      const int i0 = (qt0 + u - sc.tile_at[grp]) * 16;
      reach[u] = tile_reach(st, grp, i0, std::min(16, mine - i0), group);
      far = std::max(far, reach[u].far);
    }
    const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
    const int64_t first = int64_t(g) * blocks + sc.block_at[grp];  // (packed for the step) the group's first block
    const AmxRun w = amx_run_of(sc, blocks);
    const bf16* q = static_cast<bf16*>(sc.q) + (int64_t(g) * qtiles + qt0) * 16 * D;
    const uint32_t* values = runs ? w.v : vt + first * 1024;
    configure_tiles(16);
    for (int i = 0; i < tiles * 16; ++i) _mm512_store_ps(w.most + i * 16, _mm512_set1_ps(-INFINITY));
    for (int j0 = 0; j0 < far; j0 += 32) {
      const uint32_t* block = kt + (first + j0 / 32) * 1024;
      if (runs) {
        prefetch_rows(kp, vp, head, j0 + 32, std::min(j0 + 64, shared), nkv, g, D);
        pack_keys(kp, head, j0, shared, g, nkv, w.kt);
        pack_values(vp, head, j0, shared, g, nkv, w.v + int64_t(j0 / 32) * 1024);
        block = w.kt;
      }
      score_block(q, tiles, reach, block, j0, cols, w.s, w.most);
    }
    for (int u = 0; u < tiles; ++u)
      tile_values(md, st, sc, g, grp, (qt0 + u - sc.tile_at[grp]) * 16, reach[u], w.s + int64_t(u) * 16 * cols,
                  w.most + u * 256, values, cols);
  }
}

#else

template <class T>
inline void amx_shared_scores(const Model&, const Layer&, const Step&, const T*, const SharedScratch&) {}

#endif

}  // namespace rs
