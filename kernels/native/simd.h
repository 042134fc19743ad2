// Storage types (bf16 as uint16_t, fp32) and the one vocabulary of vector operations every kernel is written in:
// V16, sixteen float lanes (masked by M16, one bit a lane), and BF32, thirty-two bf16 values taken as sixteen
// pairs (dot_bf16: lane i += a[2i] b[2i] + a[2i + 1] b[2i + 1]). Two machines implement it:
//
//   AVX-512 (F, BW, VL, BF16, VNNI)   V16 is one zmm register, BF32 one __m512bh, dot_bf16 one vdpbf16ps
//   AVX2 (+ FMA, F16C: x86-64-v3)     V16 is two ymm registers, BF32 four (the even and the odd values of each
//                                     half, widened to fp32 once, when loaded), dot_bf16 four FMAs
//
// The compiler's target picks one (-march: native, or RADIXSERVE_MARCH); the kernels above this file are the same
// code on both. Lane i is the same value on both, so a packed weight layout serves both.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace rs {

using bf16 = uint16_t;

// Lays n parts of the given byte sizes out one after another from base, each on a 64-byte line (nullptr parts
// when base is nullptr, to measure); returns the bytes they take.
inline int64_t lay_out(const int64_t* sizes, int n, void* base, void** parts) {
  char* p = static_cast<char*>(base);
  int64_t off = 0;
  for (int i = 0; i < n; ++i) {
    parts[i] = p ? p + off : nullptr;
    off += (sizes[i] + 63) / 64 * 64;
  }
  return off;
}

inline float bf2f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 f2bf(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return bf2f(v); }
template <class T> inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline bf16 from_f<bf16>(float v) { return f2bf(v); }
template <class T> inline float rnd(float v) { return to_f(from_f<T>(v)); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define RS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RS_AVX512 0
#else
#error "the native kernel needs AVX2, FMA and F16C (x86-64-v3) or AVX-512 with BF16 and VNNI"
#endif

// the first n lanes (none for n <= 0, all for n >= 16)
using M16 = uint16_t;
inline M16 mask16(int n) { return n >= 16 ? M16(0xffff) : n <= 0 ? 0 : M16((1u << n) - 1); }

#if RS_AVX512
constexpr const char* kIsa = "avx512";

using V16 = __m512;
using BF32 = __m512bh;

inline V16 zero16() { return _mm512_setzero_ps(); }
inline V16 set1(float x) { return _mm512_set1_ps(x); }
inline V16 fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
inline V16 fnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vmin(V16 a, V16 b) { return _mm512_min_ps(a, b); }
inline V16 vabs(V16 a) { return _mm512_abs_ps(a); }
inline V16 loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 select(M16 m, V16 v) { return _mm512_maskz_mov_ps(m, v); }           // v in m's lanes, else 0
inline V16 blend(V16 src, M16 m, V16 v) { return _mm512_mask_mov_ps(src, m, v); }  // v in m's lanes, else src
inline float reduce_add(V16 v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(V16 v) { return _mm512_reduce_max_ps(v); }

inline V16 load16(const float* p, M16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline V16 load16(const bf16* p, M16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, V16 v, M16 m) { _mm512_mask_storeu_ps(p, m, v); }
template <class T> inline V16 rnd16(V16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {  // v to bf16 and back, round to nearest even (NaN-free inputs: activations)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
}
inline void store16(bf16* p, V16 v, M16 m) {  // rounded to nearest even, as torch (finite values)
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rnd16<bf16>(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
}

inline V16 round_even(V16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V16 scale_pow2(V16 p, V16 n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral

inline BF32 load_bf32(const bf16* p) { return (BF32)_mm512_loadu_si512(p); }
inline BF32 load_bf32(const bf16* p, int n) {  // the first n values (up to 32), zeros after
  return (BF32)_mm512_maskz_loadu_epi16(n >= 32 ? __mmask32(0xffffffffu) : n <= 0 ? 0 : __mmask32((1u << n) - 1), p);
}
inline BF32 pair_bf32(int32_t pair) { return (BF32)_mm512_set1_epi32(pair); }  // one pair in every lane
inline V16 dot_bf16(V16 acc, BF32 a, BF32 b) { return _mm512_dpbf16_ps(acc, a, b); }
inline V16 evens(BF32 b) { return _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)b, 16)); }  // values 2i, widened
inline V16 odds(BF32 b) {  // values 2i + 1
  return _mm512_castsi512_ps(_mm512_and_si512((__m512i)b, _mm512_set1_epi32(int(0xffff0000u))));
}

// Integer lanes for the quantized products: I16 is sixteen int32 lanes, each the dot product of 4 weight bytes
// of one output with 4 int8 activations.
using I16 = __m512i;
// dpbusd multiplies unsigned bytes by signed ones: q8 weights are stored as q + 128, corrected after the block
constexpr float kQ8Offset = 128.0f;
inline I16 izero16() { return _mm512_setzero_si512(); }
inline I16 load_i16(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline I16 dot_q8(I16 acc, I16 w, int32_t quad) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(quad)); }
inline I16 dot_u4(I16 acc, I16 w, int32_t quad) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(quad)); }
// A block of nibbles (32 k: 4 groups, lo and hi): VNNI sums its products in the int32 lanes at once
inline I16 block_sums(I16 acc, I16 w, int32_t quad) { return dot_u4(acc, w, quad); }
inline I16 block_total(I16 sums) { return sums; }
inline void split_nibbles(I16 v, I16* lo, I16* hi) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  *lo = _mm512_and_si512(v, low);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}
inline V16 to_float(I16 v) { return _mm512_cvtepi32_ps(v); }
// Q6_K's top two bits, two groups of 8 k to a vector (quant_tiles.h): bits 4s .. 4s + 1 of each byte become bits 4-5
// of lo's byte, bits 4s + 2 .. 4s + 3 those of hi's (16-bit shifts: the mask drops what crosses a byte)
template <int S>
inline void add_top_bits(I16 bits, I16* lo, I16* hi) {
  const __m512i m = _mm512_set1_epi8(0x30);
  const __m512i l = S == 0 ? _mm512_slli_epi16(bits, 4) : bits;
  const __m512i h = S == 0 ? _mm512_slli_epi16(bits, 2) : _mm512_srli_epi16(bits, 2);
  *lo = _mm512_or_si512(*lo, _mm512_and_si512(l, m));
  *hi = _mm512_or_si512(*hi, _mm512_and_si512(h, m));
}
// q5 / q5k's fifth bits, four groups of 8 k to a vector (quant_tiles.h): bit 2G of each byte becomes bit 4 of lo's
// byte, bit 2G + 1 that of hi's (16-bit shifts: the mask drops what crosses a byte)
template <int S>
inline __m512i shift16(__m512i v) {
  if constexpr (S >= 0) return _mm512_slli_epi16(v, S);
  else return _mm512_srli_epi16(v, -S);
}
template <int G>
inline void add_fifth_bit(I16 bits, I16* lo, I16* hi) {
  const __m512i m = _mm512_set1_epi8(0x10);
  *lo = _mm512_or_si512(*lo, _mm512_and_si512(shift16<4 - 2 * G>(bits), m));
  *hi = _mm512_or_si512(*hi, _mm512_and_si512(shift16<3 - 2 * G>(bits), m));
}
inline V16 bytes_float(const uint8_t* p) {  // 16 bytes as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V16 bytes_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V16 load_halves(const uint16_t* p) {  // 16 fp16 values as fp32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// K-quant super-blocks (quant_tiles.h, tile_ksuper): VNNI sums a block's groups (Q6_K: a half's) in the int32
// lanes (group_sums), its integer scale multiplies them once (add_scaled), so a super-block sums in integers and
// the float step runs once per 256 k, not once per 32 (Q6_K: 16) as in tile_quant
inline I16 scale_lanes(const uint8_t* p) {  // 16 scales 0..255, one a lane
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline I16 scale_lanes(const int8_t* p) {  // -128..127
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline I16 group_sums(I16 acc, I16 w, int32_t quad) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(quad)); }
inline I16 add_scaled(I16 acc, I16 sums, I16 sc) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(sums, sc)); }
template <class B>  // uint8_t or int8_t
inline I16 byte_pairs(const B* a, const B* b) {  // lane i: (a[i], b[i]) as int16
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m256i ab = _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb));
  if constexpr (std::is_signed_v<B>) return _mm512_cvtepi8_epi16(ab);
  else return _mm512_cvtepu8_epi16(ab);
}
inline I16 dot_pairs(I16 acc, I16 pairs, int32_t x) {  // lane += a x0 + b x1 (x: two int16)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi32(x)));
}
// 16 8-bit KV codes (model/kv_codes.py) as floats, masked-off lanes 0, with no table: an int8 code is its value;
// an fp8 e5m2 code is an fp16's upper byte; an fp8 e4m3 code laid into an fp16 (sign to the top, exponent and
// mantissa one bit lower) reads 2^-8 of its value, subnormals included (the caller's scale carries the 2^8)
inline __m128i load_code_bytes(const uint8_t* p, M16 m) { return _mm_maskz_loadu_epi8(m, p); }
inline V16 int8_codes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
inline V16 half_codes(__m256i h) { return _mm512_cvtph_ps(h); }
// 32 values times inv to int8 (nearest, ties to even; saturated) into out; the sums of each 16 into sums[0..1]
inline void quantize32(V16 lo, V16 hi, float inv, int8_t* out, int32_t* sums) {
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qhi));
  sums[0] = _mm512_reduce_add_epi32(qlo);
  sums[1] = _mm512_reduce_add_epi32(qhi);
}

#else
constexpr const char* kIsa = "avx2";

struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }

inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 fnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 vabs(V16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline V16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

// m's bits as two vectors of all-ones / all-zeros lanes
inline void lane_masks(M16 m, __m256i* lo, __m256i* hi) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  *lo = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(m & 0xff), bit), bit);
  *hi = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(m >> 8), bit), bit);
}
inline V16 select(M16 m, V16 v) {
  __m256i lo, hi;
  lane_masks(m, &lo, &hi);
  return {_mm256_and_ps(_mm256_castsi256_ps(lo), v.lo), _mm256_and_ps(_mm256_castsi256_ps(hi), v.hi)};
}
inline V16 blend(V16 src, M16 m, V16 v) {
  __m256i lo, hi;
  lane_masks(m, &lo, &hi);
  return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(lo)), _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(hi))};
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(V16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
inline float reduce_max(V16 v) {
  const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline V16 load16(const float* p, M16 m) {  // masked-off lanes are never read (vmaskmovps does not fault)
  if (m == 0xffff) return loadu(p);
  __m256i lo, hi;
  lane_masks(m, &lo, &hi);
  return {_mm256_maskload_ps(p, lo), _mm256_maskload_ps(p + 8, hi)};
}
inline __m256 widen_bf16(__m128i h) {  // 8 bf16 -> 8 fp32: bf16 is fp32's upper half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 load16(const bf16* p, M16 m) {
  if (m == 0xffff) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {widen_bf16(_mm256_castsi256_si128(h)), widen_bf16(_mm256_extracti128_si256(h, 1))};
  }
  alignas(32) bf16 tmp[16] = {};  // a tail: only the lanes asked for are read
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) tmp[i] = p[i];
  return load16(tmp, M16(0xffff));
}
inline void store16(float* p, V16 v, M16 m) {
  if (m == 0xffff) return storeu(p, v);
  __m256i lo, hi;
  lane_masks(m, &lo, &hi);
  _mm256_maskstore_ps(p, lo, v.lo);
  _mm256_maskstore_ps(p + 8, hi, v.hi);
}
inline __m256 rnd8_bf16(__m256 v) {  // to bf16 and back, round to nearest even (NaN-free inputs: activations)
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))));
}
template <class T> inline V16 rnd16(V16 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return {rnd8_bf16(v.lo), rnd8_bf16(v.hi)};
}
inline void store16(bf16* p, V16 v, M16 m) {  // rounded to nearest even, as torch (finite values)
  const V16 r = rnd16<bf16>(v);
  // the upper halves, packed to 16 bits (packus works within 128-bit lanes: the permute puts them in order)
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(r.lo), 16),
                          _mm256_srli_epi32(_mm256_castps_si256(r.hi), 16)), 0xD8);
  if (m == 0xffff) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  alignas(32) bf16 tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) p[i] = tmp[i];
}

inline V16 round_even(V16 x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127]: the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 scale_pow2(V16 p, V16 n) {  // p 2^n for integral n in [-128, 128]: two steps of at most 2^64 each
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 a_lo = _mm256_round_ps(_mm256_mul_ps(n.lo, half), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 a_hi = _mm256_round_ps(_mm256_mul_ps(n.hi, half), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  return {_mm256_mul_ps(_mm256_mul_ps(p.lo, pow2(a_lo)), pow2(_mm256_sub_ps(n.lo, a_lo))),
          _mm256_mul_ps(_mm256_mul_ps(p.hi, pow2(a_hi)), pow2(_mm256_sub_ps(n.hi, a_hi)))};
}

struct BF32 {  // 32 bf16 as fp32: ev/od = values 2i / 2i + 1 of lanes 0-7 (lo) and 8-15 (hi)
  __m256 ev_lo, od_lo, ev_hi, od_hi;
};
inline BF32 split_bf32(__m256i lo, __m256i hi) {  // 16 bf16 pairs, each in a 32-bit lane
  const __m256i top = _mm256_set1_epi32(int(0xffff0000u));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_and_si256(lo, top)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), _mm256_castsi256_ps(_mm256_and_si256(hi, top))};
}
inline BF32 load_bf32(const bf16* p) {
  return split_bf32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
}
inline BF32 load_bf32(const bf16* p, int n) {  // the first n values (up to 32), zeros after
  if (n >= 32) return load_bf32(p);
  alignas(32) bf16 tmp[32] = {};
  for (int i = 0; i < std::max(n, 0); ++i) tmp[i] = p[i];
  return load_bf32(tmp);
}
inline BF32 pair_bf32(int32_t pair) {  // one pair in every lane
  const __m256 ev = _mm256_set1_ps(bf2f(bf16(pair & 0xffff))), od = _mm256_set1_ps(bf2f(bf16(uint32_t(pair) >> 16)));
  return {ev, od, ev, od};
}
inline V16 evens(const BF32& b) { return {b.ev_lo, b.ev_hi}; }  // values 2i of the 16 pairs
inline V16 odds(const BF32& b) { return {b.od_lo, b.od_hi}; }    // values 2i + 1
inline V16 dot_bf16(V16 acc, BF32 a, BF32 b) {  // products of bf16 are exact in fp32: the odd one first, as vdpbf16ps
  return {_mm256_fmadd_ps(a.ev_lo, b.ev_lo, _mm256_fmadd_ps(a.od_lo, b.od_lo, acc.lo)),
          _mm256_fmadd_ps(a.ev_hi, b.ev_hi, _mm256_fmadd_ps(a.od_hi, b.od_hi, acc.hi))};
}

struct I16 {
  __m256i lo, hi;
};
// maddubs would saturate on q + 128 (up to 255 x 127, twice): q8 multiplies |q| by x with q's sign instead, so
// the dot is of q itself (|q| <= 128, |x| <= 127: pairs stay below 2^15) and needs no correction
constexpr float kQ8Offset = 0.0f;
inline I16 izero16() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 load_i16(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m256i sum_quads(__m256i acc, __m256i u8, __m256i s8) {  // lane += 4 products u8 x s8 (pairs < 2^15)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
inline I16 dot_q8(I16 acc, I16 w, int32_t quad) {
  const __m256i x = _mm256_set1_epi32(quad), flip = _mm256_set1_epi8(char(0x80));
  const __m256i qlo = _mm256_xor_si256(w.lo, flip), qhi = _mm256_xor_si256(w.hi, flip);  // q + 128 -> q
  return {sum_quads(acc.lo, _mm256_abs_epi8(qlo), _mm256_sign_epi8(x, qlo)),
          sum_quads(acc.hi, _mm256_abs_epi8(qhi), _mm256_sign_epi8(x, qhi))};
}
inline I16 dot_u4(I16 acc, I16 w, int32_t quad) {  // nibbles: at most 15 x 127, twice
  const __m256i x = _mm256_set1_epi32(quad);
  return {sum_quads(acc.lo, w.lo, x), sum_quads(acc.hi, w.hi, x)};
}
inline void split_nibbles(I16 v, I16* lo, I16* hi) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  *lo = {_mm256_and_si256(v.lo, low), _mm256_and_si256(v.hi, low)};
  *hi = {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), low), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), low)};
}
inline V16 to_float(I16 v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
// K-quant super-blocks (quant_tiles.h, tile_ksuper): a block's scale folded into the pair sums -- madd by (s, s) in
// each 32-bit lane instead of (1, 1) -- so a super-block sums in integers
// (the 16 scales in both 128-bit halves, each half shuffling out its 4 rows': 3 instructions for 8 rows, where
// widening and doubling them took 8; Q4_K to Q6_K one-row products 1.05-1.09x faster where their weights are in
// the caches, benchmarks/kernel_ab.py with OMP_NUM_THREADS=1, --n 1024 --k 2048)
template <bool Signed>
inline I16 scale_pairs_of(const void* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  auto pick = [&](int r) {  // rows r .. r + 7
    alignas(32) char m[32];
    for (int i = 0; i < 8; ++i) {  // 32-bit lane i: s as both int16 halves, in the low byte (u8) or high (s8)
      const char s = char(r + i), z = char(0x80);  // z: a zero byte
      const char low = Signed ? z : s, high = Signed ? s : z, lane[4] = {low, high, low, high};
      std::memcpy(m + 4 * i, lane, 4);
    }
    const __m256i v = _mm256_shuffle_epi8(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(m)));
    return Signed ? _mm256_srai_epi16(v, 8) : v;  // s8: s << 8 shifted down with its sign
  };
  return {pick(0), pick(8)};
}
// 16 scales, one a lane (as the pair (s, s) its madd takes)
inline I16 scale_lanes(const uint8_t* p) { return scale_pairs_of<false>(p); }  // 0..255
inline I16 scale_lanes(const int8_t* p) { return scale_pairs_of<true>(p); }    // -128..127
// K-quant blocks: the maddubs pair sums of a run of groups added up as int16 (while their sum stays below 2^15:
// quant_tiles.h's tile_ksuper), then their scale multiplied in once (add_scaled) instead of once per group
inline I16 group_sums(I16 acc, I16 w, int32_t quad) {  // each int16 lane += its pair of u8 x s8 products
  const __m256i x = _mm256_set1_epi32(quad);
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, x)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, x))};
}
inline I16 add_scaled(I16 acc, I16 pairs, I16 sc) {  // lane += s x (its two int16 pair sums)
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, sc.lo)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, sc.hi))};
}
// A block of nibbles (32 k: 4 groups, lo and hi; Q4_0 / Q4_1, Q4_K): its products' pair sums added as int16 (8
// of them to a lane, at most 8 x 2 x 15 x 127 = 30480 < 2^15), widened to int32 once (block_total), not per group
inline I16 block_sums(I16 acc, I16 w, int32_t quad) { return group_sums(acc, w, quad); }
inline I16 block_total(I16 sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(sums.lo, ones), _mm256_madd_epi16(sums.hi, ones)};
}
template <class B>  // uint8_t or int8_t
inline I16 byte_pairs(const B* a, const B* b) {  // lane i: (a[i], b[i]) as int16
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo = _mm_unpacklo_epi8(va, vb), hi = _mm_unpackhi_epi8(va, vb);
  if constexpr (std::is_signed_v<B>) return {_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)};
  else return {_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)};
}
inline I16 dot_pairs(I16 acc, I16 pairs, int32_t x) {  // lane += a x0 + b x1 (x: two int16)
  const __m256i v = _mm256_set1_epi32(x);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, v)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, v))};
}
template <int S>
inline void add_top_bits(I16 bits, I16* lo, I16* hi) {
  const __m256i m = _mm256_set1_epi8(0x30);
  auto part = [&](__m256i v, __m256i* l, __m256i* h) {
    const __m256i a = S == 0 ? _mm256_slli_epi16(v, 4) : v;
    const __m256i b = S == 0 ? _mm256_slli_epi16(v, 2) : _mm256_srli_epi16(v, 2);
    *l = _mm256_or_si256(*l, _mm256_and_si256(a, m));
    *h = _mm256_or_si256(*h, _mm256_and_si256(b, m));
  };
  part(bits.lo, &lo->lo, &hi->lo);
  part(bits.hi, &lo->hi, &hi->hi);
}
template <int S>
inline __m256i shift16(__m256i v) {
  if constexpr (S >= 0) return _mm256_slli_epi16(v, S);
  else return _mm256_srli_epi16(v, -S);
}
template <int G>
inline void add_fifth_bit(I16 bits, I16* lo, I16* hi) {
  const __m256i m = _mm256_set1_epi8(0x10);
  auto part = [&](__m256i v, __m256i* l, __m256i* h) {
    *l = _mm256_or_si256(*l, _mm256_and_si256(shift16<4 - 2 * G>(v), m));
    *h = _mm256_or_si256(*h, _mm256_and_si256(shift16<3 - 2 * G>(v), m));
  };
  part(bits.lo, &lo->lo, &hi->lo);
  part(bits.hi, &lo->hi, &hi->hi);
}
inline V16 bytes_float(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 bytes_float(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 load_halves(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m128i load_code_bytes(const uint8_t* p, M16 m) {
  if (m == 0xffff) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint8_t bytes[16] = {};  // masked-off lanes read code 0, which stands for 0 in every format
  for (int i = 0; i < 16; ++i) if (m >> i & 1) bytes[i] = p[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(bytes));
}
inline V16 int8_codes(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 half_codes(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline int32_t sum8x2(__m256i a, __m256i b) {  // the 16 int32 lanes of a and b added up
  const __m256i sum = _mm256_add_epi32(a, b);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
inline void quantize32(V16 lo, V16 hi, float inv, int8_t* out, int32_t* sums) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(lo.lo, s)), b = _mm256_cvtps_epi32(_mm256_mul_ps(lo.hi, s));
  const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(hi.lo, s)), d = _mm256_cvtps_epi32(_mm256_mul_ps(hi.hi, s));
  // the packs work within 128-bit lanes: 4-byte groups come out as a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 ..
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  sums[0] = sum8x2(a, b);
  sums[1] = sum8x2(c, d);
}
#endif

inline V16 exp16(V16 x) {  // e^x, ~1 ulp (Cephes' polynomial), scaled by 2^n
  x = vmax(vmin(x, set1(88.3762626647949f)), set1(-88.3762626647949f));
  const V16 n = round_even(x * set1(1.44269504088896341f));
  V16 r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  V16 p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p * r, r, r + set1(1.0f));
  return scale_pow2(p, n);
}

}  // namespace rs
