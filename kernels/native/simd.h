// Storage types (bf16 as uint16_t, fp32) and the AVX-512 pieces every kernel uses: masked loads and stores of 16
// values with torch's rounding, exp, rounding to the storage type where eager torch would round.
#pragma once

#include <immintrin.h>

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

// the first n lanes (none for n <= 0, all for n >= the width)
inline __mmask16 mask16(int n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }
inline __mmask32 mask32(int n) { return n >= 32 ? __mmask32(0xffffffffu) : n <= 0 ? 0 : __mmask32((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
template <class T> inline __m512 rnd16(__m512 v);
inline void store16(bf16* p, __m512 v, __mmask16 m) {  // rounded to nearest even, as torch (finite values)
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rnd16<bf16>(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
}
template <class T> inline __m512 rnd16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {  // v to bf16 and back, round to nearest even (NaN-free inputs: activations)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))));
  }
}

inline __m512 exp16(__m512 x) {  // e^x, ~1 ulp (Cephes' polynomial), scaled by 2^n
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace rs
