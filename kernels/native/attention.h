// Decode attention over the paged KV pool: each row's query heads of one kv head attend to the row's context,
// read through its slot indices.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "abi.h"
#include "simd.h"

namespace rs {

constexpr int kKeys = 64;  // keys per chunk of the generic online softmax

template <class T>
inline float dot_head(const T* q, const T* k, int hd) {
  V16 a = zero16();
  if constexpr (std::is_same_v<T, bf16>) {
    for (int i = 0; i < hd; i += 32) a = dot_bf16(a, load_bf32(q + i, hd - i), load_bf32(k + i, hd - i));
  } else {
    for (int i = 0; i < hd; i += 16) {
      const M16 mk = mask16(hd - i);
      a = fmadd(load16(q + i, mk), load16(k + i, mk), a);
    }
  }
  return reduce_add(a);
}

// A task is (row, kv head, share of the row's keys): an online softmax whose state -- per query head the running
// max, the sum of exp and the weighted sum of values -- is written out normalized when the task has the whole
// row, or as a partial that a merge phase combines (log-sum-exp) when the row's keys were split among tasks
// because there are too few rows x kv heads to keep every thread busy.

struct SoftmaxState {  // one task's state for up to kMaxGroup query heads
  float best[kMaxGroup], total[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
};

// The pool as the generic path reads it: `at` is a (slot, kv head) pair's index, slot * kv_heads + head.
template <class T>
struct PlainKV {  // K/V in the model's dtype
  const T* k;
  const T* v;
  int hd;
  float dot(const T* q, int64_t at) const { return dot_head(q, k + at * hd, hd); }
  V16 value(int64_t at, int i, M16 mk) const { return load16(v + at * hd + i, mk); }
};
// 8-bit codes (model/kv_codes.py) as floats, format F (abi.h): kCodeUnit<F> times what load_codes16 reads
template <int F>
inline V16 load_codes16(const uint8_t* p, M16 m) {
  const __m128i b = load_code_bytes(p, m);
  if constexpr (F == kInt8Codes) return int8_codes(b);
  const __m256i w = _mm256_cvtepu8_epi16(b);
  if constexpr (F == kE5M2Codes) return half_codes(_mm256_slli_epi16(w, 8));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  return half_codes(_mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7)));
}
template <int F>
constexpr float kCodeUnit = F == kE4M3Codes ? 256.0f : 1.0f;  // e4m3 codes read as fp16 are 2^-8 of their values

template <int F>
struct CodedKV {  // K/V as 8-bit codes with a scale per (slot, kv head): a key's dot taken on its codes, then scaled
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;
  const float* v_scale;
  int hd;
  float key_scale(int64_t at) const { return k_scale[at] * kCodeUnit<F>; }
  float value_scale(int64_t at) const { return v_scale[at] * kCodeUnit<F>; }
  template <class T>
  float dot(const T* q, int64_t at) const {
    V16 a = zero16();
    for (int i = 0; i < hd; i += 16) {
      const M16 mk = mask16(hd - i);
      a = fmadd(load16(q + i, mk), load_codes16<F>(k + at * hd + i, mk), a);
    }
    return reduce_add(a) * key_scale(at);
  }
  V16 value(int64_t at, int i, M16 mk) const { return load_codes16<F>(v + at * hd + i, mk) * set1(value_scale(at)); }
};

// The generic path: any head dim, any pool (PlainKV of either storage type, CodedKV).
template <class T, class KV>
inline void attend_keys(const T* q, const KV& kv, int nkv, int g, const int64_t* row, int len, int hd, int group,
                        float scale, SoftmaxState& st) {
  alignas(64) float score[kMaxGroup][kKeys];
  for (int j0 = 0; j0 < len; j0 += kKeys) {
    const int nj = std::min(kKeys, len - j0);
    for (int j = 0; j < nj; ++j) {
      const int64_t at = row[j0 + j] * nkv + g;
      for (int h = 0; h < group; ++h) score[h][j] = kv.dot(q + h * hd, at) * scale;
    }
    for (int h = 0; h < group; ++h) {
      float top = st.best[h];
      for (int j = 0; j < nj; ++j) top = std::max(top, score[h][j]);
      const float fix = std::exp(st.best[h] - top);  // rescales what earlier chunks summed (0 on the first)
      st.best[h] = top;
      V16 sum = zero16();
      for (int j = 0; j < nj; j += 16) {
        const M16 mk = mask16(nj - j);
        const V16 p = select(mk, exp16(load16(&score[h][j], mk) - set1(top)));
        store16(&score[h][j], p, mk);
        sum = sum + p;
      }
      st.total[h] = st.total[h] * fix + reduce_add(sum);
      for (int i = 0; i < hd; ++i) st.acc[h][i] *= fix;
    }
    for (int j = 0; j < nj; ++j) {
      const int64_t at = row[j0 + j] * nkv + g;
      for (int i = 0; i < hd; i += 16) {
        const M16 mk = mask16(hd - i);
        const V16 v = kv.value(at, i, mk);
        for (int h = 0; h < group; ++h)
          store16(&st.acc[h][i], fmadd(set1(score[h][j]), v, load16(&st.acc[h][i], mk)), mk);
      }
    }
  }
}

// Sixteen vectors in, one out: lane j = the sum of v[j]'s lanes (AVX-512: a transposing tree, 15 adds, not 16
// reductions; AVX2: the reductions)
#if RS_AVX512
struct SumTree {
  __m512 a[8];
  int n = 0;
  inline void push2(__m512 x, __m512 y) {  // v[2i], v[2i + 1]: halves added, x's 8 partials then y's
    a[n++] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  inline __m512 sums() const {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // block k of b[i]: 4 partials of v[4i + k]
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // block k of c[i]: 2 partials of v[8i + k], then 2 of v[8i + 4 + k]
      c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    // lane 4k + t of d holds v[4t + k]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, d);
  }
};
#else
struct SumTree {
  alignas(32) float s[16];
  int n = 0;
  inline void push2(V16 x, V16 y) {
    s[n++] = reduce_add(x);
    s[n++] = reduce_add(y);
  }
  inline V16 sums() const { return loadu(s); }
};
#endif

// A head's online softmax over one block of up to 16 keys (their scaled scores, the real ones in `real`): the
// running max and sum of exp updated, the value sums av rescaled to the new max, the keys' weights into p
template <int AV>
inline void online_softmax(V16 scores, M16 real, float& best, float& total, V16* av, float* p) {
  const V16 s = blend(set1(-INFINITY), real, scores);
  const float top = std::max(best, reduce_max(s));
  const float fix = std::exp(best - top);  // 0 on the first keys
  best = top;
  const V16 w = select(real, exp16(s - set1(top)));
  total = total * fix + reduce_add(w);
  storeu(p, w);
  for (int i = 0; i < AV; ++i) av[i] = av[i] * set1(fix);
}

// The cache lines of ``bytes`` from p (a head's key or value row) asked for from memory: a row's slots are
// scattered over the pool, which the hardware's prefetchers cannot follow
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// bf16, head dim HD (64 or 128), HS query heads of a group: queries and value sums kept in registers, the scores
// of 16 keys at a time summed by one tree.
template <int HD, int HS>
inline void attend_heads_bf16(const bf16* q, const bf16* kp, const bf16* vp, int nkv, int g, const int64_t* row,
                              int len, float scale, float* best, float* total, float (*acc)[kMaxHeadDim]) {
  constexpr int QV = HD / 32, AV = HD / 16;
  BF32 qv[HS][QV];
  V16 av[HS][AV];
  for (int h = 0; h < HS; ++h) {
    for (int i = 0; i < QV; ++i) qv[h][i] = load_bf32(q + h * HD + 32 * i);
    for (int i = 0; i < AV; ++i) av[h][i] = loadu(&acc[h][16 * i]);
  }
  alignas(64) float pbuf[HS][16];
  const V16 zero = zero16();
  for (int j0 = 0; j0 < len; j0 += 16) {
    const int nj = std::min(16, len - j0);
    const M16 real = mask16(nj);
    const bf16* key[16];
    for (int j = 0; j < 16; ++j) key[j] = kp + (row[j0 + std::min(j, nj - 1)] * nkv + g) * HD;
    // this block's values and the next block's keys on their way while the keys are scored
    for (int j = 0; j < nj; ++j) prefetch_lines(vp + (row[j0 + j] * nkv + g) * HD, HD * 2);
    for (int j = j0 + 16; j < std::min(j0 + 32, len); ++j) prefetch_lines(kp + (row[j] * nkv + g) * HD, HD * 2);
    for (int h = 0; h < HS; ++h) {
      SumTree tree;
      for (int j = 0; j < 16; j += 2) {
        V16 x = zero, y = zero;
        for (int i = 0; i < QV; ++i) {
          x = dot_bf16(x, qv[h][i], load_bf32(key[j] + 32 * i));
          y = dot_bf16(y, qv[h][i], load_bf32(key[j + 1] + 32 * i));
        }
        tree.push2(x, y);
      }
      online_softmax<AV>(tree.sums() * set1(scale), real, best[h], total[h], av[h], pbuf[h]);
    }
    for (int j = 0; j < nj; ++j) {
      const bf16* val = vp + (row[j0 + j] * nkv + g) * HD;
      V16 v[AV];
      for (int i = 0; i < AV; ++i) v[i] = load16(val + 16 * i, 0xffff);
      for (int h = 0; h < HS; ++h) {
        const V16 pj = set1(pbuf[h][j]);
        for (int i = 0; i < AV; ++i) av[h][i] = fmadd(pj, v[i], av[h][i]);
      }
    }
  }
  for (int h = 0; h < HS; ++h)
    for (int i = 0; i < AV; ++i) storeu(&acc[h][16 * i], av[h][i]);
}

// f(h0, std::integral_constant<int, n>{}) for each run of n <= K query heads of a group, from head h0
template <int K, class F>
inline void head_chunks(int group, F f) {
  for (int h0 = 0; h0 < group; h0 += K) {
    switch (std::min(K, group - h0)) {
      case 1: f(h0, std::integral_constant<int, 1>{}); break;
      case 2: f(h0, std::integral_constant<int, 2>{}); break;
      case 3: f(h0, std::integral_constant<int, 3>{}); break;
      default: f(h0, std::integral_constant<int, K>{});
    }
  }
}

template <int HD>
inline void attend_keys_bf16(const bf16* q, const bf16* kp, const bf16* vp, int nkv, int g, const int64_t* row,
                             int len, int group, float scale, SoftmaxState& st) {
  // query heads whose queries and sums fit the registers at once (AVX2: half as many, each half as wide)
  constexpr int kHeads = RS_AVX512 ? (HD == 64 ? 4 : 2) : 1;
  head_chunks<kHeads>(group, [&](int h0, auto hs) {
    attend_heads_bf16<HD, decltype(hs)::value>(q + h0 * HD, kp, vp, nkv, g, row, len, scale, st.best + h0,
                                               st.total + h0, st.acc + h0);
  });
}

// 8-bit codes, head dim HD (64 or 128), HS query heads: as attend_heads_bf16, with queries in fp32 and each key's
// dot taken on its codes, scaled once (its value's scale folded into its softmax weight)
template <int F, int HD, int HS, class T>
inline void attend_heads_codes(const T* q, const CodedKV<F>& kv, int nkv, int g, const int64_t* row, int len,
                               float scale, float* best, float* total, float (*acc)[kMaxHeadDim]) {
  constexpr int AV = HD / 16;
  V16 qv[HS][AV], av[HS][AV];
  for (int h = 0; h < HS; ++h)
    for (int i = 0; i < AV; ++i) {
      qv[h][i] = load16(q + h * HD + 16 * i, 0xffff);
      av[h][i] = loadu(&acc[h][16 * i]);
    }
  alignas(64) float pbuf[HS][16], kscale[16];
  for (int j0 = 0; j0 < len; j0 += 16) {
    const int nj = std::min(16, len - j0);
    const M16 real = mask16(nj);
    int64_t at[16];
    for (int j = 0; j < 16; ++j) {
      at[j] = row[j0 + std::min(j, nj - 1)] * nkv + g;
      kscale[j] = kv.key_scale(at[j]) * scale;
    }
    for (int j = 0; j < nj; ++j) prefetch_lines(kv.v + at[j] * HD, HD);  // as attend_heads_bf16
    for (int j = j0 + 16; j < std::min(j0 + 32, len); ++j) prefetch_lines(kv.k + (row[j] * nkv + g) * HD, HD);
    for (int h = 0; h < HS; ++h) {
      SumTree tree;
      for (int j = 0; j < 16; j += 2) {
        V16 x = zero16(), y = zero16();
        for (int i = 0; i < AV; ++i) {
          x = fmadd(qv[h][i], load_codes16<F>(kv.k + at[j] * HD + 16 * i, 0xffff), x);
          y = fmadd(qv[h][i], load_codes16<F>(kv.k + at[j + 1] * HD + 16 * i, 0xffff), y);
        }
        tree.push2(x, y);
      }
      online_softmax<AV>(tree.sums() * loadu(kscale), real, best[h], total[h], av[h], pbuf[h]);
    }
    for (int j = 0; j < nj; ++j) {
      V16 v[AV];
      for (int i = 0; i < AV; ++i) v[i] = load_codes16<F>(kv.v + at[j] * HD + 16 * i, 0xffff);
      const float vs = kv.value_scale(at[j]);
      for (int h = 0; h < HS; ++h) {
        const V16 pj = set1(pbuf[h][j] * vs);
        for (int i = 0; i < AV; ++i) av[h][i] = fmadd(pj, v[i], av[h][i]);
      }
    }
  }
  for (int h = 0; h < HS; ++h)
    for (int i = 0; i < AV; ++i) storeu(&acc[h][16 * i], av[h][i]);
}

// A task's keys over an 8-bit pool: the register-held path for head dims 64 and 128, the generic one otherwise
template <int F, class T>
inline void attend_keys_codes(const Layer& ly, const T* q, int nkv, int g, const int64_t* row, int len, int hd,
                              int group, float scale, SoftmaxState& st) {
  const CodedKV<F> kv{static_cast<const uint8_t*>(ly.k_pool), static_cast<const uint8_t*>(ly.v_pool), ly.k_scale,
                      ly.v_scale, hd};
  constexpr int kHeads = RS_AVX512 ? 2 : 1;
  if (hd == 64 || hd == 128) {
    head_chunks<kHeads>(group, [&](int h0, auto hs) {
      if (hd == 64)
        attend_heads_codes<F, 64, decltype(hs)::value>(q + h0 * hd, kv, nkv, g, row, len, scale, st.best + h0,
                                                       st.total + h0, st.acc + h0);
      else
        attend_heads_codes<F, 128, decltype(hs)::value>(q + h0 * hd, kv, nkv, g, row, len, scale, st.best + h0,
                                                        st.total + h0, st.acc + h0);
    });
  } else {
    attend_keys(q, kv, nkv, g, row, len, hd, group, scale, st);
  }
}

// How many tasks share each row's keys: enough tasks for every thread when rows x kv heads are few, never
// shares of fewer than 64 keys, at most kMaxSplit.
constexpr int kMaxSplit = 8;
inline int attention_split(int rows, int nkv, int max_len, int threads) {
  const int tasks = rows * nkv;
  if (tasks >= 2 * threads) return 1;
  const int want = (4 * threads + tasks - 1) / tasks;
  return std::max(1, std::min({want, kMaxSplit, (max_len + 63) / 64}));
}

inline void reset(SoftmaxState& s, int group, int hd) {  // no keys yet
  for (int h = 0; h < group; ++h) {
    s.best[h] = -INFINITY;
    s.total[h] = 0.0f;
    for (int i = 0; i < hd; ++i) s.acc[h][i] = 0.0f;
  }
}

// The query heads of kv head g (q: the group's first head) over len keys of a row's slots, into s: the path for
// this pool and head dim
template <class T>
inline void attend_row(const Model& md, const Layer& ly, const T* q, int g, const int64_t* row, int len,
                       SoftmaxState& s) {
  const int hd = md.head_dim, nkv = md.kv_heads, group = md.heads / md.kv_heads;
  const T* kp = static_cast<const T*>(ly.k_pool);
  const T* vp = static_cast<const T*>(ly.v_pool);
  if (md.kv_codes == kInt8Codes) {
    attend_keys_codes<kInt8Codes>(ly, q, nkv, g, row, len, hd, group, md.scale, s);
  } else if (md.kv_codes == kE4M3Codes) {
    attend_keys_codes<kE4M3Codes>(ly, q, nkv, g, row, len, hd, group, md.scale, s);
  } else if (md.kv_codes == kE5M2Codes) {
    attend_keys_codes<kE5M2Codes>(ly, q, nkv, g, row, len, hd, group, md.scale, s);
  } else if constexpr (std::is_same_v<T, bf16>) {
    if (hd == 64) attend_keys_bf16<64>(q, kp, vp, nkv, g, row, len, group, md.scale, s);
    else if (hd == 128) attend_keys_bf16<128>(q, kp, vp, nkv, g, row, len, group, md.scale, s);
    else attend_keys(q, PlainKV<T>{kp, vp, hd}, nkv, g, row, len, hd, group, md.scale, s);
  } else {
    attend_keys(q, PlainKV<T>{kp, vp, hd}, nkv, g, row, len, hd, group, md.scale, s);
  }
}

template <class T>
inline void attention(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out, int split,
                      float* partials) {
  const int hd = md.head_dim, nq = md.heads, nkv = md.kv_heads, group = nq / nkv;
  const int width = (nq + 2 * nkv) * hd;
  const int64_t part = int64_t(group) * (hd + 2);  // floats of one task's partial: best, total, acc per head
#pragma omp for schedule(dynamic, 1)
  for (int t = 0; t < st.rows * nkv * split; ++t) {
    const int m = t / (nkv * split), g = t / split % nkv, c = t % split;
    const int len = row_len(st, m);
    const int share = (len + split - 1) / split, j0 = std::min(len, c * share), j1 = std::min(len, j0 + share);
    const int64_t* row = st.slots + row_start(st, m) + j0;
    const T* q = qkv + int64_t(m) * width + g * group * hd;
    SoftmaxState s;
    reset(s, group, hd);
    attend_row(md, ly, q, g, row, j1 - j0, s);
    if (split == 1) {
      for (int h = 0; h < group; ++h) {
        T* o = out + int64_t(m) * nq * hd + (g * group + h) * hd;
        const V16 inv = set1(1.0f / s.total[h]);
        for (int i = 0; i < hd; i += 16) {
          const M16 mk = mask16(hd - i);
          store16(o + i, rnd16<T>(load16(&s.acc[h][i], mk) * inv), mk);
        }
      }
    } else {
      float* p = partials + int64_t(t) * part;
      for (int h = 0; h < group; ++h) {
        p[h * (hd + 2)] = s.best[h];
        p[h * (hd + 2) + 1] = s.total[h];
        std::memcpy(p + h * (hd + 2) + 2, s.acc[h], sizeof(float) * hd);
      }
    }
  }
  if (split == 1) return;
#pragma omp for schedule(static)
  for (int t = 0; t < st.rows * nkv; ++t) {  // merge a row's shares: rescale each to the largest max, add
    const int m = t / nkv, g = t % nkv;
    for (int h = 0; h < group; ++h) {
      const float* p0 = partials + int64_t(t) * split * part + h * (hd + 2);
      float top = -INFINITY;
      for (int c = 0; c < split; ++c) top = std::max(top, p0[c * part]);
      float total = 0.0f;
      alignas(64) float acc[kMaxHeadDim] = {};
      for (int c = 0; c < split; ++c) {
        const float* p = p0 + c * part;
        if (p[1] == 0.0f) continue;  // an empty share
        const float w = std::exp(p[0] - top);
        total += w * p[1];
        for (int i = 0; i < hd; ++i) acc[i] += w * p[2 + i];
      }
      T* o = out + int64_t(m) * nq * hd + (g * group + h) * hd;
      const V16 inv = set1(1.0f / total);
      for (int i = 0; i < hd; i += 16) {
        const M16 mk = mask16(hd - i);
        store16(o + i, rnd16<T>(load16(&acc[i], mk) * inv), mk);
      }
    }
  }
}

}  // namespace rs
