// Shared-prefix attention in vector registers (AVX-512 or AVX2), steps 1 and 2 (attention_shared.h): the
// queries gathered, then a task per run of query tiles scoring each block of shared keys widened once for it
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "shared_groups.h"

namespace rs {

// One tile of kVecQueries queries (q: float, scaled) over one block of nj <= 16 shared keys (kb: the keys
// transposed, [head dim][16]; vb: the values, [16][head dim]), of which query r sees the first seen[r] (where a
// request's rows see their own slots through the group; 0: none, a query past the group's): its online softmax's
// maxima, sums and value sums
inline void vector_block(const float* q, const float* kb, const float* vb, int nj, const int* seen, int D,
                         float* best, float* total, float* acc) {
  alignas(64) float p[kVecQueries][16];
  V16 s[kVecQueries];
#pragma GCC unroll 8
  for (int r = 0; r < kVecQueries; ++r) s[r] = zero16();
  for (int d = 0; d < D; ++d) {
    const V16 k = loadu(kb + d * 16);
#pragma GCC unroll 8
    for (int r = 0; r < kVecQueries; ++r) s[r] = fmadd(set1(q[r * D + d]), k, s[r]);
  }
  for (int r = 0; r < kVecQueries; ++r) {
    const M16 real = mask16(std::min(nj, seen[r]));
    if (!real) {  // nothing of the block for this query: its state unchanged
      storeu(p[r], zero16());
      continue;
    }
    const V16 sr = blend(set1(-INFINITY), real, s[r]);
    const float top = std::max(best[r], reduce_max(sr));
    const float fix = std::exp(best[r] - top);  // 0 on the first block
    best[r] = top;
    const V16 w = select(real, exp16(sr - set1(top)));
    total[r] = total[r] * fix + reduce_add(w);
    storeu(p[r], w);
    if (fix != 1.0f)
      for (int d = 0; d < D; d += 16) storeu(acc + r * D + d, loadu(acc + r * D + d) * set1(fix));
  }
  for (int d = 0; d < D; d += 16) {
    V16 o[kVecQueries];
#pragma GCC unroll 8
    for (int r = 0; r < kVecQueries; ++r) o[r] = loadu(acc + r * D + d);
    for (int j = 0; j < nj; ++j) {
      const V16 v = loadu(vb + j * D + d);
#pragma GCC unroll 8
      for (int r = 0; r < kVecQueries; ++r) o[r] = fmadd(set1(p[r][j]), v, o[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kVecQueries; ++r) storeu(acc + r * D + d, o[r]);
  }
}

template <class T>
inline void vector_shared_scores(const Model& md, const Layer& ly, const Step& st, const T* qkv,
                                 const SharedScratch& sc) {
  const int D = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv;
  const int groups = st.groups, qtiles = sc.tile_at[groups];
  const int queries = st.rows * group;
  const T* kp = static_cast<const T*>(ly.k_pool);
  const T* vp = static_cast<const T*>(ly.v_pool);
  float* qf = static_cast<float*>(sc.q);
  // 1. the queries gathered, scaled
#pragma omp for schedule(static)
  for (int t = 0; t < nkv * qtiles; ++t) {
    for (int r = 0; r < kVecQueries; ++r) {
      float* q = qf + (int64_t(t) * kVecQueries + r) * D;
      const T* from = tile_query(md, st, sc, qkv, t / qtiles, t % qtiles, r);
      for (int d = 0; d < D; d += 16) storeu(q + d, from ? load16(from + d, 0xffff) * set1(md.scale) : zero16());
    }
  }
  // 2. a task per run of up to kVecRun query tiles of a group and kv head (a run's kv heads one after another, so
  //    the threads read the same slots' rows): each block of 16 shared keys widened from the pool into the task's
  //    own buffers (keys transposed), then scored for every tile of the run while it sits in L1 -- an online softmax
  //    per tile. No float copy of the prefix goes through memory, and a block is widened once per run, not read
  //    back once per tile. No barrier after: step 3's tasks run beside these.
  const int split = run_split(sc, groups, nkv), runs = tile_runs(sc, groups, split);
#pragma omp for schedule(dynamic, 1) nowait
  for (int t = 0; t < nkv * runs; ++t) {
    const int g = t % nkv;
    const auto [grp, qt0, qt1] = tile_run(sc, t / nkv, split);
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group;
    const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
    const RunState run_state = run_state_of(sc, D);
    float *best = run_state.best, *total = run_state.total, *acc = run_state.acc, *kb = run_state.kb, *vb = run_state.vb;
    alignas(64) float key[16];
    int reach[kVecRun * kVecQueries], far = 0;  // how many shared slots each query sees (0: past the group's)
    for (int i = 0; i < (qt1 - qt0) * kVecQueries; ++i) {
      best[i] = -INFINITY;
      total[i] = 0.0f;
      const int qi = (qt0 - sc.tile_at[grp]) * kVecQueries + i;
      far = std::max(far, reach[i] = qi < mine ? query_reach(st, grp, qi, group) : 0);
    }
    std::memset(acc, 0, sizeof(float) * (qt1 - qt0) * kVecQueries * D);
    for (int j0 = 0; j0 < far; j0 += 16) {
      const int nj = std::min(16, far - j0);
      prefetch_rows(kp, vp, head, j0 + 16, std::min(j0 + 32, far), nkv, g, D);  // the next block's rows
      for (int n = 0; n < 16; ++n) {
        for (int d = 0; d < D; d += 16) {
          if (n < nj) {
            storeu(key, load16(kp + (head[j0 + n] * nkv + g) * D + d, 0xffff));
            storeu(vb + n * D + d, load16(vp + (head[j0 + n] * nkv + g) * D + d, 0xffff));
          } else {
            storeu(key, zero16());
            storeu(vb + n * D + d, zero16());
          }
          for (int i = 0; i < 16; ++i) kb[(d + i) * 16 + n] = key[i];
        }
      }
      for (int qt = qt0; qt < qt1; ++qt) {
        int seen[kVecQueries], any = 0;
        for (int r = 0; r < kVecQueries; ++r) any |= seen[r] = std::max(0, reach[(qt - qt0) * kVecQueries + r] - j0);
        if (any)
          vector_block(qf + (int64_t(g) * qtiles + qt) * kVecQueries * D, kb, vb, nj, seen, D,
                       best + (qt - qt0) * kVecQueries, total + (qt - qt0) * kVecQueries,
                       acc + int64_t(qt - qt0) * kVecQueries * D);
      }
    }
    for (int qt = qt0; qt < qt1; ++qt) {
      const int i0 = (qt - sc.tile_at[grp]) * kVecQueries;
      for (int r = 0; r < kVecQueries && i0 + r < mine; ++r) {
        float* part = sc.part + (int64_t(g) * queries + group_query(st, grp, i0 + r, group)) * (2 + D);
        const int u = (qt - qt0) * kVecQueries + r;
        part[0] = best[u];
        part[1] = total[u];
        std::memcpy(part + 2, acc + int64_t(u) * D, D * 4);
      }
    }
  }
}

}  // namespace rs
