// Decode attention when rows of the batch start with the same run of slots (a shared system prompt, few-shot
// examples, a document): each group of such rows (Step.groups: one per prefix, as the radix tree yields them under
// mixed traffic) has its shared keys scored for all its rows' queries at once, and only each row's own keys the
// usual way; the two softmax states are then merged (log-sum-exp). Rows in no group take the per-row path for their
// whole context. Scoring the shared keys row by row costs every row the whole prefix; here each shared key and
// value, prepared once per step, serves many queries from registers.
//
// Three ways to score them, by what the CPU has:
//  - AMX tiles (bf16, head dim 64), as matrix products:
//      per kv head:  Q  [rows x group queries, 64]  (padded to tiles of 16)
//                    Kt [shared keys / 16][2 halves of the head dim][16 dim pairs][16 keys]   (B tiles of S = Q K^T)
//                    Vp [shared keys / 32][4 groups of 16 dims][16 key pairs][16 dims]       (B tiles of O = P V)
//    (each group's blocks and query tiles one after another), two passes over the shared keys per query tile --
//    the scores and the rows' maxima first (the scores kept), then exp and the value sums -- so the value sums can
//    stay in tiles (an online softmax would rescale them after every block). Where every group's queries fit
//    kAmxRun tiles (decode) a task per group and kv head packs Kt and Vp itself, block by block, reading the
//    prefix from the pool once; otherwise (prefill) they are packed once for the step and a task scores each tile;
//  - AVX-512 BF16 dot products with a tile's 16 queries in a vector's lanes (bf16 where AMX tiles are not granted;
//    head dims that are multiples of 16): each key's bf16 pairs broadcast from the pool as they are, an online
//    softmax lane by lane (shared_lanes.h);
//  - vector registers (AVX-512 or AVX2; any model dtype, head dims that are multiples of 16, a pool in the model's
//    dtype), an online softmax per tile of kVecQueries queries over blocks of 16 shared keys:
//      per kv head:  Q  [query tiles][kVecQueries][head dim] float, times the softmax scale
//      per task:     Kt [head dim][16 keys] float, one block: its scores, 16 keys to a vector, are the sum over
//                       dims of a query's value (broadcast) times a row of Kt
//                    V  [16 keys][head dim] float, the same block: the value sums, 16 dims to a vector
//    a task takes a run of up to kVecRun query tiles of one group: each block widened to float once for the run,
//    in L1, each load serving a tile's queries (the per-row path loads every key once per row, and on AVX2 sums
//    each key's dot product across lanes). Sums in float32 in another order than the per-row path: the same values
//    to float32 rounding, and bf16 outputs rounded once from them (tests/test_native_decode.py).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "abi.h"
#include "shared_amx.h"
#include "shared_groups.h"
#include "shared_lanes.h"
#include "shared_vector.h"
#include "simd.h"

namespace rs {

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

template <class T>
inline void attention_shared(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out,
                             const SharedScratch& sc) {
  if (amx_shared(md)) {
    amx_shared_scores(md, ly, st, qkv, sc);
    return own_keys_and_merge(md, ly, st, qkv, out, sc);
  }
#if RS_AVX512
  if constexpr (std::is_same_v<T, bf16>)
    if (lane_shared(md)) {
      lane_shared_scores(md, ly, st, qkv, sc);
      return own_keys_and_merge(md, ly, st, qkv, out, sc);
    }
#endif
  vector_shared_scores(md, ly, st, qkv, sc);
  own_keys_and_merge(md, ly, st, qkv, out, sc);
}

}  // namespace rs
