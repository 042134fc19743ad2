// Decode attention when rows of the batch start with the same run of slots (a shared system prompt, few-shot
// examples, a document): each group of such rows (Step.groups: one per prefix, as the radix tree yields them under
// mixed traffic) has its shared keys scored for all its rows' queries at once, and only each row's own keys the
// usual way; the two softmax states are then merged (log-sum-exp). Rows in no group take the per-row path for their
// whole context. Scoring the shared keys row by row costs every row the whole prefix; here each shared key and
// value, prepared once per step, serves many queries from registers.
//
// Two ways to score them, by what the CPU has:
//  - AMX tiles (bf16, head dim 64), as matrix products:
//      per kv head:  Q  [rows x group queries, 64]  (padded to tiles of 16)
//                    Kt [shared keys / 16][2 halves of the head dim][16 dim pairs][16 keys]   (B tiles of S = Q K^T)
//                    Vp [shared keys / 32][4 groups of 16 dims][16 key pairs][16 dims]       (B tiles of O = P V)
//    (each group's blocks and query tiles one after another), two passes over the shared keys per query tile --
//    the rows' maxima first, then exp and the value sums -- so the value sums can stay in tiles (an online softmax
//    would rescale them after every block);
//  - vector registers (AVX-512 or AVX2; any model dtype, head dims that are multiples of 16, a pool in the model's
//    dtype), an online softmax per tile of kVecQueries queries over blocks of 16 shared keys:
//      per kv head:  Kt [shared keys / 16][head dim][16 keys] float: a block's scores, 16 keys to a vector, are
//                       sum over dims of a query's value (broadcast) times a row of Kt
//                    V  [shared keys][head dim] float: the value sums, 16 dims to a vector
//                    Q  [query tiles][kVecQueries][head dim] float, times the softmax scale
//    every key and value widened to float once per step, then read from cache by each query tile, each load
//    serving the tile's queries (the per-row path loads every key once per row, and on AVX2 sums each key's dot
//    product across lanes). Sums in float32 in another order than the per-row path: the same values to float32
//    rounding, and bf16 outputs rounded once from them (tests/test_native_decode.py).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "abi.h"
#include "attention.h"
#include "dense_tiles.h"
#include "simd.h"

namespace rs {

constexpr int kSharedDim = 64;   // the head dim the AMX path takes
constexpr int kVecQueries = RS_AVX512 ? 4 : 6;  // queries a vector-path task scores together

inline bool amx_shared(const Model& md) {
  return kHaveAmx && md.amx && md.bf16 && !md.kv_codes && md.head_dim == kSharedDim;
}
inline bool vector_shared(const Model& md) { return !md.kv_codes && md.head_dim % 16 == 0; }
inline bool shared_path(const Model& md, const Step& st) {
  return st.groups > 0 && (amx_shared(md) || vector_shared(md));
}

struct SharedScratch {
  void* kt;     // AMX: uint32_t [nkv][blocks32][2][2][16][16]; vector: float [nkv][blocks16][head dim][16]
  void* v;      // AMX: uint32_t [nkv][blocks32][4][16][16];     vector: float [nkv][blocks16 x 16][head dim]
  void* q;      // AMX: bf16 [nkv][qtiles of 16][16][64];        vector: float [nkv][qtiles][kVecQueries][head dim]
  float* part;  // [2][nkv][rows * group][2 + head dim]: max, sum, value sums -- of the shared keys, of each row's own
  int32_t* block_at;  // [groups + 1]: group g's key blocks (32 keys for AMX, else 16) are block_at[g] .. [g + 1]
  int32_t* tile_at;   // [groups + 1]: its query tiles (16 queries for AMX, else kVecQueries), the same way
};

inline int shared_block(const Model& md) { return amx_shared(md) ? 32 : 16; }
inline int query_tile(const Model& md) { return amx_shared(md) ? 16 : kVecQueries; }

// The scratch of a step of ``rows`` rows in ``groups`` groups sharing ``shared`` slots in all: each group's blocks
// and tiles rounded up, so at most one more of each per group than the totals need
inline SharedScratch carve_shared(const Model& md, int64_t rows, int64_t groups, int64_t shared, void* base,
                                  int64_t* total) {
  const int64_t nkv = md.kv_heads, group = md.heads / std::max(1, md.kv_heads), D = md.head_dim;
  const int64_t queries = rows * group, blocks = shared / shared_block(md) + groups;
  const int64_t tiles = queries / query_tile(md) + groups;
  const int64_t part = 2 * nkv * queries * (2 + D) * 4;  // the shared part's, then each row's own
  int64_t sizes[6] = {nkv * blocks * 16 * D * 4, nkv * blocks * 16 * D * 4, nkv * tiles * kVecQueries * D * 4, part,
                      (groups + 1) * 4, (groups + 1) * 4};
  if (amx_shared(md)) {
    sizes[0] = nkv * blocks * 2 * 2 * 1024;
    sizes[1] = nkv * blocks * 4 * 1024;
    sizes[2] = nkv * tiles * 16 * kSharedDim * 2;
  }
  void* parts[6];
  const int64_t off = lay_out(sizes, 6, base, parts);
  if (total) *total = off;
  return {parts[0], parts[1], parts[2], static_cast<float*>(parts[3]), static_cast<int32_t*>(parts[4]),
          static_cast<int32_t*>(parts[5])};
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

// Query i of group g (its rows' heads in order): the row's query index, row * group + head
inline int group_query(const Step& st, int g, int i, int group) {
  return st.group_rows[st.group_start[g] + i / group] * group + i % group;
}

// The key and value rows (``width`` = kv heads x head dim each) of shared slots j0 .. j1 - 1 asked for from
// memory: step 1 packs a block's kv heads one after another while the next block's rows arrive
template <class T>
inline void prefetch_rows(const T* kp, const T* vp, const int64_t* head, int j0, int j1, int64_t width) {
  for (int j = j0; j < j1; ++j) {
    prefetch_lines(kp + head[j] * width, width * sizeof(T));
    prefetch_lines(vp + head[j] * width, width * sizeof(T));
  }
}

// ---- the vector path: steps 1 and 2 ----
template <class T>
inline void vector_shared_scores(const Model& md, const Layer& ly, const Step& st, const T* qkv,
                                 const SharedScratch& sc) {
  const int D = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv, width = (nq + 2 * nkv) * D;
  const int groups = st.groups, blocks = sc.block_at[groups], qtiles = sc.tile_at[groups];
  const int queries = st.rows * group;
  const T* kp = static_cast<const T*>(ly.k_pool);
  const T* vp = static_cast<const T*>(ly.v_pool);
  float* kt = static_cast<float*>(sc.kt);
  float* vf = static_cast<float*>(sc.v);
  float* qf = static_cast<float*>(sc.q);
  // 1. each group's shared keys transposed and values widened, 16 keys a task; the queries gathered, scaled
#pragma omp for schedule(static) nowait
  for (int t = 0; t < nkv * blocks; ++t) {  // a block's kv heads one after another: its slots' rows read whole
    const int g = t % nkv, blk = t / nkv, grp = group_of(sc.block_at, groups, blk);
    const int64_t at = int64_t(g) * blocks + blk;  // kv head-major in the scratch, as step 2 reads it
    const int shared = st.group_shared[grp], j0 = (blk - sc.block_at[grp]) * 16;
    const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
    float* kb = kt + at * D * 16;
    float* vb = vf + at * 16 * D;
    if (g == 0) prefetch_rows(kp, vp, head, j0 + 16, std::min(j0 + 32, shared), nkv * D);
    alignas(64) float key[16];
    for (int n = 0; n < 16; ++n) {
      const int j = j0 + n;
      for (int d = 0; d < D; d += 16) {
        if (j < shared) {
          storeu(key, load16(kp + (head[j] * nkv + g) * D + d, 0xffff));
          storeu(vb + n * D + d, load16(vp + (head[j] * nkv + g) * D + d, 0xffff));
        } else {
          storeu(key, zero16());
          storeu(vb + n * D + d, zero16());
        }
        for (int i = 0; i < 16; ++i) kb[(d + i) * 16 + n] = key[i];
      }
    }
  }
#pragma omp for schedule(static)
  for (int t = 0; t < nkv * qtiles; ++t) {
    const int g = t / qtiles, qt = t % qtiles, grp = group_of(sc.tile_at, groups, qt);
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group;  // the group's queries
    for (int r = 0; r < kVecQueries; ++r) {
      const int i = (qt - sc.tile_at[grp]) * kVecQueries + r;
      float* q = qf + (int64_t(t) * kVecQueries + r) * D;
      const int qi = i < mine ? group_query(st, grp, i, group) : 0;
      const T* from = qkv + int64_t(qi / group) * width + (g * group + qi % group) * D;
      for (int d = 0; d < D; d += 16) storeu(q + d, i < mine ? load16(from + d, 0xffff) * set1(md.scale) : zero16());
    }
  }
  // 2. per tile of queries, an online softmax over its group's shared blocks (no barrier after: step 3's tasks run
  //    beside these)
#pragma omp for schedule(dynamic, 1) nowait
  for (int t = 0; t < nkv * qtiles; ++t) {
    const int g = t / qtiles, qt = t % qtiles, grp = group_of(sc.tile_at, groups, qt);
    const int shared = st.group_shared[grp], b16 = sc.block_at[grp + 1] - sc.block_at[grp];
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group, i0 = (qt - sc.tile_at[grp]) * kVecQueries;
    const float* q = qf + int64_t(t) * kVecQueries * D;
    const float* kg = kt + (int64_t(g) * blocks + sc.block_at[grp]) * D * 16;
    const float* vg = vf + (int64_t(g) * blocks + sc.block_at[grp]) * 16 * D;
    float best[kVecQueries], total[kVecQueries];
    alignas(64) float acc[kVecQueries][kMaxHeadDim];
    alignas(64) float p[kVecQueries][16];
    for (int r = 0; r < kVecQueries; ++r) {
      best[r] = -INFINITY;
      total[r] = 0.0f;
      for (int d = 0; d < D; ++d) acc[r][d] = 0.0f;
    }
    for (int b = 0; b < b16; ++b) {
      const float* kb = kg + int64_t(b) * D * 16;
      V16 s[kVecQueries];
#pragma GCC unroll 8
      for (int r = 0; r < kVecQueries; ++r) s[r] = zero16();
      for (int d = 0; d < D; ++d) {
        const V16 k = loadu(kb + d * 16);
#pragma GCC unroll 8
        for (int r = 0; r < kVecQueries; ++r) s[r] = fmadd(set1(q[r * D + d]), k, s[r]);
      }
      const int nj = std::min(16, shared - b * 16);
      const M16 real = mask16(nj);
      for (int r = 0; r < kVecQueries; ++r) {
        const V16 sr = blend(set1(-INFINITY), real, s[r]);
        const float top = std::max(best[r], reduce_max(sr));
        const float fix = std::exp(best[r] - top);  // 0 on the first block
        best[r] = top;
        const V16 w = select(real, exp16(sr - set1(top)));
        total[r] = total[r] * fix + reduce_add(w);
        storeu(p[r], w);
        if (fix != 1.0f)
          for (int d = 0; d < D; d += 16) storeu(&acc[r][d], loadu(&acc[r][d]) * set1(fix));
      }
      const float* vb = vg + int64_t(b) * 16 * D;
      for (int d = 0; d < D; d += 16) {
        V16 o[kVecQueries];
#pragma GCC unroll 8
        for (int r = 0; r < kVecQueries; ++r) o[r] = loadu(&acc[r][d]);
        for (int j = 0; j < nj; ++j) {
          const V16 v = loadu(vb + j * D + d);
#pragma GCC unroll 8
          for (int r = 0; r < kVecQueries; ++r) o[r] = fmadd(set1(p[r][j]), v, o[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < kVecQueries; ++r) storeu(&acc[r][d], o[r]);
      }
    }
    for (int r = 0; r < kVecQueries && i0 + r < mine; ++r) {
      float* part = sc.part + (int64_t(g) * queries + group_query(st, grp, i0 + r, group)) * (2 + D);
      part[0] = best[r];
      part[1] = total[r];
      std::memcpy(part + 2, acc[r], D * 4);
    }
  }
}

// ---- steps 3 and 4, both paths: each row's own keys, then the merge ----
template <class T>
inline void own_keys_and_merge(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out,
                               const SharedScratch& sc) {
  const int D = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv, width = (nq + 2 * nkv) * D;
  const int rows = st.rows, queries = rows * group;
  // 3. each row's own keys the usual way (tasks beside step 2's: neither reads the other), their states kept in
  //    the second half of the partials; this loop's barrier is the first after step 2, so the merge follows both
  float* own = sc.part + int64_t(nkv) * queries * (2 + D);
#pragma omp for schedule(dynamic, 1)
  for (int t = 0; t < rows * nkv; ++t) {
    const int m = t / nkv, g = t % nkv, len = row_len(st, m), shared = st.row_shared[m];
    SoftmaxState s;
    reset(s, group, D);
    if (len > shared)
      attend_row(md, ly, qkv + int64_t(m) * width + g * group * D, g, st.slots + row_start(st, m) + shared,
                 len - shared, s);
    float* keep = own + (int64_t(g) * queries + int64_t(m) * group) * (2 + D);
    for (int h = 0; h < group; ++h) {
      keep[h * (2 + D)] = s.best[h];
      keep[h * (2 + D) + 1] = s.total[h];
      std::memcpy(keep + h * (2 + D) + 2, s.acc[h], D * 4);
    }
  }
  // 4. the merge: both states rescaled to the larger maximum, added, normalized (a row in no group: its own alone)
#pragma omp for schedule(static)
  for (int t = 0; t < rows * nkv; ++t) {
    const int m = t / nkv, g = t % nkv;
    const bool grouped = st.row_shared[m] > 0;
    for (int h = 0; h < group; ++h) {
      const int64_t qi = int64_t(m) * group + h;
      const float* b = own + (int64_t(g) * queries + qi) * (2 + D);
      const float* a = grouped ? sc.part + (int64_t(g) * queries + qi) * (2 + D) : b;
      const float top = std::max(a[0], b[0]);
      const float wa = grouped && a[1] > 0 ? std::exp(a[0] - top) : 0.0f, wb = b[1] > 0 ? std::exp(b[0] - top) : 0.0f;
      const V16 inv = set1(1.0f / (wa * a[1] + wb * b[1]));
      T* o = out + int64_t(m) * nq * D + (g * group + h) * D;
      for (int i = 0; i < D; i += 16) {
        const V16 v = fmadd(set1(wa), loadu(a + 2 + i), set1(wb) * loadu(b + 2 + i));
        store16(o + i, rnd16<T>(v * inv), 0xffff);
      }
    }
  }
}

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

// S[16 queries][16 keys] of one 16-key block: two tile products over the halves of the head dim
inline void shared_scores(const bf16* qt, const uint32_t* kt_block, float (*s)[16]) {
  _tile_zero(0);
  _tile_loadd(1, qt, kSharedDim * 2);
  _tile_loadd(2, kt_block, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_loadd(1, qt + 32, kSharedDim * 2);
  _tile_loadd(2, kt_block + 256, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, s, 64);
}

template <class T>
inline void amx_shared_scores(const Model& md, const Layer& ly, const Step& st, const T* qkv,
                              const SharedScratch& sc) {
  constexpr int D = kSharedDim;
  const int nq = md.heads, nkv = md.kv_heads, group = nq / nkv, width = (nq + 2 * nkv) * D, rows = st.rows;
  const int groups = st.groups, blocks = sc.block_at[groups], qtiles = sc.tile_at[groups];
  const int queries = rows * group;
  const bf16* kp = static_cast<const bf16*>(ly.k_pool);
  const bf16* vp = static_cast<const bf16*>(ly.v_pool);
  // 1. each group's shared keys transposed for S = Q K^T, the values paired for O = P V, 32 keys a task; the
  //    queries gathered into tiles
#pragma omp for schedule(static) nowait
  for (int t = 0; t < nkv * blocks; ++t) {  // a block's kv heads one after another: its slots' rows read whole
    const int g = t % nkv, blk = t / nkv, grp = group_of(sc.block_at, groups, blk);
    const int64_t at = int64_t(g) * blocks + blk;  // kv head-major in the scratch, as step 2 reads it
    const int shared = st.group_shared[grp], j0 = (blk - sc.block_at[grp]) * 32;
    const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
    if (g == 0) prefetch_rows(kp, vp, head, j0 + 32, std::min(j0 + 64, shared), nkv * D);
    for (int sub = 0; sub < 2; ++sub) {  // 16 keys' 32 dim pairs, as two 16 x 16 transposes of dwords
      uint32_t* kt = static_cast<uint32_t*>(sc.kt) + (at * 2 + sub) * 2 * 256;
      __m512i half[2][16];
      for (int n = 0; n < 16; ++n) {
        const int j = j0 + sub * 16 + n;
        const bf16* key = kp + (j < shared ? head[j] * nkv + g : 0) * D;
        for (int h = 0; h < 2; ++h)
          half[h][n] = j < shared ? _mm512_loadu_si512(key + 32 * h) : _mm512_setzero_si512();
      }
      for (int h = 0; h < 2; ++h) {
        transpose16(half[h]);
        for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + h * 256 + p * 16, half[h][p]);
      }
    }
    uint32_t* v = static_cast<uint32_t*>(sc.v) + at * 4 * 256;
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
#pragma omp for schedule(static)
  for (int t = 0; t < nkv * qtiles; ++t) {
    const int g = t / qtiles, qt = t % qtiles, grp = group_of(sc.tile_at, groups, qt);
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group;  // the group's queries
    bf16* q = static_cast<bf16*>(sc.q) + int64_t(t) * 16 * D;
    for (int r = 0; r < 16; ++r) {
      const int i = (qt - sc.tile_at[grp]) * 16 + r;
      if (i < mine) {
        const int qi = group_query(st, grp, i, group);
        std::memcpy(q + r * D, qkv + int64_t(qi / group) * width + (g * group + qi % group) * D, D * 2);
      } else {
        std::memset(q + r * D, 0, D * 2);
      }
    }
  }
  // 2. the shared keys for every query tile: the maxima, then exp, sums and value sums (tiles 3-6)
  const __m512 scale = _mm512_set1_ps(md.scale);
#pragma omp for schedule(dynamic, 1) nowait
  for (int t = 0; t < nkv * qtiles; ++t) {
    const int g = t / qtiles, qt = t % qtiles, grp = group_of(sc.tile_at, groups, qt);
    const int shared = st.group_shared[grp], b16 = (shared + 15) / 16, b32 = (shared + 31) / 32;
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group, i0 = (qt - sc.tile_at[grp]) * 16;
    const int live = std::min(16, mine - i0);  // the tile's queries (a group's last tile may hold fewer)
    const bf16* q = static_cast<bf16*>(sc.q) + int64_t(t) * 16 * D;
    const int64_t first = int64_t(g) * blocks + sc.block_at[grp];  // the group's first block of this kv head
    const uint32_t* kt = static_cast<uint32_t*>(sc.kt) + first * 2 * 2 * 256;
    const uint32_t* vg = static_cast<uint32_t*>(sc.v) + first * 4 * 256;
    configure_tiles(16);
    alignas(64) float s[2][16][16];
    // each query's maximum kept across its 16 lanes until the end (scale > 0: taken after)
    alignas(64) float top[16], sum[16];
    __m512 most[16], total[16];
    for (int r = 0; r < 16; ++r) {
      most[r] = _mm512_set1_ps(-INFINITY);
      total[r] = _mm512_setzero_ps();
    }
    for (int b = 0; b < b16; ++b) {
      shared_scores(q, kt + int64_t(b) * 2 * 256, s[0]);
      const __mmask16 real = mask16(shared - b * 16);
      for (int r = 0; r < live; ++r) most[r] = _mm512_mask_max_ps(most[r], real, most[r], _mm512_load_ps(s[0][r]));
    }
    for (int r = 0; r < live; ++r) top[r] = _mm512_reduce_max_ps(most[r]) * md.scale;
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    alignas(64) bf16 p[16][32] = {};  // rows past the live ones stay 0
    for (int blk = 0; blk < b32; ++blk) {
      for (int sub = 0; sub < 2; ++sub) shared_scores(q, kt + (int64_t(blk) * 2 + sub) * 2 * 256, s[sub]);
      for (int r = 0; r < live; ++r) {
        __m512 e[2];
        for (int sub = 0; sub < 2; ++sub) {
          const __mmask16 real = mask16(shared - blk * 32 - sub * 16);
          e[sub] = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(s[sub][r]), scale),
                                                                 _mm512_set1_ps(top[r]))));
        }
        total[r] = _mm512_add_ps(total[r], _mm512_add_ps(e[0], e[1]));
        store16(&p[r][0], e[0], 0xffff);  // probabilities as bf16: the A tile of O += P V
        store16(&p[r][16], e[1], 0xffff);
      }
      _tile_loadd(1, p, 64);
      const uint32_t* vb = vg + int64_t(blk) * 4 * 256;
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
}

#else

template <class T>
inline void amx_shared_scores(const Model&, const Layer&, const Step&, const T*, const SharedScratch&) {}

#endif

template <class T>
inline void attention_shared(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out,
                             const SharedScratch& sc) {
  if (amx_shared(md)) amx_shared_scores(md, ly, st, qkv, sc);
  else vector_shared_scores(md, ly, st, qkv, sc);
  own_keys_and_merge(md, ly, st, qkv, out, sc);
}

}  // namespace rs
