// A whole decode step of a Llama-family model on the CPU in one call (rs_decode_step): every layer's norm,
// projections, RoPE, KV store, paged attention, SiLU-mul and residuals, then the final norm and the output
// projection of the rows that want logits.
//
// Why C++: at small batch a decode step is bound by streaming every weight once; torch spends as much again on
// hundreds of small ops and the fork/join of every library call. Here the step is one OpenMP region on torch's
// own threads (the same libgomp.so.1), its phases separated by barriers:
//
//   abi.h        the structures Python fills (pointers into its tensors) and the bounds both sides check
//   simd.h       bf16/fp32 storage; the vector vocabulary (16 fp32 lanes, bf16 pairs, int8 quads) on AVX-512 or
//                AVX2, loads and stores with torch's rounding, exp
//   dense_tiles.h  AMX tiles or BF16/FP32 vector tiles over weights packed in 16-row blocks
//   quant_tiles.h  int8/int4 blocks (GGUF's formats, the engine's own) times activations quantized to int8 (VNNI
//                  or AVX2), as llama.cpp computes them
//   products.h   linear layers: a product's tiles, each thread's share of W's blocks
//   attention.h  decode attention over the slot pool (online softmax; a row's keys split among threads when
//                rows are few)
//   attention_shared.h  the same where groups of rows share a prefix: its keys scored once for all their queries
//                (shared_groups.h the groups' scratch; shared_amx.h in AMX tiles, shared_vector.h in vectors)
//   decode.cpp   the element-wise pieces between the products, and the step
//
// Numerics follow the eager model: values are rounded to the storage type (bf16 or fp32) wherever an eager op
// would round (each product, each element-wise op, each residual); products and softmax accumulate in fp32. Only
// the order of summation differs, as between any two GEMM libraries (and quantized weights see quantized
// activations).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "abi.h"
#include "attention.h"
#include "attention_shared.h"
#include "products.h"
#include "simd.h"

namespace rs {

// ---- the pieces between the products ----

// out = w * round(x * rsqrt(mean(x^2) + eps)) per row: the eager RMSNorm's rounding (out may be x)
template <class T>
inline void rms_norm(const T* x, const T* w, int rows, int dim, float eps, T* out) {
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m) {
    const T* xm = x + int64_t(m) * dim;
    V16 ss = zero16();
    for (int i = 0; i < dim; i += 16) {
      const V16 v = load16(xm + i, mask16(dim - i));
      ss = fmadd(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(reduce_add(ss) / float(dim) + eps);
    for (int i = 0; i < dim; i += 16) {
      const M16 mk = mask16(dim - i);
      const V16 v = rnd16<T>(load16(xm + i, mk) * set1(inv));
      store16(out + int64_t(m) * dim + i, rnd16<T>(load16(w + i, mk) * v), mk);
    }
  }
}

// One head's value as an 8-bit code (model/kv_codes.py's encode, value for value): int8 rounds to nearest even
// within +-127; fp8 takes the nearer of the two codes around |y| (a tie: the even code, as round-to-nearest-even),
// the largest finite one beyond them, and y's sign
inline uint8_t encode_code(const Model& md, float y) {
  if (md.kv_codes == kInt8Codes) return uint8_t(int8_t(std::clamp(std::nearbyint(y), -127.0f, 127.0f)));
  const float a = std::fabs(y), *value = md.kv_values;
  int lo = 0, hi = md.kv_top, code = hi;
  if (a < value[hi]) {
    while (hi - lo > 1) {  // value[lo] <= a < value[hi]
      const int mid = (lo + hi) / 2;
      (value[mid] <= a ? lo : hi) = mid;
    }
    const float half = (value[lo] + value[hi]) * 0.5f;  // exact: fp8 values have at most 4 significant bits
    code = a < half ? lo : a > half ? hi : (lo % 2 == 0 ? lo : hi);
  }
  return uint8_t(code | (std::signbit(y) ? 0x80 : 0));
}

// A head of T into codes and its scale: the largest magnitude lands on kv_limit
template <class T>
inline void store_codes(const Model& md, const T* x, int hd, uint8_t* codes, float* scale) {
  float top = 0.0f;
  for (int i = 0; i < hd; ++i) top = std::max(top, std::fabs(to_f(x[i])));
  const float s = std::max(top, 1e-12f) / md.kv_limit;
  *scale = s;
  for (int i = 0; i < hd; ++i) codes[i] = encode_code(md, to_f(x[i]) / s);
}

// RoPE on a row's q and k heads in place (x * cos + roll(x, half) * sin), then its k and v into the pool
template <class T>
inline void rope_and_store(const Model& md, const Layer& ly, const Step& st, T* qkv) {
  const int hd = md.head_dim, half = hd / 2, nq = md.heads, nkv = md.kv_heads, width = (nq + 2 * nkv) * hd;
#pragma omp for schedule(static)
  for (int t = 0; t < st.rows * (nq + nkv); ++t) {
    const int m = t / (nq + nkv), head = t % (nq + nkv);
    T* x = qkv + int64_t(m) * width + head * hd;
    const T* c = static_cast<const T*>(st.cos) + int64_t(m) * hd;
    const T* s = static_cast<const T*>(st.sin) + int64_t(m) * hd;
    float tmp[kMaxHeadDim];
    for (int i = 0; i < hd; ++i) {
      const float rolled = to_f(x[i < half ? i + half : i - half]);
      tmp[i] = rnd<T>(rnd<T>(to_f(x[i]) * to_f(c[i])) + rnd<T>(rolled * to_f(s[i])));
    }
    for (int i = 0; i < hd; ++i) x[i] = from_f<T>(tmp[i]);
    if (head >= nq) {  // a k head: it and its v go to the row's new slot
      const int g = head - nq;
      const int64_t at = st.out_slot[m] * nkv + g;
      if (md.kv_codes) {
        store_codes(md, x, hd, static_cast<uint8_t*>(ly.k_pool) + at * hd, ly.k_scale + at);
        store_codes(md, x + nkv * hd, hd, static_cast<uint8_t*>(ly.v_pool) + at * hd, ly.v_scale + at);
      } else {
        std::memcpy(static_cast<T*>(ly.k_pool) + at * hd, x, sizeof(T) * hd);
        std::memcpy(static_cast<T*>(ly.v_pool) + at * hd, x + nkv * hd, sizeof(T) * hd);
      }
    }
  }
}

// act = round(round(silu(gate)) * up), gate and up the two halves of each row of gu
template <class T>
inline void silu_mul(const T* gu, int rows, int inter, T* act) {
#pragma omp for schedule(static)
  for (int m = 0; m < rows; ++m) {
    const T* g = gu + int64_t(m) * 2 * inter;
    for (int i = 0; i < inter; i += 16) {
      const M16 mk = mask16(inter - i);
      const V16 x = load16(g + i, mk);
      const V16 e = exp16(zero16() - x);
      const V16 silu = rnd16<T>(x / (set1(1.0f) + e));
      store16(act + int64_t(m) * inter + i, rnd16<T>(silu * load16(g + inter + i, mk)), mk);
    }
  }
}

// A step's intermediates, carved from one buffer the caller owns (rs_scratch_bytes says how big)
struct Scratch {
  void* xn;    // T [rows, hidden]: a norm's output
  void* qkv;   // T [rows, (heads + 2 kv_heads) head_dim]
  void* attn;  // T [rows, heads head_dim]
  void* gu;    // T [rows, 2 inter]
  void* act;   // T [rows, inter]
  QuantRows qx;  // a quantized product's input: [rows, widest k]
  float* wide;   // a dense product's input as fp32 where widens_x: [rows, widest k]
  float* partials;  // attention's split shares: [tasks, group, head_dim + 2]
  SharedScratch shared;  // attention over the prefixes groups of rows share (attention_shared.h)
};

// The slots a step's groups share, all together
inline int64_t shared_slots(const Step& st) {
  int64_t n = 0;
  for (int g = 0; g < st.groups; ++g) n += st.group_shared[g];
  return n;
}

Scratch carve(const Model& md, int64_t rows, int64_t groups, int64_t shared, void* base, int64_t* total) {
  const int64_t es = md.bf16 ? 2 : 4, qkv = int64_t(md.heads + 2 * md.kv_heads) * md.head_dim;
  const int64_t wide = std::max<int64_t>({md.hidden, md.inter, int64_t(md.heads) * md.head_dim});
  // a split happens only with fewer than 2 tasks per thread, so fewer than 2 x threads x kMaxSplit shares
  const int64_t shares = 2 * int64_t(omp_get_max_threads()) * kMaxSplit;
  const int64_t sizes[10] = {rows * md.hidden * es, rows * qkv * es, rows * md.heads * md.head_dim * es,
                             rows * 2 * md.inter * es, rows * md.inter * es, rows * wide,
                             rows * (wide / kBlock) * 4, rows * (wide / kBlock) * 8,
                             shares * (md.heads / md.kv_heads) * (md.head_dim + 2) * 4, rows * wide * 4};
  void* parts[10];
  const int64_t off = lay_out(sizes, 10, base, parts);
  int64_t tail = 0;
  const SharedScratch sh =
      carve_shared(md, rows, groups, shared, base ? static_cast<char*>(base) + off : nullptr, &tail);
  if (total) *total = off + tail;
  return {parts[0], parts[1], parts[2], parts[3], parts[4],
          {static_cast<int8_t*>(parts[5]), static_cast<float*>(parts[6]), static_cast<int32_t*>(parts[7])},
          static_cast<float*>(parts[9]), static_cast<float*>(parts[8]), sh};
}

template <class T>
void step(const Model& md, const Step& st) {
  const int rows = st.rows, H = md.hidden, I = md.inter;
  const int64_t qkv_w = int64_t(md.heads + 2 * md.kv_heads) * md.head_dim;
  const Scratch s = carve(md, rows, st.groups, shared_slots(st), st.scratch, nullptr);
  plan_groups(md, st, s.shared);
  T* h = static_cast<T*>(st.h);
  T* xn = static_cast<T*>(s.xn);
  T* qkv = static_cast<T*>(s.qkv);
  T* at = static_cast<T*>(s.attn);
  T* gu = static_cast<T*>(s.gu);
  T* act = static_cast<T*>(s.act);
  const bool amx = md.amx != 0;
  int max_len = 0;
  for (int m = 0; m < rows; ++m) max_len = std::max(max_len, row_len(st, m));
  const int split = attention_split(rows, md.kv_heads, max_len, omp_get_max_threads());
  const bool common = shared_path(md, st);  // groups of rows share prefixes: each scored for its rows at once
  auto into = [](T* y, int64_t width) {  // a product's outputs stored as they are
    return [=](int m, int n, V16 v, M16 mk) { store16(y + m * width + n, v, mk); };
  };
  auto onto_h = [=](int m, int n, V16 v, M16 mk) {  // h = round(h + y): the residual
    T* r = h + int64_t(m) * H + n;
    store16(r, rnd16<T>(load16(r, mk) + v), mk);
  };
  // y = x W^T through emit: x quantized or widened first where it must be (every thread takes part in both phases)
  auto linear = [&](const T* x, int n_rows, const Linear& lin, auto&& emit) {
    const Input<T> in{x, s.wide, s.qx};
    prepare(in, n_rows, lin, amx);
    product(in, n_rows, lin, amx, emit);
  };
#pragma omp parallel
  {
    for (int l = 0; l < md.layers; ++l) {
      const Layer& ly = md.layer[l];
      rms_norm(h, static_cast<const T*>(ly.ln1), rows, H, md.eps, xn);
      linear(xn, rows, ly.qkv, into(qkv, qkv_w));
#pragma omp barrier
      rope_and_store(md, ly, st, qkv);
      if (common)
        attention_shared(md, ly, st, qkv, at, s.shared);
      else
        attention(md, ly, st, qkv, at, split, s.partials);
      linear(at, rows, ly.o, onto_h);
#pragma omp barrier
      rms_norm(h, static_cast<const T*>(ly.ln2), rows, H, md.eps, xn);
      linear(xn, rows, ly.gate_up, into(gu, 2 * int64_t(I)));
#pragma omp barrier
      silu_mul(gu, rows, I, act);
      linear(act, rows, ly.down, onto_h);
#pragma omp barrier
    }
    // the rows that want logits: the final norm, then the output projection (rounded to T as eager, then fp32)
#pragma omp for schedule(static)
    for (int r = 0; r < st.logit_rows; ++r) std::memcpy(xn + int64_t(r) * H, h + st.logit_row[r] * H, sizeof(T) * H);
    rms_norm(xn, static_cast<const T*>(md.norm), st.logit_rows, H, md.eps, xn);
    linear(xn, st.logit_rows, md.lm_head, [&](int m, int n, V16 v, M16 mk) {
      store16(st.logits + int64_t(m) * md.vocab + n, v, mk);
    });
    release_tiles();
  }
}

// y = x W^T (+ b) alone, for tests: x T [rows, k], y T [rows, n] (as the step computes it inside a layer)
template <class T>
void linear_alone(const Linear& lin, const T* x, int rows, T* y, bool amx, void* scratch) {
  const int64_t blocks = lin.k / kBlock;
  char* p = static_cast<char*>(scratch);
  const int64_t k = lin.k;
  const Input<T> in{x, reinterpret_cast<float*>(p),
                    {reinterpret_cast<int8_t*>(p + rows * k * 4), reinterpret_cast<float*>(p + rows * k * 5),
                     reinterpret_cast<int32_t*>(p + rows * k * 5 + rows * blocks * 4)}};
#pragma omp parallel
  {
    prepare(in, rows, lin, amx);
    product(in, rows, lin, amx, [&](int m, int n, V16 v, M16 mk) {
      store16(y + int64_t(m) * lin.n + n, v, mk);
    });
    release_tiles();
  }
}

// One layer's attention alone, for tests: qkv T [rows, (heads + 2 kv_heads) head_dim] after RoPE (its k and v
// already in the pool), out T [rows, heads head_dim]; scratch as for a step of ``rows``
template <class T>
void attention_alone(const Model& md, const Layer& ly, const Step& st, const T* qkv, T* out) {
  const Scratch s = carve(md, st.rows, st.groups, shared_slots(st), st.scratch, nullptr);
  plan_groups(md, st, s.shared);
  int max_len = 0;
  for (int m = 0; m < st.rows; ++m) max_len = std::max(max_len, row_len(st, m));
  const int split = attention_split(st.rows, md.kv_heads, max_len, omp_get_max_threads());
  const bool common = shared_path(md, st);
#pragma omp parallel
  {
    if (common)
      attention_shared(md, ly, st, qkv, out, s.shared);
    else
      attention(md, ly, st, qkv, out, split, s.partials);
    release_tiles();
  }
}

// 0, or why a model cannot run here: 1 its heads, 2 a linear layer's format or shape
int32_t check(const Model& md) {
  if (md.heads % md.kv_heads || md.heads / md.kv_heads > kMaxGroup || md.head_dim > kMaxHeadDim) return 1;
  auto bad_one = [](const Linear& lin) {
    return lin.format == kDense ? lin.k % 2 != 0 : (lin.format < kQ8 || lin.format > kQ8H || lin.format == kParts) ||
           lin.k % (k_quant(lin.format) ? kSuper : kBlock) != 0;
  };
  auto bad = [&](const Linear& lin) {  // parts: each quantized, of the whole's k, their rows adding up to n
    if (lin.format != kParts) return bad_one(lin);
    const Linear* part = static_cast<const Linear*>(lin.w);
    int n = 0;
    for (int i = 0; i < lin.parts; ++i) {
      if (part[i].format == kDense || part[i].k != lin.k || bad_one(part[i])) return true;
      n += part[i].n;
    }
    return lin.parts < 1 || n != lin.n;
  };
  for (int l = 0; l < md.layers; ++l) {
    const Layer& ly = md.layer[l];
    if (bad(ly.qkv) || bad(ly.o) || bad(ly.gate_up) || bad(ly.down)) return 2;
  }
  return bad(md.lm_head) ? 2 : 0;
}

// What a step's scratch must hold, with this thread's OpenMP thread count (the split of attention's runs and the
// shared prefixes' partials are per thread)
int64_t scratch_bytes(const Model& md, int64_t rows, int64_t groups, int64_t shared) {
  int64_t total = 0;
  carve(md, rows, groups, shared, nullptr, &total);
  return total;
}
inline bool scratch_too_small(const Model& md, const Step& st) {
  return st.scratch_bytes < scratch_bytes(md, st.rows, st.groups, shared_slots(st));
}

}  // namespace rs

using namespace rs;

// Only the rs_ functions leave the library (-fvisibility=hidden): two builds loaded in one process
// (benchmarks/kernel_ab.py) each keep their own tiles -- a function's static (TileTable's table) is otherwise a
// process-wide unique symbol, and the second build would run the first one's tiles.
#pragma GCC visibility push(default)
extern "C" {

int64_t rs_scratch_bytes(const Model* md, int32_t rows, int32_t groups, int64_t shared) {
  return scratch_bytes(*md, rows, groups, shared);
}

int32_t rs_abi_version() { return 11; }

// The vector instructions this build uses: "avx512" or "avx2" (simd.h)
const char* rs_isa() { return kIsa; }

// Whether AMX tile products can be used in this process (asks the kernel for the tile state once).
int32_t rs_request_amx() { return request_amx() ? 1 : 0; }

int32_t rs_check(const Model* md) { return check(*md); }

// One layer's attention (tests); 0, or 3 as rs_decode_step
int32_t rs_attention(const Model* md, int32_t layer, const Step* st, const void* qkv, void* out) {
  if (scratch_too_small(*md, *st)) return 3;
  if (md->bf16) {
    attention_alone(*md, md->layer[layer], *st, static_cast<const uint16_t*>(qkv), static_cast<uint16_t*>(out));
  } else {
    attention_alone(*md, md->layer[layer], *st, static_cast<const float*>(qkv), static_cast<float*>(out));
  }
  return 0;
}

// `heads` heads of md.head_dim float values into 8-bit codes and scales, as the step stores K/V (tests)
void rs_store_codes(const Model* md, const float* x, int32_t heads, uint8_t* codes, float* scales) {
  for (int h = 0; h < heads; ++h)
    store_codes(*md, x + int64_t(h) * md->head_dim, md->head_dim, codes + int64_t(h) * md->head_dim, scales + h);
}

// One product (tests, and torch's steps over quantized layers): scratch of linear_scratch_bytes(rows, k)
void rs_linear(const Linear* lin, int32_t bf16, const void* x, int32_t rows, void* y, int32_t amx, void* scratch) {
  if (bf16) {
    linear_alone(*lin, static_cast<const uint16_t*>(x), rows, static_cast<uint16_t*>(y), amx != 0, scratch);
  } else {
    linear_alone(*lin, static_cast<const float*>(x), rows, static_cast<float*>(y), amx != 0, scratch);
  }
}

// One decode step; returns 0, check()'s code for a model this kernel does not take, or 3: the step's scratch is
// smaller than it needs with the calling thread's OpenMP thread count (sized for fewer threads than it runs with)
int32_t rs_decode_step(const Model* md, const Step* st) {
  if (const int32_t code = check(*md)) return code;
  if (scratch_too_small(*md, *st)) return 3;
  if (md->bf16) {
    step<bf16>(*md, *st);
  } else {
    step<float>(*md, *st);
  }
  return 0;
}

}
#pragma GCC visibility pop
