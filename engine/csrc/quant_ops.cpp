// Weight-only quantized linear layers: y = x W^T with W stored as unsigned integers in blocks of 32
// along K, each block with a scale and either an offset (w = scale * u + offset) or a zero point
// (w = scale * (u - zero)). That one form holds GGUF's Q4_0 (zero 8), Q4_1 (offset m) and Q8_0
// (u = q + 128, zero 128) with their float16 scales as the file has them (a matmul reads no more bytes
// than the file holds), and int8 per-channel weights (one float32 scale per row, zero 128).
//
// Decode reads every weight once per step, so fewer bytes per weight is speed; the dot products
// run on integers: x is quantized per 32-block to int8 (scale d, as llama.cpp's Q8 activations),
// and AVX-512 VNNI multiplies 64 weight bytes by 64 activation bytes per instruction (AVX2 CPUs: the same sums
// from 16-bit products, qgroup_rows).
//
// Layout (what engine/quant/packing.py writes): rows in groups of 16, one per 32-bit lane. For each
// group and block, step s (0..7) is 64 bytes: bytes 4s..4s+3 of the block of each of the 16 rows, so
// one dpbusd against x's 4 bytes of that step (broadcast) adds to all 16 rows' sums, and after eight
// steps the lanes hold the 16 rows' integer block sums: no horizontal reduction, no padding in K.
// 4-bit values put step 2t in the low nibble and step 2t+1 in the high nibble of one byte. Scales
// (and offsets) are float16 [groups, blocks, 16] in the same order.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "amx_tiles.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // weights per quantization block
constexpr int64_t GROUP = 16;  // weight rows per group: one per 32-bit lane

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

struct QWeight {
  const uint8_t* data;     // [groups, nb, 16 * 32 * bits / 8]
  const uint16_t* scale;   // float16 [groups, nb, 16] (per block), or null
  const uint16_t* offset;  // float16 [groups, nb, 16], or null: w = scale * (u - zero)
  const float* row_scale;  // float32 [Npad] (per row), or null
  float zero;
  int64_t nb;
  int bits;

  int64_t block_bytes() const { return GROUP * BLOCK * bits / 8; }
};

struct QX {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, nb] block scales
  const float* s;   // [M, nb] d * sum(q) of each block
  int64_t K;
  int64_t nb;
  const int16_t* q16 = nullptr;  // q widened to int16, once per call (the AVX2 kernel's operand)
};

#if defined(__AVX512F__)

// quantize_x's loop for one block on two vectors: the same max, the same product per value and the same rounding
// (nearest even), so the same bits. With store_rows' vectors, Q4_1 over the default model's 120 layer matrices,
// bfloat16 x, 2-core Zen 5, the two builds alternated in one process: 16 rows 8.38 -> 6.29 ms, 64 rows 23.6 -> 15.4,
// 1 row 3.34 -> 3.14; the quantized prefill of 1,024 tokens 402 -> 291 ms (step profile).
template <typename T>
inline void quantize_block(const T* src, int8_t* q, float* d, float* s) {
  const __m512 v[2] = {tandem_simd::load16(src), tandem_simd::load16(src + 16)};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  const float di = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(di != 0.f ? 1.f / di : 0.f);
  __m512i sum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i iv = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(iv));
    sum = _mm512_add_epi32(sum, iv);
  }
  *d = di;
  *s = di * static_cast<float>(_mm512_reduce_add_epi32(sum));
}
#elif defined(__AVX2__) && defined(__FMA__)
// quantize_block on 8 lanes: _mm256_cvtps_epi32 rounds in the current mode, as std::nearbyint does. With
// store_rows' vectors, the x86-64-v3 build on the same Zen 5 (its integer kernel dominates here): Q4_1, 16 rows
// 21.8 -> 20.4 ms, 64 rows 79.0 -> 72.7.
template <typename T>
inline void quantize_block(const T* src, int8_t* q, float* d, float* s) {
  __m256 v[4];
  __m256 top = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int h = 0; h < 4; ++h) {
    v[h] = tandem_simd::load8(src + 8 * h);
    top = _mm256_max_ps(top, _mm256_and_ps(v[h], magnitude));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  const float amax = *std::max_element(lanes, lanes + 8);
  const float di = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(di != 0.f ? 1.f / di : 0.f);
  __m256i iv[4];
  __m256i sum = _mm256_setzero_si256();
  for (int h = 0; h < 4; ++h) {
    iv[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], inv));
    sum = _mm256_add_epi32(sum, iv[h]);
  }
  // Two packs leave 4-byte groups in the order v0[0-3] v1[0-3] v2[0-3] v3[0-3] v0[4-7] ...: put back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  int32_t parts[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sum);
  int32_t total = 0;
  for (int32_t p : parts) total += p;
  *d = di;
  *s = di * static_cast<float>(total);
}
#else
template <typename T>
inline void quantize_block(const T* src, int8_t* q, float* d, float* s) {
  float vals[BLOCK];
  float amax = 0.f;
  for (int64_t k = 0; k < BLOCK; ++k) {
    vals[k] = tandem_simd::to_float(src[k]);
    amax = std::max(amax, std::fabs(vals[k]));
  }
  const float di = amax / 127.f;
  const float inv = di != 0.f ? 1.f / di : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < BLOCK; ++k) {
    const int v = static_cast<int>(std::nearbyint(vals[k] * inv));
    sum += v;
    q[k] = static_cast<int8_t>(v);
  }
  *d = di;
  *s = di * static_cast<float>(sum);
}
#endif

// Quantizes each 32-block of x to int8: d = max|x| / 127, q = x * (1 / d) rounded to nearest even.
// The same arithmetic, in the same order, as engine.quant.reference.
template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  at::parallel_for(0, M * (K / BLOCK), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_block(x + i * BLOCK, q + i * BLOCK, d + i, s + i);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAVE_INT_DOT = true;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// out[r][m][lane] = row (g + r) * 16 + lane of W against x row m0 + m, for R groups and MT rows of x.
template <int BITS, int R, int MT>
void qgroups(const QWeight& W, int64_t g, const QX& X, int64_t m0, float* out) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t j = 0; j < W.nb; ++j) {
    __m512i iacc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) iacc[r][m] = _mm512_setzero_si512();
    const int8_t* xb[MT];
    for (int m = 0; m < MT; ++m) xb[m] = X.q + (m0 + m) * X.K + j * BLOCK;
    const uint8_t* wb[R];
    for (int r = 0; r < R; ++r) wb[r] = W.data + ((g + r) * W.nb + j) * W.block_bytes();
    if constexpr (BITS == 4) {
      for (int t = 0; t < 4; ++t) {
        __m512i lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_loadu_si512(wb[r] + 64 * t);
          lo[r] = _mm512_and_si512(v, nibble);
          hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        for (int m = 0; m < MT; ++m) {
          const __m512i xl = bcast4(xb[m] + 8 * t), xh = bcast4(xb[m] + 8 * t + 4);
          for (int r = 0; r < R; ++r) iacc[r][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[r][m], lo[r], xl), hi[r], xh);
        }
      }
    } else {
      for (int s = 0; s < 8; ++s) {
        __m512i v[R];
        for (int r = 0; r < R; ++r) v[r] = _mm512_loadu_si512(wb[r] + 64 * s);
        for (int m = 0; m < MT; ++m) {
          const __m512i xv = bcast4(xb[m] + 4 * s);
          for (int r = 0; r < R; ++r) iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], v[r], xv);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = ((g + r) * W.nb + j) * GROUP;
      const __m512 ws = W.row_scale
          ? _mm512_loadu_ps(W.row_scale + (g + r) * GROUP)
          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.scale + at)));
      const __m512 wo = W.offset ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.offset + at)))
                                 : _mm512_mul_ps(ws, _mm512_set1_ps(-W.zero));
      for (int m = 0; m < MT; ++m) {
        const float* dm = X.d + (m0 + m) * X.nb;
        const float* sm = X.s + (m0 + m) * X.nb;
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r][m]), _mm512_set1_ps(dm[j]));
        acc[r][m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(sm[j]), _mm512_fmadd_ps(dot, ws, acc[r][m]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + (r * MT + m) * GROUP, acc[r][m]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TANDEM_QUANT_AVX2 1
constexpr bool HAVE_INT_DOT = true;

// Without VNNI (AVX2 CPUs: Zen 1-3, Intel's cores from Haswell on): the same integer sums with 16-bit products.
// Each 16 bytes of a step (4 rows x 4 k) are widened to int16 and multiplied by x's 4 values of that step with
// vpmaddwd, which adds them in pairs: the int32 lanes hold (row, k pair) sums, one vector per 4 rows, and two
// vectors' adjacent lanes are added at the end of a block (hadd, then the 64-bit halves put in row order).
// Exact for 8-bit weights too, where vpmaddubsw's int16 pair sums (255 x 127 x 2) would saturate. The block's
// float32 scaling is the VNNI kernel's, 8 lanes at a time: the same bits.
inline __m256i rows8(__m256i a, __m256i b) {  // rows 0-3 and 4-7 as (row, k pair) lanes -> 8 row sums
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xd8);
}

// One group of 16 rows against MR (1 or 2) rows of x from row m: out[i * GROUP, +16) for row m + i. Each 16 bytes
// of weights are loaded and widened once for the MR rows (one row at a time widened every group's weights again per
// row of x: at 64 rows the same work 64 times). A block's integer sums go a quarter of the step at a time (4 rows
// of W, all the k): integer sums are exact in any order, and the float32 scaling runs per block in block order as
// before, so the same bits. GCC hoists x's broadcasts out of the quarters and keeps some on the stack as vpmaddwd's
// memory operands; loading them again for each quarter measured slower, as did 4 rows at a time (x86-64-v3 build,
// Zen 4, 64 rows: 12.4 and 12.3 ms against 10.6).
template <int BITS, int MR>
void qgroup_rows(const QWeight& W, int64_t g, const QX& X, int64_t m, float* out) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi16(0x0f);
  const auto widen = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  for (int64_t j = 0; j < W.nb; ++j) {
    const auto x4 = [&](int i, int s) {  // row m + i's 4 values of step s in every 64-bit lane
      int64_t v;
      std::memcpy(&v, X.q16 + (m + i) * X.K + j * BLOCK + 4 * s, sizeof v);
      return _mm256_set1_epi64x(v);
    };
    const uint8_t* wb = W.data + (g * W.nb + j) * W.block_bytes();
    __m256i a[MR][4];
    for (int q = 0; q < 4; ++q) {
      for (int i = 0; i < MR; ++i) a[i][q] = _mm256_setzero_si256();
      if constexpr (BITS == 4) {
        for (int t = 0; t < 4; ++t) {
          const __m256i v = widen(wb + 64 * t + 16 * q);
          const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_srli_epi16(v, 4);
          for (int i = 0; i < MR; ++i) {
            a[i][q] = _mm256_add_epi32(a[i][q], _mm256_madd_epi16(lo, x4(i, 2 * t)));
            a[i][q] = _mm256_add_epi32(a[i][q], _mm256_madd_epi16(hi, x4(i, 2 * t + 1)));
          }
        }
      } else {
        for (int s = 0; s < 8; ++s) {
          const __m256i v = widen(wb + 64 * s + 16 * q);
          for (int i = 0; i < MR; ++i) a[i][q] = _mm256_add_epi32(a[i][q], _mm256_madd_epi16(v, x4(i, s)));
        }
      }
    }
    const int64_t at = (g * W.nb + j) * GROUP;
    __m256 dj[MR], sj[MR];  // each row's activation scale and sum for this block, for both halves
    for (int i = 0; i < MR; ++i) {
      dj[i] = _mm256_set1_ps(X.d[(m + i) * X.nb + j]);
      sj[i] = _mm256_set1_ps(X.s[(m + i) * X.nb + j]);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 ws = W.row_scale
          ? _mm256_loadu_ps(W.row_scale + g * GROUP + 8 * h)
          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.scale + at + 8 * h)));
      const __m256 wo = W.offset
          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.offset + at + 8 * h)))
          : _mm256_mul_ps(ws, _mm256_set1_ps(-W.zero));
      for (int i = 0; i < MR; ++i) {
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(rows8(a[i][2 * h], a[i][2 * h + 1])), dj[i]);
        acc[i][h] = _mm256_fmadd_ps(wo, sj[i], _mm256_fmadd_ps(dot, ws, acc[i][h]));
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(out + i * GROUP, acc[i][0]);
    _mm256_storeu_ps(out + i * GROUP + 8, acc[i][1]);
  }
}

// out[r][m][lane] as the VNNI kernel's: each group against its rows of x two at a time (the weights come again from
// L1 for each pair).
template <int BITS, int R, int MT>
void qgroups(const QWeight& W, int64_t g, const QX& X, int64_t m0, float* out) {
  for (int r = 0; r < R; ++r) {
    int m = 0;
    for (; m + 2 <= MT; m += 2) qgroup_rows<BITS, 2>(W, g + r, X, m0 + m, out + (r * MT + m) * GROUP);
    if (m < MT) qgroup_rows<BITS, 1>(W, g + r, X, m0 + m, out + (r * MT + m) * GROUP);
  }
}
#else
constexpr bool HAVE_INT_DOT = false;

// Portable version of the same sums (compilers vectorise the 16-lane loops).
template <int BITS, int R, int MT>
void qgroups(const QWeight& W, int64_t g, const QX& X, int64_t m0, float* out) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float acc[GROUP] = {0.f};
      const int8_t* xrow = X.q + (m0 + m) * X.K;
      for (int64_t j = 0; j < W.nb; ++j) {
        const uint8_t* wb = W.data + ((g + r) * W.nb + j) * W.block_bytes();
        int32_t isum[GROUP] = {0};
        for (int s = 0; s < 8; ++s)
          for (int64_t i = 0; i < 4 * GROUP; ++i) {
            const int u = BITS == 8 ? wb[64 * s + i] : (wb[64 * (s / 2) + i] >> (4 * (s % 2))) & 0x0f;
            isum[i / 4] += u * xrow[j * BLOCK + 4 * s + i % 4];
          }
        const float xd = X.d[(m0 + m) * X.nb + j], xs = X.s[(m0 + m) * X.nb + j];
        for (int64_t l = 0; l < GROUP; ++l) {
          const int64_t at = ((g + r) * W.nb + j) * GROUP + l;
          const float ws = W.row_scale ? W.row_scale[(g + r) * GROUP + l] : half_to_float(W.scale[at]);
          const float wo = W.offset ? half_to_float(W.offset[at]) : ws * -W.zero;
          acc[l] += static_cast<float>(isum[l]) * xd * ws + wo * xs;
        }
      }
      std::copy(acc, acc + GROUP, out + (r * MT + m) * GROUP);
    }
}
#endif

constexpr int QMAX_TILE = 4;  // rows of x per tile (2 groups x 4 rows: 8 integer and 8 float accumulators)

// One group's outputs of one row plus the bias, column by column (the portable form).
template <typename T>
inline void store_group(const float* r, const float* bias, int64_t n0, int64_t N, T* dst) {
  for (int64_t l = 0; l < GROUP && n0 + l < N; ++l) {
    dst[l] = tandem_simd::from_float<T>(r[l] + (bias ? bias[n0 + l] : 0.f));
  }
}

// y's rows m0 .. m0 + mt - 1, columns of groups g .. g + R - 1 (those below N), from r [R, mt, 16] plus the bias.
// With vectors, each group's 16 outputs of a row at once, rounded to bfloat16 as from_float does (store16_rounded /
// round8), where the portable loop tests and converts each output (see quantize_block for what that saved).
template <int R, typename T>
void store_rows(const float* r, int mt, int64_t m0, int64_t g, const float* bias, int64_t N, T* y) {
  for (int gr = 0; gr < R; ++gr) {
    const int64_t n0 = (g + gr) * GROUP;
#if defined(__AVX512F__)
    const __mmask16 cols = tandem_simd::columns(N - n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < mt; ++m) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(r + (gr * mt + m) * GROUP), b);
      T* dst = y + (m0 + m) * N + n0;
      if constexpr (std::is_same_v<T, float>) tandem_simd::store16(dst, v, cols);
      else tandem_simd::store16_rounded(dst, v, cols);
    }
#elif defined(TANDEM_QUANT_AVX2)
    const int64_t cols = std::min<int64_t>(GROUP, N - n0);  // a part-filled last group: its first cols outputs
    for (int h = 0; 8 * h < cols; ++h) {
      const __m256 b = bias ? _mm256_maskload_ps(bias + n0 + 8 * h, tandem_simd::lanes_below(cols - 8 * h))
                            : _mm256_setzero_ps();
      for (int m = 0; m < mt; ++m) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(r + (gr * mt + m) * GROUP + 8 * h), b);
        tandem_simd::store8(y + (m0 + m) * N + n0 + 8 * h, v, cols - 8 * h);
      }
    }
#else
    for (int m = 0; m < mt; ++m) store_group(r + (gr * mt + m) * GROUP, bias, n0, N, y + (m0 + m) * N + n0);
#endif
  }
}

template <int BITS, int R, typename T>
void qlinear_groups(const QWeight& W, const QX& X, int64_t M, const float* bias, int64_t N, int64_t g, T* y) {
  float r[R * QMAX_TILE * GROUP];
  for (int64_t m0 = 0; m0 < M; m0 += QMAX_TILE) {
    const int mt = static_cast<int>(std::min<int64_t>(QMAX_TILE, M - m0));
    switch (mt) {
      case 4: qgroups<BITS, R, 4>(W, g, X, m0, r); break;
      case 3: qgroups<BITS, R, 3>(W, g, X, m0, r); break;
      case 2: qgroups<BITS, R, 2>(W, g, X, m0, r); break;
      default: qgroups<BITS, R, 1>(W, g, X, m0, r); break;
    }
    store_rows<R>(r, mt, m0, g, bias, N, y);
  }
}

// Groups [p0, p1) of pairs (two groups per pass: twice the independent accumulators), the odd last one alone.
template <int BITS, typename T>
void qlinear_range(const QWeight& W, const QX& X, int64_t M, const float* bias, int64_t N, int64_t groups, int64_t p0,
                   int64_t p1, T* y) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = 2 * p;
    if (g + 1 < groups) qlinear_groups<BITS, 2>(W, X, M, bias, N, g, y);
    else qlinear_groups<BITS, 1>(W, X, M, bias, N, g, y);
  }
}

#if defined(TANDEM_AMX)
constexpr bool HAVE_AMX = true;

// Many rows of bfloat16 x on an AMX CPU: each pair of groups (32 rows of W) is dequantized once into the tiles'
// B layout and every block of 32 rows of x runs against it on the bfloat16 tiles (packed_linear's
// tandem_amx::matmul_2x2). An integer tile product per 32-block was measured first (bit-equal to the VNNI
// kernel): every block's int32 sums must leave the tiles to be scaled by that block's activation and weight
// scales, and that vector work (load, convert, scale, two fused adds per 16 sums) is what the VNNI loop
// costs, so it ran no faster (see docs/benchmarks.md). Dequantizing costs ~20 vector operations per 64 weights
// once per call, whatever the rows; here x is not quantized, so the result is the dequantized weight's matmul
// (qlinear_dequantized's) up to the order of float32 sums, not the integer kernel's.

// A block's step (4 of k for each of its 16 rows: 32-bit lane r holds row r's 4 bytes) as bfloat16 B rows.
// Shifts and masks, not byte shuffles, pick value i of every row (lane r of vector i is row r, k 4s + i), so
// the block's 16 scales apply lane for lane: w = scale * (u - zero) or scale * u + offset in float32, one
// rounding, as dequantize() computes it, then one rounding to bfloat16. Pair rows 2s and 2s + 1 of `out`
// (each 32 columns x 2 k; these 16 columns of each) get k 4s, 4s + 1 and 4s + 2, 4s + 3 interleaved.
struct Dequant {
  __m512i interleave, zero;
  explicit Dequant(float z) : zero(_mm512_set1_epi32(static_cast<int>(z))) {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 16; ++i) idx[2 * i] = static_cast<int16_t>(i), idx[2 * i + 1] = static_cast<int16_t>(16 + i);
    interleave = _mm512_load_si512(idx);
  }

  template <int BITS>
  inline void step(__m512i v, int shift, __m512 scale, const __m512* offset, uint16_t* out) const {
    const __m512i mask = _mm512_set1_epi32(BITS == 8 ? 0xff : 0x0f);
    __m512 w[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, shift + 8 * i), mask);
      w[i] = offset ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scale, *offset)
                    : _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, zero)), scale);
    }
    const __m512i even = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));
    const __m512i odd = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[3], w[2]));
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, even));
    _mm512_storeu_si512(out + 64, _mm512_permutexvar_epi16(interleave, odd));
  }
};

// Groups g .. g + R - 1 as out [K / 2, 32, 2] bfloat16 (a lone last group leaves columns 16-31 as they were).
template <int BITS>
void dequantize_pair(const QWeight& W, int64_t g, int R, uint16_t* out) {
  const Dequant dq(W.zero);
  for (int gr = 0; gr < R; ++gr)
    for (int64_t j = 0; j < W.nb; ++j) {
      const uint8_t* wb = W.data + ((g + gr) * W.nb + j) * W.block_bytes();
      const int64_t at = ((g + gr) * W.nb + j) * GROUP;
      const __m512 scale = W.row_scale
          ? _mm512_loadu_ps(W.row_scale + (g + gr) * GROUP)
          : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.scale + at)));
      __m512 offset;
      if (W.offset) offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W.offset + at)));
      const __m512* off = W.offset ? &offset : nullptr;
      uint16_t* rows = out + (j * BLOCK / 2 * 32 + gr * GROUP) * 2;  // pair 16 j, this group's 16 columns
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * (BITS == 8 ? s : s / 2));
        dq.step<BITS>(v, BITS == 8 ? 0 : 4 * (s % 2), scale, off, rows + 2 * s * 64);
      }
    }
}

// Pairs of groups [p0, p1) of y = x W^T (+ bias) for bfloat16 x [M, K], 32 rows of x per tile pass.
void qlinear_range_amx(const QWeight& W, const uint16_t* x, int64_t M, int64_t K, const float* bias, int64_t N,
                       int64_t groups, int64_t p0, int64_t p1, uint16_t* y) {
  thread_local std::vector<uint16_t> panel;
  panel.resize(K * 32);
  alignas(64) float c[32 * 32];
  int configured = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = 2 * p;
    const int R = g + 1 < groups ? 2 : 1;
    if (W.bits == 4) dequantize_pair<4>(W, g, R, panel.data());
    else dequantize_pair<8>(W, g, R, panel.data());
    const int64_t n0 = g * GROUP, n1 = std::min<int64_t>(N, n0 + R * GROUP);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
      if (rows != configured) tandem_amx::configure_2x2(configured = rows);
      tandem_amx::matmul_2x2(x + m0 * K, K * 2, rows, panel.data(), 32 * 4, BLOCK / 2 * 32 * 2, K / BLOCK, 1, c,
                             32 * 4);
      for (int h = 0; h < R; ++h) {  // each group's 16 outputs of a row at once, rounded as from_float (store_rows')
        const __mmask16 cols = tandem_simd::columns(n1 - n0 - h * GROUP);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias + n0 + h * GROUP) : _mm512_setzero_ps();
        for (int m = 0; m < rows; ++m)
          tandem_simd::store16_rounded(y + (m0 + m) * N + n0 + h * GROUP,
                                       _mm512_add_ps(_mm512_load_ps(c + m * 32 + h * GROUP), b), cols);
      }
    }
  }
  if (configured >= 0) _tile_release();
}
#else
constexpr bool HAVE_AMX = false;

void qlinear_range_amx(const QWeight&, const uint16_t*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                       int64_t, uint16_t*) {
  TORCH_CHECK(false, "qlinear: built without AMX");
}
#endif

// Rows of bfloat16 x from which the tiles run the product (where built, permitted and switched on; see set_amx).
// Over the default model's 120 layer matrices on a 2-core Xeon with AMX, 2 threads, caches flushed, ms per pass,
// integer kernel against tiles (Q4_1 / int8): 1 row 3.8 / 5.3 against 10.6 / 11.5 (dequantizing costs more than
// reading), 16 rows 10.7 / 12.3 against 9.7 / 11.9, 24 rows 14.7 / 16.3 against 10.1 / 12.7, 64 rows 35.2 /
// 35.1 against 16.7 / 17.7, 1,024 rows 524 / 495 against 137 / 147.
constexpr int64_t AMX_MIN_ROWS = 24;

}  // namespace

// x [M, K] float32 or bfloat16 -> [M, N] in x's dtype. `data` [Npad / 16, K / 32, 16 * 32 * bits / 8]
// uint8 in the group layout; `scale` float16 [Npad / 16, K / 32, 16] (per block) or float32 [Npad]
// (per row); `offset` float16 like a per-block scale, or none (then w = scale * (u - zero)); `bits` 4
// or 8; `bias` [N] or none; N <= Npad the real number of rows.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& offset, int64_t zero, int64_t bits, int64_t N,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "qlinear: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: float32 or bfloat16 x");
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: 4 or 8 bits");
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0, "qlinear: K must be a multiple of 32");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 3 && data.size(1) == nb &&
              data.size(2) == GROUP * BLOCK * bits / 8, "qlinear: data uint8 [N / 16, K / 32, 16 * 32 * bits / 8]");
  const int64_t groups = data.size(0), Npad = groups * GROUP;
  TORCH_CHECK(N <= Npad && N > Npad - GROUP, "qlinear: N must fill the last group of 16 rows");
  const bool per_row = scale.scalar_type() == at::kFloat;
  TORCH_CHECK(scale.is_contiguous() && (per_row ? scale.numel() == Npad
                                                : scale.scalar_type() == at::kHalf && scale.numel() == Npad * nb),
              "qlinear: scale float16 [N / 16, K / 32, 16] or float32 [N]");
  const bool has_offset = offset.has_value() && offset->defined();
  TORCH_CHECK(!has_offset || (!per_row && offset->scalar_type() == at::kHalf && offset->is_contiguous() &&
                              offset->numel() == scale.numel()), "qlinear: offset float16 shaped like the scale");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qlinear: bias must have one value per output");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  const QWeight W{data.data_ptr<uint8_t>(),
                  per_row ? nullptr : reinterpret_cast<const uint16_t*>(scale.data_ptr()),
                  has_offset ? reinterpret_cast<const uint16_t*>(offset->data_ptr()) : nullptr,
                  per_row ? scale.data_ptr<float>() : nullptr,
                  static_cast<float>(zero), nb, static_cast<int>(bits)};
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool f32 = x.scalar_type() == at::kFloat;
  void* yp = y.data_ptr();
  if (HAVE_AMX && !f32 && M >= AMX_MIN_ROWS && tandem_amx::usable(K)) {
    const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      qlinear_range_amx(W, xp, M, K, bp, N, groups, p0, p1, static_cast<uint16_t*>(yp));
    });
    return y;
  }
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  xq.resize(M * K);
  xd.resize(M * nb);
  xs.resize(M * nb);
  if (f32) quantize_x(xc.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  else quantize_x(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, xq.data(), xd.data(), xs.data());
  QX X{xq.data(), xd.data(), xs.data(), K, nb};
#if defined(TANDEM_QUANT_AVX2)
  thread_local std::vector<int16_t> xq16;
  xq16.assign(xq.begin(), xq.end());  // widened once here, not once per group of 16 weight rows
  X.q16 = xq16.data();
#endif
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    if (f32) {
      if (bits == 4) qlinear_range<4>(W, X, M, bp, N, groups, p0, p1, static_cast<float*>(yp));
      else qlinear_range<8>(W, X, M, bp, N, groups, p0, p1, static_cast<float*>(yp));
    } else {
      if (bits == 4) qlinear_range<4>(W, X, M, bp, N, groups, p0, p1, static_cast<uint16_t*>(yp));
      else qlinear_range<8>(W, X, M, bp, N, groups, p0, p1, static_cast<uint16_t*>(yp));
    }
  });
  return y;
}

bool qlinear_int_dot() { return HAVE_INT_DOT; }

bool qlinear_amx() { return HAVE_AMX && tandem_amx::permitted(); }
