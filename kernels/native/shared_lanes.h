// Shared-prefix attention with AVX-512 BF16 dot products (bf16 models where AMX tiles are not granted), steps 1 and
// 2 (attention_shared.h): a tile's 16 queries sit in the 16 lanes of a vector, so a block of 16 shared keys is
// scored by broadcasting each key's bf16 pairs from the pool's rows as they are -- no transposing, no widening --
// and its online softmax runs lane-wise, with no sums across lanes:
//   per kv head:  Q  [query tiles][head dim / 2][16 queries] bf16 pairs (the queries as the step computed them)
//   per task:     K  [16 keys][head dim] bf16, one block of the pool's rows:  S[key] (a vector over the queries)
//                    = the sum over dim pairs of vdpbf16ps(Q pair, key's pair broadcast)
//                 V  [8 key pairs][head dim] bf16 pairs of the block's value rows:  O[dim] (over the queries)
//                    += the sum over key pairs of vdpbf16ps(P pair, the value pair broadcast)
// Products of bf16 are exact and summed in float32; the probabilities take bf16 rounding for the value sums, as on
// the AMX path (their sums in float32).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "shared_groups.h"

namespace rs {

#if RS_AVX512

// Two vectors of bf16-rounded values as one of pairs: lane i holds (a[i], b[i])
inline BF32 pair_lanes(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return (BF32)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// One tile of 16 queries (lanes) over one block of 16 shared keys (kb: the keys' rows, [16][D] bf16; v2: the value
// rows in pairs, [8][D] of (row 2i, row 2i + 1)), of which lane r sees keys j0 + j < reach[r] only: its online
// softmax's maxima (best, the scaled scores'), sums (total) and value sums (acc, [D][16 lanes])
inline void lane_block(const uint32_t* q2, const uint32_t* kb, const uint32_t* v2, __m512i reach, int j0, int D,
                       float scale, __m512* best, __m512* total, float* acc) {
  const int pairs = D / 2;
  __m512 s[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
  for (int dp = 0; dp < pairs; ++dp) {
    const BF32 q = (BF32)_mm512_loadu_si512(q2 + dp * 16);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) s[j] = _mm512_dpbf16_ps(s[j], q, (BF32)_mm512_set1_epi32(int(kb[j * pairs + dp])));
  }
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 top = *best;
  __mmask16 seen[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    seen[j] = _mm512_cmpgt_epi32_mask(reach, _mm512_set1_epi32(j0 + j));
    s[j] = _mm512_mul_ps(s[j], sc);
    top = _mm512_mask_max_ps(top, seen[j], top, s[j]);
  }
  const __m512 fix = exp16(_mm512_sub_ps(*best, top));  // 1 where the block changes nothing; ~0 on the first
  *best = top;
  __m512 sum = _mm512_setzero_ps();
  BF32 p2[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_maskz_mov_ps(seen[2 * i], exp_probability(_mm512_sub_ps(s[2 * i], top)));
    const __m512 b = _mm512_maskz_mov_ps(seen[2 * i + 1], exp_probability(_mm512_sub_ps(s[2 * i + 1], top)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    p2[i] = pair_lanes(a, b);
  }
  *total = _mm512_fmadd_ps(*total, fix, sum);
#pragma GCC unroll 4
  for (int d = 0; d < D; ++d) {
    __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + d * 16), fix);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) o = _mm512_dpbf16_ps(o, p2[i], (BF32)_mm512_set1_epi32(int(v2[i * D + d])));
    _mm512_storeu_ps(acc + d * 16, o);
  }
}

// Block j0's keys and values of kv head g (nj <= 16 of them, zeros after) from the pool into a task's buffers:
// kb [16][D] bf16 rows as they are, v2 [8][D] pairs of value rows
inline void lane_gather(const bf16* kp, const bf16* vp, const int64_t* head, int j0, int nj, int nkv, int g, int D,
                        uint32_t* kb, uint32_t* v2) {
  for (int j = 0; j < 16; ++j) {
    uint16_t* to = reinterpret_cast<uint16_t*>(kb) + j * D;
    if (j < nj) std::memcpy(to, kp + (head[j0 + j] * nkv + g) * D, D * 2);
    else std::memset(to, 0, D * 2);
  }
  for (int i = 0; i < 8; ++i) {
    const bf16* a = 2 * i < nj ? vp + (head[j0 + 2 * i] * nkv + g) * D : nullptr;
    const bf16* b = 2 * i + 1 < nj ? vp + (head[j0 + 2 * i + 1] * nkv + g) * D : nullptr;
    for (int d = 0; d < D; d += 16) {
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d))) : _mm512_setzero_si512();
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + d))) : _mm512_setzero_si512();
      _mm512_storeu_si512(v2 + i * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

inline void lane_shared_scores(const Model& md, const Layer& ly, const Step& st, const bf16* qkv,
                               const SharedScratch& sc) {
  const int D = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv;
  const int groups = st.groups, qtiles = sc.tile_at[groups], queries = st.rows * group, pairs = D / 2;
  const bf16* kp = static_cast<const bf16*>(ly.k_pool);
  const bf16* vp = static_cast<const bf16*>(ly.v_pool);
  uint32_t* qs = static_cast<uint32_t*>(sc.q);
  // 1. the queries gathered: tile t's dim pair p of lane r at qs[(t * pairs + p) * 16 + r] (zeros past the group's)
#pragma omp for schedule(static)
  for (int t = 0; t < nkv * qtiles; ++t) {
    uint32_t* q = qs + int64_t(t) * pairs * 16;
    for (int r = 0; r < 16; ++r) {
      const auto* from = reinterpret_cast<const uint32_t*>(tile_query(md, st, sc, qkv, t / qtiles, t % qtiles, r));
      for (int p = 0; p < pairs; ++p) q[p * 16 + r] = from ? from[p] : 0u;
    }
  }
  // 2. a task per run of up to kVecRun query tiles of a group and kv head (a run's kv heads one after another): each
  //    block of 16 shared keys gathered into the task's buffers once, then scored for every tile of the run
  const int split = run_split(sc, groups, nkv), runs = tile_runs(sc, groups, split);
#pragma omp for schedule(dynamic, 1) nowait
  for (int t = 0; t < nkv * runs; ++t) {
    const int g = t % nkv;
    const auto [grp, qt0, qt1] = tile_run(sc, t / nkv, split);
    const int mine = (st.group_start[grp + 1] - st.group_start[grp]) * group;
    const int64_t* head = st.slots + row_start(st, st.group_rows[st.group_start[grp]]);  // its first row's slots
    float* acc = sc.runs + omp_get_thread_num() * lane_run_floats(D);
    uint32_t* kb = reinterpret_cast<uint32_t*>(acc + kVecRun * 16 * D);
    uint32_t* v2 = kb + 8 * D;
    __m512 best[kVecRun], total[kVecRun];
    __m512i reach[kVecRun];
    int far = 0;
    for (int qt = qt0; qt < qt1; ++qt) {
      alignas(64) int32_t r[16];
      for (int l = 0; l < 16; ++l) {
        const int qi = (qt - sc.tile_at[grp]) * 16 + l;
        far = std::max(far, r[l] = qi < mine ? query_reach(st, grp, qi, group) : 0);
      }
      reach[qt - qt0] = _mm512_load_si512(r);
      best[qt - qt0] = _mm512_set1_ps(-1e30f);  // finite: a lane that sees no key of a block keeps its state
      total[qt - qt0] = _mm512_setzero_ps();
    }
    std::memset(acc, 0, sizeof(float) * (qt1 - qt0) * 16 * D);
    for (int j0 = 0; j0 < far; j0 += 16) {
      const int nj = std::min(16, far - j0);
      prefetch_rows(kp, vp, head, j0 + 16, std::min(j0 + 32, far), nkv, g, D);  // the next block's rows
      lane_gather(kp, vp, head, j0, nj, nkv, g, D, kb, v2);
      for (int qt = qt0; qt < qt1; ++qt)
        if (_mm512_cmpgt_epi32_mask(reach[qt - qt0], _mm512_set1_epi32(j0)))
          lane_block(qs + (int64_t(g) * qtiles + qt) * pairs * 16, kb, v2, reach[qt - qt0], j0, D, md.scale,
                     &best[qt - qt0], &total[qt - qt0], acc + int64_t(qt - qt0) * 16 * D);
    }
    for (int qt = qt0; qt < qt1; ++qt) {
      alignas(64) float b[16], s[16];
      _mm512_store_ps(b, best[qt - qt0]);
      _mm512_store_ps(s, total[qt - qt0]);
      const float* a = acc + int64_t(qt - qt0) * 16 * D;
      const int i0 = (qt - sc.tile_at[grp]) * 16;
      for (int l = 0; l < 16 && i0 + l < mine; ++l) {
        float* part = sc.part + (int64_t(g) * queries + group_query(st, grp, i0 + l, group)) * (2 + D);
        part[0] = b[l];
        part[1] = s[l];
        for (int d = 0; d < D; ++d) part[2 + d] = a[d * 16 + l];
      }
    }
  }
}

#endif

}  // namespace rs
