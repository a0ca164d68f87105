// Math shared by the kernel files (cpu_ops.cpp, packed_linear.cpp, prefill_attention.cpp): bfloat16 <-> float32
// conversions as torch rounds them, and (AVX-512 builds) exp and that rounding 16 lanes at a time, so fused
// kernels give the same bits as the eager ops they replace; their 8-lane forms for AVX2 builds (exp8, exp2_8,
// round8, row_max8, sum8); PacedFetch for both.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem_simd {

using bf16_t = uint16_t;

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline bf16_t from_float<bf16_t>(float v) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

// Rounds a float32 value to T's precision and back (identity for float).
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

constexpr float LOG2E = 1.44269504088896341f;

// 2^f on [-1/2, 1/2] as 1 + f q(f), q's coefficients (lowest power first) fitted for relative error: 6 terms
// within 2 ulp, 4 within 2.9e-6 (exp2_16, exp2_8).
constexpr float EXP2_TERMS4[] = {0.69312417507f, 0.24024097621f, 0.05590642616f, 0.00958286971f};
constexpr float EXP2_TERMS6[] = {0.69314718246f, 0.24022647738f, 0.05550332367f,
                                 0.00961843692f, 0.00133988750f, 0.00015353379f};

}  // namespace tandem_simd

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tandem_simd {

// exp of 16 floats: n = round(x log2 e), r = x - n ln 2 (two-part constant), a degree-6 Taylor polynomial of
// e^r on |r| <= ln2 / 2, scaled by 2^n. Within 2 ulp of expf; glibc's vector expf is only used under
// -ffast-math, which would also reorder the reductions, so the scalar loop called expf one value at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// 2^y of 16 floats, for softmaxes whose exponents come scaled by log2 e (one fused multiply-subtract of the
// score): n = round(y), f = y - n (exact) in [-1/2, 1/2], 2^f as 1 + f q(f) with q's Terms coefficients fitted
// for relative error, scaled by 2^n. Against exp16 it saves the two-part ln 2 reduction and the caller's separate
// scale and subtract. 6 terms: within 2 ulp of 2^f; 4: within 2.9e-6 relative, far below the rounding of
// probabilities stored in bfloat16 (2^-9). Below -150 (and -inf) it is 0.
template <int Terms>
inline __m512 exp2_16(__m512 y) {
  static_assert(Terms == 4 || Terms == 6, "exp2_16: 4 or 6 terms");
  const float* c = Terms == 4 ? EXP2_TERMS4 : EXP2_TERMS6;
  y = _mm512_max_ps(y, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 q = _mm512_set1_ps(c[Terms - 1]);
  for (int k = Terms - 2; k >= 0; --k) q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(c[k]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(q, f, _mm512_set1_ps(1.f)), n);
}

inline __m512 round16(__m512 v, float) { return v; }
// Rounds to bfloat16 (nearest even) and back, as from_float then to_float: NaN becomes from_float's quiet NaN.
inline __m512 round16(__m512 v, bf16_t) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, rounded, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

// One element step (S columns of x, S = 1 float32 or a bfloat16 pair) of the register-blocked micro-kernels
// (packed_linear.cpp, prefill_attention.cpp): one broadcast of x against one vector of 16 packed columns.
template <typename T>
struct Step;

template <>
struct Step<float> {
  static constexpr int S = 1;
  static __m512 bcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 acc, const float* w, __m512 xv) { return _mm512_fmadd_ps(_mm512_loadu_ps(w), xv, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Step<bf16_t> {
  static constexpr int S = 2;
  static __m512 bcast(const bf16_t* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 acc, const bf16_t* w, __m512 xv) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_castps_si512(xv));
  }
};
#endif

// Without AVX512_BF16 (Ice Lake, Cascade Lake): the same panels, each 32-bit lane of a pair widened in registers,
// the odd element by a mask and the even by a shift, then two float32 FMAs in vdpbf16ps's order (odd, then
// even; each product exact). Half the weight bytes of float32 at 75-97% of its multiply rate: over the default
// model's matrices on a 2-core Ice Lake Xeon, 188 / 188 / 208 / 190 GFLOP/s at 16 / 64 / 256 / 1,024 rows
// (packed float32 163 / 194 / 238 / 201; an hour later, the host faster, 220-257 against 302-329 at 16-256),
// where bfloat16 ran on the streaming kernel at 117 / 126 / 114 / 76 and oneDNN's bfloat16 GEMM, without the
// instructions, at 45-63. Step<bf16_t> there (prefill attention's products); packed_linear runs the same
// products in a loop order of its own (widened_step), on every AVX-512 CPU on demand.
struct WidenedStep {
  static constexpr int S = 2;
  struct Pair {
    __m512 even, odd;
  };
  static Pair bcast(const bf16_t* x) { return {_mm512_set1_ps(to_float(x[0])), _mm512_set1_ps(to_float(x[1]))}; }
  // 16 pairs (32 bfloat16 values) as the float32 vectors of their even and of their odd elements.
  static Pair widen(const bf16_t* w) {
    const __m512i wv = _mm512_loadu_si512(w);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static __m512 fma(__m512 acc, const bf16_t* w, Pair xv) {
    const Pair wv = widen(w);
    return _mm512_fmadd_ps(wv.even, xv.even, _mm512_fmadd_ps(wv.odd, xv.odd, acc));
  }
};
#if !defined(__AVX512BF16__)
template <>
struct Step<bf16_t> : WidenedStep {};
#endif

// The lanes of a vector of 16 columns that hold one of the `left` columns still to write.
inline __mmask16 columns(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << left) - 1);
}

inline void store16(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
// 16 floats as bfloat16, nearest even: vcvtneps2bf16 where the CPU has it (denormals flush to zero), else
// round16's bits (from_float's rounding, torch's exactly) packed down.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16(v, bf16_t{})), 16));
#endif
}
inline void store16(bf16_t* y, __m512 v, __mmask16 mask) { _mm256_mask_storeu_epi16(y, mask, to_bf16(v)); }
// The lanes of `mask` as bfloat16 with from_float's rounding (round16): torch's bits for every value, denormals
// included, where store16 rounds by vcvtneps2bf16 where the CPU has it.
inline void store16_rounded(bf16_t* y, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(v, bf16_t{})), 16);
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(bits));
}

// 16 values as float32 (bfloat16 ones exactly, by a shift).
inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// max(s[0, n)), n > 0, 16 lanes at a time with two accumulators (the softmaxes of both attention kernels; a
// scalar max_element waits on each compare, and was 60% of a prefill's attention on the AMX tiles).
inline float row_max(const float* s, int64_t n) {
  __m512 a = _mm512_set1_ps(-INFINITY), b = a;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(s + j));
    b = _mm512_max_ps(b, _mm512_loadu_ps(s + j + 16));
  }
  for (; j < n; j += 16) a = _mm512_max_ps(a, _mm512_mask_loadu_ps(b, columns(n - j), s + j));
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

}  // namespace tandem_simd
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace tandem_simd {

// 8 bfloat16 pairs (16 values) as the float32 vectors of their even and of their odd elements, both exact:
// WidenedStep::widen on 8 lanes (the even element by a shift, the odd by a mask), for the AVX2 kernels.
struct Pairs8 {
  __m256 even, odd;
};
inline __m256 pairs_even8(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 pairs_odd8(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline Pairs8 widen_pairs8(const bf16_t* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {pairs_even8(w), pairs_odd8(w)};
}

// exp16's reduction and polynomial on 8 lanes, x already clamped: e^r for x = n ln 2 + r, with n (as integers) in `n`.
inline __m256 exp8_terms(__m256 x, __m256i& n) {
  constexpr float log2e = 1.44269504088896341f;
  const __m256 nf = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  n = _mm256_cvtps_epi32(nf);
  return p;
}

// 2^n of 8 integers n in [-126, 127], built in the exponent field.
inline __m256 pow2_8(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// exp of 8 floats x <= 0 (a softmax's exponents), for AVX2 CPUs: exp16's steps, 2^n built in the exponent field
// where exp16 scales with vscalefps. For n in [-126, 0] both scale by one correctly rounded multiply, so the two
// give the same bits.
inline __m256 exp8(__m256 x) {
  __m256i n;
  const __m256 p = exp8_terms(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), n);
  return _mm256_mul_ps(p, pow2_8(n));
}

// max(s[0, n)), n > 0, 8 lanes at a time with two accumulators (row_max's AVX2 form).
inline float row_max8(const float* s, int64_t n) {
  __m256 a = _mm256_set1_ps(-INFINITY), b = a;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    a = _mm256_max_ps(a, _mm256_loadu_ps(s + j));
    b = _mm256_max_ps(b, _mm256_loadu_ps(s + j + 8));
  }
  a = _mm256_max_ps(a, b);
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  float lanes[4];
  _mm_storeu_ps(lanes, h);
  float mx = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// 2^y of 8 floats y <= 0 (a softmax's exponents scaled by log2 e): exp2_16 on 8 lanes, 2^n built in the exponent
// field. Below -126.5 it is 0 where exp2_16 goes on through the denormals to -150: what is dropped is below 2^-126
// of the row's largest term (which is 1).
template <int Terms>
inline __m256 exp2_8(__m256 y) {
  static_assert(Terms == 4 || Terms == 6, "exp2_8: 4 or 6 terms");
  const float* c = Terms == 4 ? EXP2_TERMS4 : EXP2_TERMS6;
  y = _mm256_max_ps(y, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 q = _mm256_set1_ps(c[Terms - 1]);
  for (int k = Terms - 2; k >= 0; --k) q = _mm256_fmadd_ps(q, f, _mm256_set1_ps(c[k]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(_mm256_fmadd_ps(q, f, _mm256_set1_ps(1.f)), _mm256_castsi256_ps(two_n));
}

inline __m256 round8(__m256 v, float) { return v; }
// round16 on 8 lanes: to bfloat16 (nearest even) and back, NaN to from_float's quiet NaN.
inline __m256 round8(__m256 v, bf16_t) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

// The sum of 8 lanes: ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)).
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(pairs, pairs));
}

// The lanes below k (all of them from 8) as a mask of 32-bit lanes.
inline __m256i lanes_below(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(k, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp of 8 floats of either sign (SiLU's exponents): exp8 with exp16's upper clamp too, and 2^n (n in [-126, 128])
// applied as 2^(n - n/2) then 2^(n/2). Every result is a normal float, so each multiply by a power of two is exact
// and the result is exp16's bits, as vscalefps gives them.
inline __m256 exp8_any(__m256 x) {
  __m256i n;
  const __m256 p = exp8_terms(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f)), n);
  const __m256i half = _mm256_srai_epi32(n, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(_mm256_sub_epi32(n, half))), pow2_8(half));
}

// silu(g) * u of 8 gates and ups already rounded to T, as silu_mul16 computes them on AVX-512: the SiLU rounded to
// T before the product. Both silu_mul and packed_linear_silu's AVX2 epilogue call it, so the two give the same bits.
template <typename T>
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8_any(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), T{}), u);
}

// 8 values as float32 (bfloat16 ones exactly, by a shift).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The first n (all from 8) of 8 floats as float32, or as bfloat16 with from_float's rounding (round8).
inline void store8(float* y, __m256 v, int64_t n = 8) {
  if (n >= 8)
    _mm256_storeu_ps(y, v);
  else
    _mm256_maskstore_ps(y, lanes_below(n), v);
}
inline void store8(bf16_t* y, __m256 v, int64_t n = 8) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round8(v, bf16_t{})), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
  } else {
    alignas(16) bf16_t lanes[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
    std::copy(lanes, lanes + n, y);
  }
}

}  // namespace tandem_simd
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>

namespace tandem_simd {

// A fetch of what a kernel reads next, spread evenly over its loop: `rate` / 256 cache lines per step (step(n):
// n steps' worth at once), the fraction carried over (null `next`: nothing). A whole number of lines per step,
// rounded up, sent the lines in bursts and finished early (packed_linear's dot-product kernel: 8.1 -> 7.0 ms per
// pass at 16 rows on Zen 5).
template <auto Hint>
struct PacedFetch {
  const char* next;
  int rate;
  int owed = 0;  // 1/256ths of a line

  inline void step(int ticks = 1) {
    if (!next) return;
    for (owed += rate * ticks; owed >= 256; owed -= 256, next += 64) _mm_prefetch(next, Hint);
  }
};

}  // namespace tandem_simd
#endif
