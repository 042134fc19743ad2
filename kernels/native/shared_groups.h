// The prefix groups of a step, for shared-prefix attention (attention_shared.h): the scratch's parts, where each
// group's key blocks and query tiles start, and the helpers both ways of scoring shared keys use
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "abi.h"
#include "attention.h"
#include "simd.h"

namespace rs {

constexpr int kSharedDim = 64;   // the head dim the AMX path takes
constexpr int kVecQueries = RS_AVX512 ? 4 : 6;  // queries a vector-path task scores together
constexpr int kVecRun = 8;  // query tiles a vector-path task scores each widened block of shared keys for
constexpr int kAmxRun = 8;  // query tiles an AMX task scores each packed block of shared keys for

inline bool amx_shared(const Model& md) {
  return kHaveAmx && md.amx && md.bf16 && !md.kv_codes && md.head_dim == kSharedDim;
}
inline bool vector_shared(const Model& md) { return !md.kv_codes && md.head_dim % 16 == 0; }
// ... with AVX-512 BF16 dot products, a tile's queries in a vector's lanes (shared_lanes.h): bf16 without AMX tiles
inline bool lane_shared(const Model& md) { return RS_AVX512 && md.bf16 && !amx_shared(md) && vector_shared(md); }
inline bool shared_path(const Model& md, const Step& st) {
  return st.groups > 0 && (amx_shared(md) || vector_shared(md));
}

struct SharedScratch {
  void* kt;     // AMX, prefill (amx_runs false): uint32_t [nkv][blocks32][2][2][16][16], each group's keys packed
  void* v;      // ... and its values: uint32_t [nkv][blocks32][4][16][16]
  void* q;      // AMX: bf16 [nkv][qtiles of 16][16][64];        vector: float [nkv][qtiles][kVecQueries][head dim]
                // lanes: bf16 pairs [nkv][qtiles of 16][head dim / 2][16]
  float* part;  // [2][nkv][rows * group][2 + head dim]: max, sum, value sums -- of the shared keys, of each row's own
  int32_t* block_at;  // [groups + 1]: group g's key blocks (32 keys for AMX, else 16) are block_at[g] .. [g + 1]
  int32_t* tile_at;   // [groups + 1]: its query tiles (16 queries for AMX and lanes, else kVecQueries), the same way
  float* runs;  // each thread's working set: vector, a RunState (run_floats(head dim)); AMX, an AmxRun
                // (amx_run_floats(blocks), blocks: the step's, a bound on any group's)
};

// A vector-path task's working set, in the scratch (not on the OpenMP thread's stack: ~80 KB at head dim 256):
// its run's softmax states -- maxima, sums [kVecRun x kVecQueries], value sums [kVecRun x kVecQueries][head dim] --
// and one block of shared keys (transposed, [head dim][16]) and values ([16][head dim]) widened to float
struct RunState {
  float *best, *total, *acc, *kb, *vb;
};
inline int64_t run_floats(int64_t D) { return (2 + D) * kVecRun * kVecQueries + 2 * 16 * D; }
// A lanes task's: the value sums of each tile of its run ([kVecRun][head dim][16 lanes] float; the maxima and sums
// stay in registers), one block of keys (bf16 [16][head dim]) and of value pairs (uint32 [8][head dim])
inline int64_t lane_run_floats(int64_t D) { return kVecRun * 16 * D + 16 * D; }
inline RunState run_state_of(const SharedScratch& sc, int D) {
  float* at = sc.runs + omp_get_thread_num() * run_floats(D);
  const int n = kVecRun * kVecQueries;
  return {at, at + n, at + 2 * n, at + (2 + D) * n, at + (2 + D) * n + 16 * D};
}

// An AMX task's working set, in the scratch: the scores of each tile of its run against every key of its group
// (s, float [kAmxRun][16][group's blocks x 32]) and each query's maximum (most, float [kAmxRun][16][16 lanes]);
// where it packs its group's keys and values itself (amx_runs), one block of 32 keys packed (kt, uint32
// [2][2][16][16]) and all the group's values (v, uint32 [blocks][4][16][16])
struct AmxRun {
  uint32_t *kt, *v;
  float *s, *most;
};
inline int64_t amx_run_floats(int64_t blocks) { return 1024 + blocks * 1024 + kAmxRun * 512 * blocks + kAmxRun * 256; }
inline AmxRun amx_run_of(const SharedScratch& sc, int64_t blocks) {
  float* at = sc.runs + omp_get_thread_num() * amx_run_floats(blocks);
  float* s = at + 1024 + blocks * 1024;
  return {reinterpret_cast<uint32_t*>(at), reinterpret_cast<uint32_t*>(at + 1024), s, s + kAmxRun * 512 * blocks};
}

inline int shared_block(const Model& md) { return amx_shared(md) ? 32 : 16; }
inline int query_tile(const Model& md) { return amx_shared(md) || lane_shared(md) ? 16 : kVecQueries; }

// The scratch of a step of ``rows`` rows in ``groups`` groups sharing ``shared`` slots in all: each group's blocks
// and tiles rounded up, so at most one more of each per group than the totals need
inline SharedScratch carve_shared(const Model& md, int64_t rows, int64_t groups, int64_t shared, void* base,
                                  int64_t* total) {
  const int64_t nkv = md.kv_heads, group = md.heads / std::max(1, md.kv_heads), D = md.head_dim;
  const int64_t queries = rows * group, blocks = shared / shared_block(md) + groups;
  const int64_t tiles = queries / query_tile(md) + groups;
  const int64_t part = 2 * nkv * queries * (2 + D) * 4;  // the shared part's, then each row's own
  int64_t sizes[7] = {0, 0, nkv * tiles * kVecQueries * D * 4, part, (groups + 1) * 4, (groups + 1) * 4,
                      omp_get_max_threads() * run_floats(D) * 4};
  if (amx_shared(md)) {
    sizes[0] = sizes[1] = nkv * blocks * 4096;
    sizes[2] = nkv * tiles * 16 * kSharedDim * 2;
    sizes[6] = omp_get_max_threads() * amx_run_floats(blocks) * 4;
  } else if (lane_shared(md)) {
    sizes[2] = nkv * tiles * 16 * D * 2;
    sizes[6] = omp_get_max_threads() * lane_run_floats(D) * 4;
  }
  void* parts[7];
  const int64_t off = lay_out(sizes, 7, base, parts);
  if (total) *total = off;
  return {parts[0], parts[1], parts[2], static_cast<float*>(parts[3]), static_cast<int32_t*>(parts[4]),
          static_cast<int32_t*>(parts[5]), static_cast<float*>(parts[6])};
}

// Where each group's blocks and tiles start (before the step's parallel region); 0 if the step has no groups
inline void plan_groups(const Model& md, const Step& st, const SharedScratch& sc) {
  if (!shared_path(md, st)) return;
  const int unit = shared_block(md), per = query_tile(md), group = md.heads / md.kv_heads;
  sc.block_at[0] = sc.tile_at[0] = 0;
  for (int g = 0; g < st.groups; ++g) {
    const int queries = (st.group_start[g + 1] - st.group_start[g]) * group;
    sc.block_at[g + 1] = sc.block_at[g] + (st.group_shared[g] + unit - 1) / unit;
    sc.tile_at[g + 1] = sc.tile_at[g] + (queries + per - 1) / per;
  }
}

// The group whose range of ``at`` (block_at or tile_at) holds i
inline int group_of(const int32_t* at, int groups, int i) {
  int g = 0;
  while (g + 1 < groups && at[g + 1] <= i) ++g;
  return g;
}

// The runs each group's query tiles split into (a vector or lanes task scores one run for one kv head): at least
// one per kVecRun tiles, and more where the step's tasks would leave threads idle -- 32 rows of a model with 3 kv
// heads make 6 tiles of 16 queries per kv head, 3 tasks of one run each, of which one of 2 threads would take two.
// The split is raised until 85% of the threads' task slots are filled (or no run can be cut further); runs split a
// group's tiles evenly, so a run holds at most kVecRun
struct TileRun {
  int grp, qt0, qt1;
};
inline int group_runs(const SharedScratch& sc, int grp, int split) {
  const int tiles = sc.tile_at[grp + 1] - sc.tile_at[grp];
  return std::min(tiles, split * ((tiles + kVecRun - 1) / kVecRun));
}
inline int run_split(const SharedScratch& sc, int groups, int nkv) {
  const int threads = omp_get_num_threads();
  for (int split = 1;; ++split) {
    int tasks = 0;
    bool more = false;
    for (int grp = 0; grp < groups; ++grp) {
      const int runs = group_runs(sc, grp, split);
      tasks += nkv * runs;
      more |= runs < sc.tile_at[grp + 1] - sc.tile_at[grp];
    }
    const int slots = (tasks + threads - 1) / threads * threads;
    if (!more || 20 * tasks >= 17 * slots) return split;
  }
}
inline int tile_runs(const SharedScratch& sc, int groups, int split) {
  int runs = 0;
  for (int grp = 0; grp < groups; ++grp) runs += group_runs(sc, grp, split);
  return runs;
}
inline TileRun tile_run(const SharedScratch& sc, int run, int split) {
  int grp = 0, runs = group_runs(sc, 0, split);
  for (; run >= runs; runs = group_runs(sc, ++grp, split)) run -= runs;
  const int tiles = sc.tile_at[grp + 1] - sc.tile_at[grp];
  return {grp, sc.tile_at[grp] + run * tiles / runs, sc.tile_at[grp] + (run + 1) * tiles / runs};
}

// Query i of group g (its rows' heads in order): the row's query index, row * group + head
inline int group_query(const Step& st, int g, int i, int group) {
  return st.group_rows[st.group_start[g] + i / group] * group + i % group;
}

// Step 1 of each way (the queries gathered into tiles of query_tile): query r of query tile qt for kv head g -- its
// head's row in qkv -- or nullptr past its group's queries (the tile's padding)
template <class T>
inline const T* tile_query(const Model& md, const Step& st, const SharedScratch& sc, const T* qkv, int g, int qt,
                           int r) {
  const int group = md.heads / md.kv_heads, width = (md.heads + 2 * md.kv_heads) * md.head_dim;
  const int grp = group_of(sc.tile_at, st.groups, qt), i = (qt - sc.tile_at[grp]) * query_tile(md) + r;
  if (i >= (st.group_start[grp + 1] - st.group_start[grp]) * group) return nullptr;
  const int qi = group_query(st, grp, i, group);
  return qkv + int64_t(qi / group) * width + (g * group + qi % group) * md.head_dim;
}

// How many of group g's shared slots its query i sees (Step.row_shared: the whole run, or a row's own context where
// a request's rows score their earlier slots through the group)
inline int query_reach(const Step& st, int g, int i, int group) {
  return st.row_shared[st.group_rows[st.group_start[g] + i / group]];
}

#if RS_AVX512
// e^x for the probabilities (x <= 0 where it is kept), to ~3e-6 relative: n = round(x log2 e), r = x - n ln 2 in
// [-0.35, 0.35], e^r by its Taylor polynomial to r^5, times 2^n -- half exp16's work, and far below the bf16
// rounding the probabilities then take
inline __m512 exp_probability(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif

// Kv head g's key and value rows (head dim D each) of shared slots j0 .. j1 - 1 asked for from memory: a task
// packs or widens one block of shared keys while the next block's rows arrive
template <class T>
inline void prefetch_rows(const T* kp, const T* vp, const int64_t* head, int j0, int j1, int nkv, int g, int D) {
  for (int j = j0; j < j1; ++j) {
    prefetch_lines(kp + (head[j] * nkv + g) * D, D * sizeof(T));
    prefetch_lines(vp + (head[j] * nkv + g) * D, D * sizeof(T));
  }
}

}  // namespace rs
