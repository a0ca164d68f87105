// Causal attention of a prefill chunk: L queries (the last L of C positions) against C keys, grouped-query heads.
//
// Why our own: torch 2.13's CPU SDPA ran a 1,024-token prefill's attention at ~110 GFLOP/s (10.7 ms per layer of
// the default model, bfloat16 or float32 alike), more than half of the prefill, while the packed matmuls run
// ~950. Here each K/V head's keys are packed once per call into the k-major panels of packed_linear.cpp, and
// every task (one K/V head, QB query positions, all G query heads of the group) runs two register-blocked
// products on the dot-product units: scores = q K^T over the keys its positions can see, then a float32
// softmax per row (exp as 2^(s a - max a), a = scale log2 e: tandem_simd::exp2_16), then P V with P rounded to
// the dtype (as eager attention's probabilities are).
// On CPUs with AMX, bfloat16 products with D a multiple of 32 run on the tiles instead (scores_amx, pv_amx:
// 1.8 ms against 6.9 per layer of a 1,024-token prompt of the default model, float32 4.5, on a 2-core Xeon).
// A flash-attention form on the tiles (blocks of 64-256 keys, online softmax, so scores and P stay in L1) was
// built and measured no faster than these two passes over whole rows, and not kept (docs/benchmarks.md).
// AVX2 + FMA CPUs (no AVX-512) run the same two passes on 8 lanes in float32 (see their section below).
//
// Layouts: q [L, Hq, D], k and v [C, Hkv, D] (rows and heads may be strided, elements contiguous);
// out [L, Hq * D]. Query i sees keys j <= C - L + i.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "simd_math.h"

namespace {

using bf16_t = uint16_t;
constexpr int64_t QB = 8;     // query positions per task
constexpr int64_t KEYS = 32;  // keys per scores micro-tile (two vectors of 16)
constexpr int RS = 12;        // rows (query heads x positions) per scores micro-tile
constexpr int RO = 6;         // rows per P V micro-tile

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TANDEM_PREFILL_KERNEL 1
#endif

#if defined(__AVX512F__)
using tandem_simd::Step;

// One K/V head packed for the products below (pack_keys, pack_values).
template <typename T>
struct PackedHead {
  std::vector<T> k, v;
};

// A thread's buffers, kept across its tasks: q's rows of a task, scores, P, and P V before normalising.
template <typename T>
struct Scratch {
  std::vector<T> q, p;
  std::vector<float> s, o;
};

// One head's keys as panels of KEYS columns, k-major by element step S: kp[block][d / S][col][s], zero past C to
// a whole block of keys. A step of S elements is one 32-bit word, so each block is a transpose of words.
// (D is a multiple of 16 here: prefill_attention_supported.)
template <typename T>
void pack_keys(const T* k, int64_t C, int64_t D, int64_t k_row, std::vector<T>& out) {
  constexpr int64_t S = Step<T>::S;
  static_assert(sizeof(T) * S == 4, "an element step is one 32-bit word");
  const int64_t words = D / S, blocks = (C + KEYS - 1) / KEYS;
  out.assign(blocks * KEYS * D, T{});
  uint32_t* panel = reinterpret_cast<uint32_t*>(out.data());
  for (int64_t j = 0; j < C; ++j) {
    uint32_t* col = panel + j / KEYS * words * KEYS + j % KEYS;
    const T* row = k + j * k_row;
    for (int64_t w = 0; w < words; ++w) std::memcpy(col + w * KEYS, row + w * S, sizeof(uint32_t));
  }
}

// One head's values as one panel of D columns over the keys: vp[key / S][d][s], zero past C to a whole block of
// keys (the tiles read P V 32 keys at a time). float32: the rows as they are; bfloat16: each pair of rows
// interleaved, 32 columns at a time.
template <typename T>
void pack_values(const T* v, int64_t C, int64_t D, int64_t v_row, std::vector<T>& out) {
  const int64_t Cp = (C + KEYS - 1) / KEYS * KEYS;
  out.assign(Cp * D, T{});
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < C; ++j) std::copy_n(v + j * v_row, D, out.data() + j * D);
  } else {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < C; j += 2) {
      const T* a = v + j * v_row;
      const T* b = j + 1 < C ? a + v_row : nullptr;  // past C: the zero key
      T* dst = out.data() + j * D;                  // pair j / 2: D columns of 2
      for (int64_t d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
        const __m512i x = _mm512_maskz_loadu_epi16(m, a + d);
        const __m512i y = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
        if (D - d > 16) _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
  }
}

// acc[r][c] = sum over `steps` element steps s of x[r][s * S..] against the 16 columns of vector c in a k-major
// panel (ldw elements per step): the register-blocked product both of the products below run.
template <typename T, int R, int V>
inline void dot_tile(const T* const* x, int64_t steps, const T* w, int64_t ldw, __m512 (&acc)[R][V]) {
  using St = Step<T>;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s, w += ldw) {
    for (int r = 0; r < R; ++r) {
      const auto xv = St::bcast(x[r] + s * St::S);
      for (int c = 0; c < V; ++c) acc[r][c] = St::fma(acc[r][c], w + c * 16 * St::S, xv);
    }
  }
}

// scores[r][0, 32 * nb) for R rows of q (each a row of D elements) against nb key panels, unscaled (the
// softmax scales them as it reads them).
template <typename T, int R>
void scores_tile(const T* const* q, int64_t D, const T* kp, int64_t nb, float* const* scores) {
  constexpr int64_t S = Step<T>::S;
  __m512 acc[R][2];
  for (int64_t b = 0; b < nb; ++b) {
    dot_tile<T, R, 2>(q, D / S, kp + b * D * KEYS, KEYS * S, acc);
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores[r] + b * KEYS, acc[r][0]);
      _mm512_storeu_ps(scores[r] + b * KEYS + 16, acc[r][1]);
    }
  }
}

// o[r][0, D) = sum over keys [0, n) of p[r][key] v[key], for D a multiple of 16 up to 128 (V vectors).
template <typename T, int R, int V>
void pv_tile(const T* const* p, int64_t n, const T* vp, int64_t D, float* const* o) {
  constexpr int64_t S = Step<T>::S;
  __m512 acc[R][V];
  dot_tile<T, R, V>(p, n / S, vp, D * S, acc);  // n: a whole number of steps
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(o[r] + c * 16, acc[r][c]);
}

#if defined(TANDEM_AMX)
// The two products on the AMX tiles (bfloat16, D a multiple of 32), 32 rows at a time: the scores unscaled
// like scores_tile's, P V over whole blocks of keys (P and the padded V are zero past them).
void scores_amx(const bf16_t* q, int64_t rows, int64_t D, const bf16_t* kp, int64_t nb, float* scores,
                int64_t width) {
  for (int64_t r = 0; r < rows; r += 32) {
    const int n = static_cast<int>(std::min<int64_t>(32, rows - r));
    tandem_amx::configure_2x2(n);
    for (int64_t b = 0; b < nb; ++b)  // a key block: [D / 2][KEYS][2]; 16 pairs of d are KEYS * 16 elements
      tandem_amx::matmul_2x2(q + r * D, D * 2, n, kp + b * D * KEYS, KEYS * 4, KEYS * 32, D / 32, 1,
                             scores + r * width + b * KEYS, width * 4);
  }
}

void pv_amx(const bf16_t* p, int64_t rows, int64_t width, const bf16_t* vp, int64_t D, float* o) {
  for (int64_t r = 0; r < rows; r += 32) {
    const int n = static_cast<int>(std::min<int64_t>(32, rows - r));
    tandem_amx::configure_2x2(n);
    tandem_amx::matmul_2x2(p + r * width, width * 2, n, vp, D * 4, 32 * D, width / 32, D / 32, o + r * D, D * 4);
  }
}
#endif

template <typename T, int V>
void pv_rows(const T* const* p, int64_t rows, int64_t n, const T* vp, int64_t D, float* const* o) {
  constexpr int R = V > 4 ? RO / 2 : RO;  // accumulators R x V within the 32 registers
  int64_t r = 0;
  for (; r + R <= rows; r += R) pv_tile<T, R, V>(p + r, n, vp, D, o + r);
  for (; r < rows; ++r) pv_tile<T, 1, V>(p + r, n, vp, D, o + r);
}

// One task: K/V head h, query positions [i0, i1), all G heads of the group.
template <typename T>
void attend_block(const T* q, int64_t q_row, int64_t D, int64_t G, int64_t h, int64_t i0, int64_t i1,
                  int64_t offset, const PackedHead<T>& packed, float scale, T* out, int64_t out_row,
                  Scratch<T>& buf, bool amx) {
  constexpr int64_t S = Step<T>::S;
  const int64_t rows = (i1 - i0) * G, seen = offset + i1;  // keys the last position sees
  const int64_t nb = (seen + KEYS - 1) / KEYS, width = nb * KEYS;
  auto &qbuf = buf.q, &pbuf = buf.p;
  auto &sbuf = buf.s, &obuf = buf.o;
  qbuf.resize(rows * D);  // every row copied below
  sbuf.resize(rows * width);
  pbuf.resize(rows * width);
  obuf.resize(rows * D);
  std::vector<const T*> qp(rows), pp(rows);
  std::vector<float*> sp(rows), op(rows);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - i0) * G + g;
      std::copy_n(q + i * q_row + (h * G + g) * D, D, qbuf.data() + r * D);
      qp[r] = qbuf.data() + r * D;
      sp[r] = sbuf.data() + r * width;
      pp[r] = pbuf.data() + r * width;
      op[r] = obuf.data() + r * D;
    }
  int64_t r = 0;
#if defined(TANDEM_AMX)
  if constexpr (std::is_same_v<T, bf16_t>)
    if (amx) {
      scores_amx(qbuf.data(), rows, D, packed.k.data(), nb, sbuf.data(), width);
      r = rows;
    }
#endif
  for (; r + RS <= rows; r += RS) scores_tile<T, RS>(qp.data() + r, D, packed.k.data(), nb, sp.data() + r);
  for (; r < rows; ++r) scores_tile<T, 1>(qp.data() + r, D, packed.k.data(), nb, sp.data() + r);
  std::vector<float> total(rows);
  // exp((s - max) * scale) as 2^(s a - max a), a = scale log2 e: one fused multiply-subtract per 16 scores.
  constexpr int terms = std::is_same_v<T, float> ? 6 : 4;  // P in bfloat16 needs no more (see exp2_16)
  const float a = scale * tandem_simd::LOG2E;
  const __m512 av = _mm512_set1_ps(a);
  for (r = 0; r < rows; ++r) {  // softmax over the keys this row's position sees; the rest are zero in P
    const int64_t n = offset + i0 + r / G + 1;
    const float* s = sp[r];
    T* p = pbuf.data() + r * width;
    const __m512 top = _mm512_set1_ps(tandem_simd::row_max(s, n) * a);  // a > 0: the scaled max
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    // Whole vectors unmasked, then the last part masked (one shared body taking the mask was not inlined twice
    // by GCC 12, and its masked loads and moves stayed in the main loop).
    for (; j + 16 <= n; j += 16) {  // P, unnormalised, stored in the dtype as it is computed
      const __m512 e = tandem_simd::exp2_16<terms>(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), av, top));
      sum = _mm512_add_ps(sum, e);
      tandem_simd::store16(p + j, e, 0xffff);
    }
    if (j < n) {
      const __mmask16 m = tandem_simd::columns(n - j);
      const __m512 e = tandem_simd::exp2_16<terms>(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), av, top));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
      tandem_simd::store16(p + j, e, m);
    }
    std::fill(p + n, p + width, T{});
    total[r] = _mm512_reduce_add_ps(sum);
  }
  const int64_t n = (seen + S - 1) / S * S;
  bool done = false;
#if defined(TANDEM_AMX)
  if constexpr (std::is_same_v<T, bf16_t>)
    if (amx) {
      pv_amx(pbuf.data(), rows, width, packed.v.data(), D, obuf.data());
      done = true;
    }
#endif
  if (!done) switch (D / 16) {
    case 1: pv_rows<T, 1>(pp.data(), rows, n, packed.v.data(), D, op.data()); break;
    case 2: pv_rows<T, 2>(pp.data(), rows, n, packed.v.data(), D, op.data()); break;
    case 4: pv_rows<T, 4>(pp.data(), rows, n, packed.v.data(), D, op.data()); break;
    case 6: pv_rows<T, 6>(pp.data(), rows, n, packed.v.data(), D, op.data()); break;
    default: pv_rows<T, 8>(pp.data(), rows, n, packed.v.data(), D, op.data()); break;
  }
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = (i - i0) * G + g;
      const __m512 inv = _mm512_set1_ps(1.f / total[row]);
      T* dst = out + i * out_row + (h * G + g) * D;
      for (int64_t d = 0; d < D; d += 16)
        tandem_simd::store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(op[row] + d), inv), 0xffff);
    }
}

#elif defined(TANDEM_PREFILL_KERNEL)
// AVX2 + FMA without AVX-512 (Zen 1-3, Intel's cores from Haswell to Alder Lake): the same tasks and two passes
// on 8 lanes, all in float32. q, the packed keys and values, and P are widened once, outside the products
// (bfloat16 values are exact in float32, so the products are the dot-product kernel's, P still rounded to
// bfloat16 first): there is no bfloat16 arithmetic to use, and widening in the loops would add integer work
// to products that are bound by the FMA units.

template <typename T>
struct PackedHead {
  std::vector<float> k, v;
};

// A thread's buffers, kept across its tasks: q's rows of a task in float32, scores (then P in place), P V.
template <typename T>
struct Scratch {
  std::vector<float> q, s, o;
};

constexpr int RS8 = 3;  // rows per scores micro-tile: 3 x 4 vectors of 8 keys, 12 of the 16 registers
constexpr int RO8 = 3;  // rows per P V micro-tile, 4 vectors of 8 columns at a time (2 for D = 16)

// One head's keys as float32 panels of KEYS columns, k-major: kp[block][d][col], zero past C to a whole block.
template <typename T>
void pack_keys(const T* k, int64_t C, int64_t D, int64_t k_row, std::vector<float>& out) {
  out.assign((C + KEYS - 1) / KEYS * KEYS * D, 0.f);
  for (int64_t j = 0; j < C; ++j) {
    float* col = out.data() + j / KEYS * D * KEYS + j % KEYS;
    const T* row = k + j * k_row;
    for (int64_t d = 0; d < D; ++d) col[d * KEYS] = tandem_simd::to_float(row[d]);
  }
}

// One head's values as float32 rows [C][D] (panels of 32 columns, read front to back by P V, were no faster).
template <typename T>
void pack_values(const T* v, int64_t C, int64_t D, int64_t v_row, std::vector<float>& out) {
  out.resize(C * D);
  for (int64_t j = 0; j < C; ++j)
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = tandem_simd::to_float(v[j * v_row + d]);
}

// acc[r][c] = sum over `steps` of x[r][s] times the 8 columns of vector c at w + s * ldw (dot_tile on 8 lanes).
template <int R, int V>
inline void dot_tile8(const float* const* x, int64_t steps, const float* w, int64_t ldw, __m256 (&acc)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s, w += ldw) {
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x[r] + s);
      for (int c = 0; c < V; ++c) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + c * 8), xv, acc[r][c]);
    }
  }
}

template <int R>
void scores_tile8(const float* const* q, int64_t D, const float* kp, int64_t nb, float* const* scores) {
  __m256 acc[R][KEYS / 8];
  for (int64_t b = 0; b < nb; ++b) {
    dot_tile8<R, KEYS / 8>(q, D, kp + b * D * KEYS, KEYS, acc);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < KEYS / 8; ++c) _mm256_storeu_ps(scores[r] + b * KEYS + c * 8, acc[r][c]);
  }
}

// o[r][0, D) = sum over keys [0, n) of p[r][key] v[key], V vectors of 8 columns at a time.
template <int R, int V>
void pv_tile8(const float* const* p, int64_t n, const float* vp, int64_t D, float* const* o) {
  __m256 acc[R][V];
  for (int64_t c0 = 0; c0 < D; c0 += 8 * V) {
    dot_tile8<R, V>(p, n, vp + c0, D, acc);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) _mm256_storeu_ps(o[r] + c0 + c * 8, acc[r][c]);
  }
}

template <int V>
void pv_rows8(const float* const* p, int64_t rows, int64_t n, const float* vp, int64_t D, float* const* o) {
  int64_t r = 0;
  for (; r + RO8 <= rows; r += RO8) pv_tile8<RO8, V>(p + r, n, vp, D, o + r);
  for (; r < rows; ++r) pv_tile8<1, V>(p + r, n, vp, D, o + r);
}

// One task: K/V head h, query positions [i0, i1), all G heads of the group (attend_block on 8 lanes).
template <typename T>
void attend_block(const T* q, int64_t q_row, int64_t D, int64_t G, int64_t h, int64_t i0, int64_t i1,
                  int64_t offset, const PackedHead<T>& packed, float scale, T* out, int64_t out_row,
                  Scratch<T>& buf, bool) {
  const int64_t rows = (i1 - i0) * G, seen = offset + i1;  // keys the last position sees
  const int64_t nb = (seen + KEYS - 1) / KEYS, width = nb * KEYS;
  buf.q.resize(rows * D);
  buf.s.resize(rows * width);
  buf.o.resize(rows * D);
  std::vector<const float*> qp(rows);
  std::vector<float*> sp(rows), op(rows);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - i0) * G + g;
      const T* src = q + i * q_row + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) buf.q[r * D + d] = tandem_simd::to_float(src[d]);
      qp[r] = buf.q.data() + r * D;
      sp[r] = buf.s.data() + r * width;
      op[r] = buf.o.data() + r * D;
    }
  int64_t r = 0;
  for (; r + RS8 <= rows; r += RS8) scores_tile8<RS8>(qp.data() + r, D, packed.k.data(), nb, sp.data() + r);
  for (; r < rows; ++r) scores_tile8<1>(qp.data() + r, D, packed.k.data(), nb, sp.data() + r);
  // P in place of the scores: 2^(s a - max a) as on AVX-512, rounded to T, zero from the row's keys to `seen`.
  std::vector<float> total(rows);
  constexpr int terms = std::is_same_v<T, float> ? 6 : 4;
  const float a = scale * tandem_simd::LOG2E;
  const __m256 av = _mm256_set1_ps(a);
  for (r = 0; r < rows; ++r) {
    const int64_t n = offset + i0 + r / G + 1;
    float* s = sp[r];
    const __m256 top = _mm256_set1_ps(tandem_simd::row_max8(s, n) * a);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = tandem_simd::exp2_8<terms>(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), av, top));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(s + j, tandem_simd::round8(e, T{}));
    }
    if (j < n) {  // the row's last keys; the lanes past them (within the row's width) are set to zero
      const __m256 keep = _mm256_castsi256_ps(tandem_simd::lanes_below(n - j));
      const __m256 y = _mm256_fmsub_ps(_mm256_loadu_ps(s + j), av, top);
      const __m256 e = _mm256_and_ps(keep, tandem_simd::exp2_8<terms>(y));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(s + j, tandem_simd::round8(e, T{}));
      j += 8;
    }
    if (j < seen) std::fill(s + j, s + seen, 0.f);
    total[r] = tandem_simd::sum8(sum);
  }
  if (D % 32 == 0) pv_rows8<4>(sp.data(), rows, seen, packed.v.data(), D, op.data());
  else pv_rows8<2>(sp.data(), rows, seen, packed.v.data(), D, op.data());  // D = 16
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = (i - i0) * G + g;
      const float inv = 1.f / total[row];
      T* dst = out + i * out_row + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = tandem_simd::from_float<T>(op[row][d] * inv);
    }
}

#endif

}  // namespace

bool prefill_attention_supported(const at::Tensor& q) {
#if defined(TANDEM_PREFILL_KERNEL)
  const int64_t D = q.size(-1);
  const bool shape = D == 16 || D == 32 || D == 64 || D == 96 || D == 128;  // the cases of pv_rows
  if (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) return shape;
#endif
  return false;
}

// q [L, Hq, D], k/v [C, Hkv, D] (C >= L; the queries are the last L positions) -> [L, Hq * D].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [L, Hq, D], k/v [C, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefill_attention: CPU tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && k.size(0) >= q.size(0),
              "prefill_attention: k and v [C, Hkv, D] with C >= L and q's D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "prefill_attention: dtypes");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(prefill_attention_supported(q), "prefill_attention: no kernel here for ", q.scalar_type(),
              " and head size ", q.size(2));
  for (const auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "prefill_attention: elements contiguous");
  TORCH_CHECK(q.stride(1) == q.size(2), "prefill_attention: q's heads contiguous");
  const int64_t L = q.size(0), Hq = q.size(1), D = q.size(2), C = k.size(0), Hkv = k.size(1), G = Hq / Hkv;
  auto out = at::empty({L, Hq * D}, q.options());
  if (L == 0) return out;
#if defined(TANDEM_PREFILL_KERNEL)
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const bool amx = std::is_same_v<T, bf16_t> && tandem_amx::usable(D);  // both products on the tiles
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const T* kp = reinterpret_cast<const T*>(k.data_ptr());
    const T* vp = reinterpret_cast<const T*>(v.data_ptr());
    T* o = reinterpret_cast<T*>(out.data_ptr());
    std::vector<PackedHead<T>> heads(Hkv);
    at::parallel_for(0, 2 * Hkv, 1, [&](int64_t t0, int64_t t1) {  // keys and values apart: 2 Hkv even tasks
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t h = t / 2;
        if (t % 2) pack_values(vp + h * v.stride(1), C, D, v.stride(0), heads[h].v);
        else pack_keys(kp + h * k.stride(1), C, D, k.stride(0), heads[h].k);
      }
    });
    // Tasks ordered first block, last block, second, second to last...: later blocks see more keys, and
    // at::parallel_for hands each thread one contiguous run, which this order balances.
    const int64_t blocks = (L + QB - 1) / QB, tasks = Hkv * blocks;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      Scratch<T> buf;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t h = t % Hkv, j = t / Hkv, b = j % 2 ? blocks - 1 - j / 2 : j / 2;
        const int64_t i0 = b * QB, i1 = std::min(L, i0 + QB);
        attend_block<T>(qp, q.stride(0), D, G, h, i0, i1, C - L, heads[h], static_cast<float>(scale), o, Hq * D,
                        buf, amx);
      }
#if defined(TANDEM_AMX)
      if (amx) _tile_release();
#endif
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(bf16_t{});
  } else {
    run(float{});
  }
#endif
  return out;
}
