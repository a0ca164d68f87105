// CPU kernels for the decode path: the steps that eager PyTorch runs as many small ops or as
// kernels tuned for large matrices.
//
// - linear: y = x W^T (+ b) on weights in their plain [N, K] layout (packed_linear.cpp serves the weights
//   the engine packs at load on AVX-512 and AVX2 CPUs), streaming each weight row once per 4 rows of x.
//   Decode reads every weight once per step, so it is bound by memory bandwidth, which oneDNN's small-M paths leave
//   partly unused, bfloat16 ones on CPUs without bf16 dot products most (there its GEMMs are
//   slow at any M, and this kernel serves every bfloat16 matmul).
// - paged_decode_attention: one query token per sequence over its paged K/V, read in place from
//   the cache (no gather copy), grouped-query heads sharing each K/V row load.
// - rms_norm / add_rms_norm_ / silu_mul / rope_ / write_kv_: fused element-wise work that eager
//   mode spends 4-6 ops on, each a pass over memory plus dispatch overhead.
//
// Rounding follows Hugging Face's Llama in the tensor's dtype wherever it rounds between ops
// (RMSNorm's normalised value before the weight, SiLU before the product, each RoPE product),
// so that bfloat16 results stay within rounding of the reference; accumulation is float32.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "simd_math.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__)
using tandem_simd::exp16;
using tandem_simd::round16;
#endif

namespace {

using bf16_t = uint16_t;

using tandem_simd::from_float;
using tandem_simd::to_float;

using tandem_simd::round_to;

template <typename T>
inline const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T>
inline T* mut_ptr(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Calls fn.template operator()<T>() with T = float or bf16_t for the tensor's dtype.
template <typename Fn>
void dispatch(const at::Tensor& t, const char* op, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(bf16_t{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 tensors only, got ", t.scalar_type());
  }
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
}

constexpr int64_t LANES = 16;  // one AVX-512 register of float32
constexpr int ROWS = 4;        // weight rows per block: each loaded x vector serves all of them
constexpr int MAX_TILE = 4;    // rows of x per tile: each loaded weight vector serves all of them
// How far ahead bfloat16 weights are prefetched: 4 rows of 1 KB (K = 576) read side by side are
// short streams the hardware prefetcher ramps up on late. Measured on 2 cores: 19 GB/s without,
// 21-25 GB/s at 4-16 KB ahead; float32 rows gain nothing.
constexpr int PREFETCH_BYTES = 4096;

// x as the kernels read it: float32 rows, and for bfloat16 weights with K % 32 == 0 the same rows
// de-interleaved into even and odd columns (see dot_pairs).
struct XRows {
  const float* x;   // [M, K]
  const float* xe;  // [M, K / 2] or null
  const float* xo;
  int64_t K;
  const bf16_t* xb = nullptr;  // x itself, for dot_bf16 (bfloat16 x, K % 32 == 0, AVX512_BF16)
};

#if defined(__AVX512F__)
using tandem_simd::load16;
using tandem_simd::widen16;

template <typename W>
inline void prefetch_rows(const W* w, int64_t K, int64_t k) {
  for (int r = 0; r < ROWS; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
}

// out[r][m] = dot(weight row r, x row m) for ROWS weight rows and M rows of x; independent
// accumulators keep the FMA pipes and the memory streams busy.
template <typename W, int M>
inline void dot_block(const W* w, const float* x, int64_t K, float* out) {
  __m512 acc[ROWS][M];
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 wv = load16(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(to_float(w[r * K + kk]), x[m * K + kk], s);
      out[r * M + m] = s;
    }
}

// bfloat16 weights 32 per load: the even columns are the low half of each 32-bit lane (shifted
// up), the odd ones the high half (masked), so one load, a shift and an AND feed two FMAs,
// against x de-interleaved the same way. Half the instructions of converting 16 at a time.
template <int M>
inline void dot_pairs(const bf16_t* w, const float* xe, const float* xo, int64_t K, float* out) {
  __m512 acc[ROWS][M];
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t half = K / 2;
  for (int64_t k = 0; k < K; k += 32) {
    prefetch_rows(w, K, k);
    __m512 ev[M], od[M];
    for (int m = 0; m < M; ++m) {
      ev[m] = _mm512_loadu_ps(xe + m * half + k / 2);
      od[m] = _mm512_loadu_ps(xo + m * half + k / 2);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * K + k);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wo, od[m], _mm512_fmadd_ps(we, ev[m], acc[r][m]));
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}
constexpr bool HAVE_PAIRS = true;

// Sums of 16 vectors, one per lane of the result (a[i]'s sum in lane i): a transpose-and-add tree
// of 15 adds and 30 shuffles, where 16 separate horizontal sums take ~130 instructions.
inline __m512 sum16(const __m512* a) {
  __m512 p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0 a1 a0 a1] partial sums (cols 0+2, 1+3)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per chunk: [a0 a1 a2 a3]
    q[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44), _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // chunks: [0-3, 0-3, 4-7, 4-7] halves
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
}
#else
template <typename W, int M>
inline void dot_block(const W* w, const float* x, int64_t K, float* out) {
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += to_float(w[r * K + k]) * x[m * K + k];
      out[r * M + m] = s;
    }
}
template <int M>
inline void dot_pairs(const bf16_t*, const float*, const float*, int64_t, float*) {}
constexpr bool HAVE_PAIRS = false;
#endif

#if defined(__AVX512BF16__)
// bfloat16 x and weights, 32 columns per instruction (vdpbf16ps: pairs of products added into
// float32 lanes; a product of two bfloat16 values is exact in float32). Twice the multiply rate of
// float32 FMAs and no widening of the weights: what makes 2-64 rows compute-bound no sooner than a
// GEMM. K % 32 == 0.
template <int M>
inline void dot_bf16(const bf16_t* w, const bf16_t* x, int64_t K, float* out) {
  static_assert(ROWS * MAX_TILE == 16, "sum16 reduces 16 accumulators");
  __m512 acc[ROWS * MAX_TILE];
  for (int i = 0; i < ROWS * MAX_TILE; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    prefetch_rows(w, K, k);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r * MAX_TILE + m] = _mm512_dpbf16_ps(acc[r * MAX_TILE + m], wv, xv[m]);
    }
  }
  alignas(64) float sums[ROWS * MAX_TILE];
  _mm512_store_ps(sums, sum16(acc));
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < M; ++m) out[r * M + m] = sums[r * MAX_TILE + m];
}
constexpr bool HAVE_DPBF16 = true;
#else
template <int M>
inline void dot_bf16(const bf16_t*, const bf16_t*, int64_t, float*) {}
constexpr bool HAVE_DPBF16 = false;
#endif

// One block of ROWS weight rows against M rows of x starting at row m0.
template <typename W, int M>
inline void block(const W* w, const XRows& x, int64_t m0, float* out) {
  if constexpr (std::is_same_v<W, bf16_t>) {
    if (x.xb) return dot_bf16<M>(w, x.xb + m0 * x.K, x.K, out);
    if (x.xe) return dot_pairs<M>(w, x.xe + m0 * x.K / 2, x.xo + m0 * x.K / 2, x.K, out);
  }
  dot_block<W, M>(w, x.x + m0 * x.K, x.K, out);
}

template <typename W, int MT>
inline void tile(const W* wb, const XRows& x, int64_t m0, int rows, const W* bias, int64_t n, int64_t N, W* y) {
  float r[ROWS * MT];
  block<W, MT>(wb, x, m0, r);
  for (int i = 0; i < rows; ++i) {
    const float b = bias ? to_float(bias[n + i]) : 0.f;
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n + i] = from_float<W>(r[i * MT + m] + b);
  }
}

// Weight blocks [b0, b1) (ROWS rows each) against every row of x, MAX_TILE rows of x at a time
// while the block stays in L1.
template <typename W>
void linear_blocks(const W* w, const XRows& x, int64_t M, const W* bias, int64_t N, int64_t b0, int64_t b1, W* y) {
  const int64_t K = x.K;
  std::vector<W> padded;  // the last block when N % ROWS != 0: zero rows keep the kernels branch-free
  for (int64_t bi = b0; bi < b1; ++bi) {
    const int64_t n = bi * ROWS;
    const int rows = static_cast<int>(std::min<int64_t>(ROWS, N - n));
    const W* wb = w + n * K;
    if (rows < ROWS) {
      padded.assign(ROWS * K, W{});
      std::copy(wb, wb + rows * K, padded.begin());
      wb = padded.data();
    }
    int64_t m0 = 0;
    for (; m0 + MAX_TILE <= M; m0 += MAX_TILE) tile<W, MAX_TILE>(wb, x, m0, rows, bias, n, N, y);
    switch (M - m0) {
      case 1: tile<W, 1>(wb, x, m0, rows, bias, n, N, y); break;
      case 2: tile<W, 2>(wb, x, m0, rows, bias, n, N, y); break;
      case 3: tile<W, 3>(wb, x, m0, rows, bias, n, N, y); break;
      default: break;
    }
  }
}

// x in float32, and de-interleaved for dot_pairs when `pairs`, in buffers of the calling thread
// (decode calls this ~120 times a step: torch ops for it would cost more than some matmuls).
template <typename W>
XRows prepare_x(const W* x, int64_t M, int64_t K, bool pairs) {
  thread_local std::vector<float> buf;
  buf.resize(M * K);
  float* f = buf.data();
  if (!pairs) {
    for (int64_t i = 0; i < M * K; ++i) f[i] = to_float(x[i]);
    return {f, nullptr, nullptr, K};
  }
  const int64_t half = K / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K / 32; ++c)
      for (int64_t j = 0; j < 16; ++j) {
        f[m * half + c * 16 + j] = to_float(x[m * K + c * 32 + 2 * j]);
        f[M * half + m * half + c * 16 + j] = to_float(x[m * K + c * 32 + 2 * j + 1]);
      }
  return {nullptr, f, f + M * half, K};
}

}  // namespace

// x [M, K], weight [N, K] (nn.Linear's layout), bias [N] or none -> [M, N], accumulated in float32.
// Each weight row is read once per MAX_TILE rows of x, so this is the kernel for decode's few
// rows; a large M is better served by a GEMM, except with bfloat16 weights on CPUs without
// bfloat16 dot products, where oneDNN's bf16 GEMM runs at a fraction of its float32 speed.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: shape mismatch");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "linear: x and weight dtypes differ");
  TORCH_CHECK(weight.is_contiguous(), "linear: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias must have one value per output");
    b = bias->to(x.scalar_type()).contiguous();
  }
  dispatch(x, "linear", [&](auto tag) {
    using W = decltype(tag);
    XRows rows{nullptr, nullptr, nullptr, K};
    if (std::is_same_v<W, bf16_t> && HAVE_DPBF16 && K % 32 == 0 && M > 1)
      rows.xb = reinterpret_cast<const bf16_t*>(xc.data_ptr());
    else
      rows = prepare_x(ptr<W>(xc), M, K, std::is_same_v<W, bf16_t> && HAVE_PAIRS && K % 32 == 0);
    const W* bp = b.defined() ? ptr<W>(b) : nullptr;
    const W* wp = ptr<W>(weight);
    W* yp = mut_ptr<W>(y);
    at::parallel_for(0, (N + ROWS - 1) / ROWS, 16, [&](int64_t b0, int64_t b1) {
      linear_blocks<W>(wp, rows, M, bp, N, b0, b1, yp);
    });
  });
  return y;
}


namespace {

template <typename T>
void rms_norm_row(const T* x, const T* w, float eps, int64_t H, T* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = from_float<T>(to_float(w[i]) * round_to<T>(to_float(x[i]) * inv));
}

#if defined(__AVX512F__)
// A product rounded to T as torch rounds it (tandem_simd::to_bf16): with AVX512_BF16 one vcvtneps2bf16, nearest even
// as torch for every normal value (denormals flush to zero), where round16 takes seven (norm_row_bf16, rope_row).
inline __m512 rnd(__m512 v, float) { return v; }
inline __m512 rnd(__m512 v, bf16_t) { return widen16(tandem_simd::to_bf16(v)); }

// rms_norm_row of a bfloat16 row (H % 16 == 0), with the residual add, rounding as rnd does: one instruction where
// round16, the shift and the pack take nine, and on Zen 4 every 512-bit one is two: a 16-row call 7.2 -> 5.6 us,
// 1,024 rows 175 -> 118.
void norm_row_bf16(bf16_t* x, const bf16_t* delta, const bf16_t* w, float eps, int64_t H, bf16_t* out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += LANES) {
    __m512 v = load16(x + i);
    if (delta) {  // rounded once, stored, and read on as float32
      const __m256i r = tandem_simd::to_bf16(_mm512_add_ps(v, load16(delta + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), r);
      v = widen16(r);
    }
    ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += LANES) {
    const __m512 n = rnd(_mm512_mul_ps(load16(x + i), inv), bf16_t{});
    tandem_simd::store16(out + i, _mm512_mul_ps(load16(w + i), n), 0xffff);  // rounds as it packs
  }
}
#endif

// RMSNorm of each row of x [rows, H] into out; with `delta`, x += delta first (in place, rounded
// to the dtype as an eager add is), so the residual add and the norm after it are one pass.
template <typename T>
void norm_rows(T* x, const T* delta, const T* w, float eps, int64_t rows, int64_t H, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * H;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, bf16_t>)
        if (H % LANES == 0) {
          norm_row_bf16(xr, delta ? delta + r * H : nullptr, w, eps, H, out + r * H);
          continue;
        }
#endif
      if (delta)
        for (int64_t i = 0; i < H; ++i) xr[i] = from_float<T>(to_float(xr[i]) + to_float(delta[r * H + i]));
      rms_norm_row(xr, w, eps, H, out + r * H);
    }
  });
}

at::Tensor norm(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps, const char* op) {
  check_cpu(x, op);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.numel() == x.size(1), op, ": x [T, H] contiguous, weight [H]");
  at::Tensor d;
  if (delta) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), op, ": delta must match x");
    d = delta->contiguous();
  }
  auto out = at::empty_like(x);
  auto w = weight.to(x.scalar_type()).contiguous();
  dispatch(x, op, [&](auto tag) {
    using T = decltype(tag);
    norm_rows(mut_ptr<T>(x), d.defined() ? ptr<T>(d) : nullptr, ptr<T>(w), static_cast<float>(eps), x.size(0),
              x.size(1), mut_ptr<T>(out));
  });
  return out;
}

}  // namespace

// RMSNorm of x [T, H] (contiguous): float32 statistics, the normalised value rounded to the
// dtype before the weight multiplies it (Hugging Face's LlamaRMSNorm). x is not written.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor view = x;  // norm() writes x only when given a delta
  return norm(view, nullptr, weight, eps, "rms_norm");
}

// residual += delta (rounded to the dtype, as an eager add is), then RMSNorm of the new residual.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm(residual, &delta, weight, eps, "add_rms_norm_");
}

namespace {

#if defined(__AVX512F__)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const bf16_t* p, __mmask16 m) {
  return tandem_simd::widen16(_mm256_maskz_loadu_epi16(m, p));
}
inline void store16_masked(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16_masked(bf16_t* p, __m512 v, __mmask16 m) { tandem_simd::store16_rounded(p, v, m); }
inline void store16(bf16_t* p, __m512 v) { tandem_simd::store16_rounded(p, v, 0xffff); }

// silu(gate) * up of a row's columns, 16 at a time; returns how many were done (all, on AVX-512).
template <typename T>
int64_t silu_mul_vec(const T* gate, const T* up, int64_t I, T* o) {
  for (int64_t c = 0; c < I; c += LANES) {  // the last vector masked: every column through exp16 alike
    const __mmask16 m = I - c >= LANES ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (I - c)) - 1);
    const __m512 g = load16_masked(gate + c, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), T{});
    store16_masked(o + c, _mm512_mul_ps(silu, load16_masked(up + c, m)), m);
  }
  return I;
}

// Rotate-half RoPE of one head's leading multiple of 16 pairs, rounding where the scalar loop does (each
// product, then their sum); returns how many pairs were done.
template <typename T>
int64_t rope_vec(T* x, const T* c, const T* s, int64_t half) {
  int64_t j = 0;
  for (; j + LANES <= half; j += LANES) {
    const __m512 x1 = load16(x + j), x2 = load16(x + j + half);
    const __m512 a1 = round16(_mm512_mul_ps(x1, load16(c + j)), T{});
    const __m512 b1 = round16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(s + j)), T{});
    const __m512 a2 = round16(_mm512_mul_ps(x2, load16(c + j + half)), T{});
    const __m512 b2 = round16(_mm512_mul_ps(x1, load16(s + j + half)), T{});
    store16(x + j, _mm512_add_ps(a1, b1));
    store16(x + j + half, _mm512_add_ps(a2, b2));
  }
  return j;
}
#else
#if defined(__AVX2__) && defined(__FMA__)
// silu_mul_vec on 8 lanes (silu_mul8, exp16's bits), as packed_linear_silu's AVX2 epilogue computes it; a
// last part-vector goes through a buffer, so every column takes the same path. Against glibc's expf one value at
// a time, 16 rows of the default model's 1,536 columns went 78.9 -> 18.7 us in bfloat16 (2-core Zen 3).
template <typename T>
int64_t silu_mul_vec(const T* gate, const T* up, int64_t I, T* o) {
  for (int64_t c = 0; c < I; c += 8) {
    __m256 g, u;
    if (I - c >= 8) {
      g = tandem_simd::load8(gate + c), u = tandem_simd::load8(up + c);
    } else {
      alignas(32) T gb[8] = {}, ub[8] = {};
      std::copy(gate + c, gate + I, gb);
      std::copy(up + c, up + I, ub);
      g = tandem_simd::load8(gb), u = tandem_simd::load8(ub);
    }
    tandem_simd::store8(o + c, tandem_simd::silu_mul8<T>(g, u), I - c);
  }
  return I;
}
#else
template <typename T>
int64_t silu_mul_vec(const T*, const T*, int64_t, T*) { return 0; }
#endif
template <typename T>
int64_t rope_vec(T*, const T*, const T*, int64_t) { return 0; }
#endif

}  // namespace

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I], SiLU rounded to the dtype first.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2I]");
  auto gu = gate_up.contiguous();
  const int64_t T_ = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T_, I}, gu.options());
  dispatch(gu, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = ptr<T>(gu);
    T* dst = mut_ptr<T>(out);
    at::parallel_for(0, T_, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        const T* gate = src + row * 2 * I;
        const T* up = gate + I;
        T* o = dst + row * I;
        int64_t c = silu_mul_vec(gate, up, I, o);
        for (; c < I; ++c) {
          const float g = to_float(gate[c]);
          o[c] = from_float<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[c]));
        }
      }
    });
  });
  return out;
}

#if defined(__AVX512F__)
// rope_ of one row's heads (half a head a multiple of 16, at most 64): the position's cos/sin loaded once for all
// of them, -sin kept negated (the product's sign flip is exact), each product rounded as the scalar loop does.
// The same bits as rope_vec per head, in 16 rows 5.1 -> 4.1 us, 1,024 rows 149 -> 83 (bfloat16, 2-core Zen 4).
template <typename T>
void rope_row(T* row, const T* c, const T* s, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, n = half / LANES;
  __m512 c1[4], c2[4], ns1[4], s2[4];
  for (int64_t k = 0; k < n; ++k) {
    c1[k] = load16(c + k * LANES), c2[k] = load16(c + half + k * LANES);
    ns1[k] = _mm512_sub_ps(_mm512_setzero_ps(), load16(s + k * LANES)), s2[k] = load16(s + half + k * LANES);
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x = row + h * head_dim;
    for (int64_t k = 0; k < n; ++k) {
      const __m512 x1 = load16(x + k * LANES), x2 = load16(x + half + k * LANES);
      const __m512 a1 = rnd(_mm512_mul_ps(x1, c1[k]), T{}), b1 = rnd(_mm512_mul_ps(x2, ns1[k]), T{});
      const __m512 a2 = rnd(_mm512_mul_ps(x2, c2[k]), T{}), b2 = rnd(_mm512_mul_ps(x1, s2[k]), T{});
      tandem_simd::store16(x + k * LANES, _mm512_add_ps(a1, b1), 0xffff);
      tandem_simd::store16(x + half + k * LANES, _mm512_add_ps(a2, b2), 0xffff);
    }
  }
}
#endif

// In place: rotate-half RoPE on the first `num_heads` heads (of `head_dim`) of every row of
// qkv [T, W] (rows may be strided), at positions [T], from cos/sin tables [max_len, head_dim].
void rope_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t head_dim) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= num_heads * head_dim, "rope_: qkv [T, W]");
  TORCH_CHECK(head_dim % 2 == 0 && cos.size(1) == head_dim && sin.size(1) == head_dim, "rope_: tables [L, head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type(), "rope_: tables");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T_ = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2, max_len = cos.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_len, "rope_: position out of range");
  dispatch(qkv, "rope_", [&](auto tag) {
    using T = decltype(tag);
    T* base = mut_ptr<T>(qkv);
    const T* cp = ptr<T>(cos);
    const T* sp = ptr<T>(sin);
#if defined(__AVX512F__)
    if (half % LANES == 0 && half <= 4 * LANES) {
      at::parallel_for(0, T_, 8, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          rope_row(base + t * stride, cp + pp[t] * head_dim, sp + pp[t] * head_dim, num_heads, head_dim);
      });
      return;
    }
#endif
    at::parallel_for(0, T_ * num_heads, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / num_heads, h = i % num_heads;
        T* x = base + t * stride + h * head_dim;
        const T* c = cp + pp[t] * head_dim;
        const T* s = sp + pp[t] * head_dim;
        for (int64_t j = rope_vec(x, c, s, half); j < half; ++j) {
          const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
          const float a1 = round_to<T>(x1 * to_float(c[j])), b1 = round_to<T>(-x2 * to_float(s[j]));
          const float a2 = round_to<T>(x2 * to_float(c[j + half])), b2 = round_to<T>(x1 * to_float(s[j + half]));
          x[j] = from_float<T>(a1 + b1);
          x[j + half] = from_float<T>(a2 + b2);
        }
      }
    });
  });
}

// The cache of one layer is [2, Hkv, slots, D]. Writes k and v [T, Hkv, D] (rows may be strided,
// heads contiguous) into slots [T].
void write_kv_(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  check_cpu(cache, "cache");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous(), "write_kv_: cache [2, Hkv, S, D]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == cache.size(1) && k.size(2) == cache.size(3),
              "write_kv_: k/v [T, Hkv, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv_: k/v heads must be contiguous");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(), "write_kv_: dtype");
  auto sl = slots.to(at::kLong).contiguous();
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2), S = cache.size(2);
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv_: slot out of range");
  const int64_t bytes = D * cache.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = cache.element_size();
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(dst + ((0 * H + h) * S + sp[t]) * bytes, kp + (t * k.stride(0) + h * D) * es, bytes);
      std::memcpy(dst + ((1 * H + h) * S + sp[t]) * bytes, vp + (t * v.stride(0) + h * D) * es, bytes);
    }
  }
}

namespace {


// The cache slot of a sequence's t-th token: a shift and a mask for the power-of-two block sizes the engine
// uses, two integer divisions otherwise.
inline int64_t slot_of(const int32_t* table, int64_t block_size, int64_t t) {
  if ((block_size & (block_size - 1)) == 0) {
    const int shift = __builtin_ctzll(static_cast<uint64_t>(block_size));
    return (static_cast<int64_t>(table[t >> shift]) << shift) | (t & (block_size - 1));
  }
  return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

// Split-K: the part [t0, t1) of one sequence's keys for the G query heads of one K/V head, unnormalised:
// m[g] the part's largest score, l[g] = sum of exp(score - m[g]), acc[g] = sum of exp(score - m[g]) v.
template <typename T>
void attend_part(const float* qf, int64_t G, int64_t D, const T* kc, const T* vc, const int32_t* table,
                 int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores, float* m, float* l,
                 float* acc) {
  const int64_t n = t1 - t0;  // > 0 (attend_range)
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slot_of(table, block_size, t);
    const T* krow = kc + slot * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float sc = 0.f;
#pragma omp simd reduction(+ : sc)
      for (int64_t d = 0; d < D; ++d) sc += qg[d] * to_float(krow[d]);
      scores[g * n + t - t0] = sc * scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    m[g] = *std::max_element(sg, sg + n);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (sg[i] = std::exp(sg[i] - m[g]));
    l[g] = sum;
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = slot_of(table, block_size, t);
    const T* vrow = vc + slot * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + t - t0];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(p, to_float(vrow[d]), a[d]);
    }
  }
}

// The head sizes the vector loops of decode attention serve (attend_part_vec); others take attend_part.
constexpr bool vector_head(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 128; }

// Whether scores16 multiplies q as it is (bfloat16 dot products) rather than q converted to float32: the one
// place that decides, which the caller also asks before converting q.
template <typename T>
constexpr bool scores_read_raw_q(int64_t D) {
  return std::is_same_v<T, bf16_t> && HAVE_DPBF16 && (D == 32 || D == 64 || D == 128);
}

// Whether the scores read q as float32 in pair order, each 16 columns' even elements and then their odd ones: the
// AVX2 kernel's order for bfloat16 keys (load_cols16).
template <typename T>
constexpr bool q_in_pair_order(int64_t D) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  return std::is_same_v<T, bf16_t> && vector_head(D);
#else
  return false;
#endif
}

// q's G * D values as float32 in pair order: per 16 columns the 8 even ones, then the 8 odd ones. Called only where
// q_in_pair_order holds (AVX2 builds, bfloat16, n a multiple of 16); elsewhere it has nothing to do.
template <typename T>
inline void q_pairs_to_float(const T* q, int64_t n, float* out) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, bf16_t>)
    for (int64_t c = 0; c < n; c += 16) {
      const tandem_simd::Pairs8 w = tandem_simd::widen_pairs8(q + c);
      _mm256_storeu_ps(out + c, w.even);
      _mm256_storeu_ps(out + c + 8, w.odd);
    }
#endif
}

// The task a thread runs next in decode attention: its keys [t0, t1) of K/V head rows `kc` / `vc`, through
// `table`. On AVX-512 its rows are fetched into L2 during the current task's scores, a share per 16 keys (not on
// AVX2: scores8).
template <typename T>
struct NextTask {
  const T* kc = nullptr;
  const T* vc = nullptr;
  const int32_t* table = nullptr;
  int64_t t0 = 0, t1 = 0;
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <typename T>
inline const T* slot_row(const T* cache, const int32_t* table, int64_t block_size, int64_t t, int64_t D) {
  return cache + slot_of(table, block_size, t) * D;
}

// A cache row's lines (or a run of rows', `D` elements in all) into L1 ahead of use: the rows of one sequence
// are short runs (a block's 16 rows of one head) that the hardware prefetcher ramps up on too late; without this
// decode attention reads its K/V at half the bandwidth that a streaming read gets.
// `Hint`: _MM_HINT_T1 for rows wanted later than the next few loads, into L2 only.
template <auto Hint = _MM_HINT_T0, typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + off, Hint);
}
constexpr int64_t VALUE_PREFETCH = 8;  // value rows ahead
#endif

#if defined(__AVX512F__)

// The scores of 16 keys (key j's row at row(j)) for the G query heads of head size D, stored where `valid` at
// out + g * n: each head's 16 dot products stay in vectors and one transpose-add (sum16) turns them into 16 scores,
// where a horizontal sum per key and head costs more than the dot product itself. bfloat16 with AVX512_BF16
// multiplies q and k 32 columns per instruction (products exact in float32); otherwise 16 at a time in float32.
template <typename T, int D, typename Row>
inline void score_heads16(const float* qf, const T* qraw, int64_t G, Row row, __mmask16 valid, __m512 sc,
                          float* out, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16_t>) {
      if (scores_read_raw_q<T>(D)) {
        for (int64_t c = 0; c < D; c += 32) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(qraw + g * D + c);
          for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(row(j) + c), qv);
        }
        _mm512_mask_storeu_ps(out + g * n, valid, _mm512_mul_ps(sum16(acc), sc));
        continue;
      }
    }
#endif
    for (int64_t c = 0; c < D; c += LANES) {
      const __m512 qv = _mm512_loadu_ps(qf + g * D + c);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(load16(row(j) + c), qv, acc[j]);
    }
    _mm512_mask_storeu_ps(out + g * n, valid, _mm512_mul_ps(sum16(acc), sc));
  }
}

// Scores of keys [t0, t1) for G query heads of head size D, 16 keys at a time (score_heads16). Where blocks hold
// whole sixteens (the engine's 16-token blocks), each 16 keys are one block's run of rows: one address and constant
// offsets, where 16 row pointers looked up one by one spilled registers in the dot-product loop (GCC 12 kept
// several on the stack and reloaded them, and one accumulator went through memory each pass); 30 layers' decode
// attention of 64 sequences of 160 keys, bfloat16, in-process A/B on a 2-core AMX Xeon: 16.7 -> 15.4 and
// 21.4 -> 17.6 ms (medians of 15), 16 of 600 keys 22.1 -> 19.5, float32 16 of 160 8.3 -> 7.6.
// The same keys' value rows (`vc`) are fetched into L2 as the scores go: the value pass reads them only after
// the softmax, and until then a task had one short stream in flight where it can have two. Over 30 layers'
// caches of 16 sequences (~160 keys), evicted between passes: 2.6 -> 2.0 ms, 64 sequences 10.7 -> 8.3.
// And the thread's next task (`next`, none for its last) is fetched into L2 whole, keys and values, a share with
// each 16 keys here: a task's compute (~1.5 us) is shorter than its rows' trip from memory, so with only the next
// 16 keys in flight the two added up rather than overlapped. Same caches on a 2-core Zen 4: 16 sequences 3.71 ->
// 2.68 ms, 64 sequences 17.8 -> 11.3, 16 of ~600 keys 15.8 -> 10.3 (float32, 16 of 160: 6.79 -> 4.83); the share
// doubled, done by the middle of the task, was slower (2.35 -> 2.44, 10.5 -> 11.0).
template <typename T, int D>
void scores16(const float* qf, const T* qraw, int64_t G, const T* kc, const T* vc, const int32_t* table,
              int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores, const NextTask<T>& next) {
  const int64_t n = t1 - t0;
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t groups = (n + 15) / 16, share = (next.t1 - next.t0 + groups - 1) / groups;  // next task's keys per group
  // Each 16 keys one run of a block's rows when blocks hold whole sixteens (t0 is a multiple of 16: PART_KEYS).
  const bool runs = block_size % 16 == 0 && t0 % 16 == 0;
  int64_t ahead = next.t0;
  for (int64_t t = t0; t < t1; t += 16) {
    for (const int64_t end = std::min(next.t1, ahead + share); ahead < end; ++ahead) {
      const T* row = slot_row(next.kc, next.table, block_size, ahead, D);
      prefetch_row<_MM_HINT_T1>(row, D);
      prefetch_row<_MM_HINT_T1>(next.vc + (row - next.kc), D);
    }
    const int cnt = static_cast<int>(std::min<int64_t>(16, t1 - t));
    const __mmask16 valid = static_cast<__mmask16>((1u << cnt) - 1);
    if (runs) {
      const T* base = slot_row(kc, table, block_size, t, D);
      if (t + 16 < t1)  // the next 16 keys' run, while these compute
        prefetch_row(slot_row(kc, table, block_size, t + 16, D), std::min<int64_t>(16, t1 - t - 16) * D);
      prefetch_row<_MM_HINT_T1>(vc + (base - kc), cnt * D);  // the same slots' value rows
      // rows past cnt lie in the same block: read, and masked out of the store
      score_heads16<T, D>(qf, qraw, G, [base](int j) { return base + j * D; }, valid, sc, scores + t - t0, n);
      continue;
    }
    const T* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = slot_row(kc, table, block_size, t + std::min(j, cnt - 1), D);
    for (int64_t j = t + 16; j < std::min(t + 32, t1); ++j)  // the next 16 keys' rows, while these compute
      prefetch_row(slot_row(kc, table, block_size, j, D), D);
    for (int j = 0; j < cnt; ++j) prefetch_row<_MM_HINT_T1>(vc + (rows[j] - kc), D);  // the same slot's value row
    score_heads16<T, D>(qf, qraw, G, [&rows](int j) { return rows[j]; }, valid, sc, scores + t - t0, n);
  }
}

// acc[g] = sum over keys of p[g][t] * v[t], for V vectors of 16 per row: up to 16 / V heads' sums kept in
// registers while each value row is loaded once for them (heads beyond that take another pass over the
// rows, which are in cache by then).
template <typename T, int V>
void values_regs(const float* scores, int64_t G, const T* vc, const int32_t* table, int64_t block_size,
                 int64_t t0, int64_t t1, float* acc) {
  constexpr int GM = 16 / V;
  const int64_t n = t1 - t0, D = V * LANES;
  for (int64_t g0 = 0; g0 < G; g0 += GM) {
    const int gn = static_cast<int>(std::min<int64_t>(GM, G - g0));
    __m512 a[GM][V];
    for (int g = 0; g < GM; ++g)
      for (int v = 0; v < V; ++v) a[g][v] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const T* vrow = slot_row(vc, table, block_size, t, D);
      if (t + VALUE_PREFETCH < t1) prefetch_row(slot_row(vc, table, block_size, t + VALUE_PREFETCH, D), D);
      __m512 row[V];
      for (int v = 0; v < V; ++v) row[v] = load16(vrow + v * LANES);
      for (int g = 0; g < GM; ++g) {
        if (g >= gn) break;
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * n + t - t0]);
        for (int v = 0; v < V; ++v) a[g][v] = _mm512_fmadd_ps(p, row[v], a[g][v]);
      }
    }
    for (int g = 0; g < gn; ++g)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (g0 + g) * D + v * LANES, a[g][v]);
  }
}

// attend_part on 16 lanes, for head sizes of 16, 32, 64 or 128: keys 16 at a time (scores16), softmax
// exponentials 16 at a time, values into register accumulators (values_regs). Returns false for other
// head sizes, and the caller uses the portable loops.
template <typename T>
bool attend_part_vec(const float* qf, const T* qraw, int64_t G, int64_t D, const T* kc, const T* vc,
                     const int32_t* table, int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores,
                     float* m, float* l, float* acc, const NextTask<T>& next) {
  if (!vector_head(D)) return false;
  const int64_t n = t1 - t0;  // > 0 (attend_range)
  switch (D) {
    case 16: scores16<T, 16>(qf, qraw, G, kc, vc, table, block_size, t0, t1, scale, scores, next); break;
    case 32: scores16<T, 32>(qf, qraw, G, kc, vc, table, block_size, t0, t1, scale, scores, next); break;
    case 64: scores16<T, 64>(qf, qraw, G, kc, vc, table, block_size, t0, t1, scale, scores, next); break;
    default: scores16<T, 128>(qf, qraw, G, kc, vc, table, block_size, t0, t1, scale, scores, next); break;
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % LANES)) - 1);  // the last n % 16 keys
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    m[g] = tandem_simd::row_max(sg, n);
    const __m512 top = _mm512_set1_ps(m[g]);
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), top));
      _mm512_storeu_ps(sg + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + i), top));
      _mm512_mask_storeu_ps(sg + i, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    l[g] = _mm512_reduce_add_ps(sum);
  }
  switch (D / LANES) {
    case 1: values_regs<T, 1>(scores, G, vc, table, block_size, t0, t1, acc); break;
    case 2: values_regs<T, 2>(scores, G, vc, table, block_size, t0, t1, acc); break;
    case 4: values_regs<T, 4>(scores, G, vc, table, block_size, t0, t1, acc); break;
    default: values_regs<T, 8>(scores, G, vc, table, block_size, t0, t1, acc); break;
  }
  return true;
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA without AVX-512 (Zen 1-3, Intel's cores from Haswell to Alder Lake): attend_part on 8 lanes, in the
// AVX-512 kernel's order (keys 8 at a time, exponentials 8 at a time, values into register accumulators) with its
// fetches ahead of the keys and values, but not of the thread's next task (scores8 says why). bfloat16 rows are
// widened 16 values per load into the vectors of their even and of their odd elements (a shift and a mask, where
// widening 8 in order costs a shuffle each): the scores read q in that order (q_in_pair_order), the value sums are
// kept in it and put back in order as they are stored.
constexpr int64_t KEYS8 = 8;
using tandem_simd::lanes_below;

// 16 columns of a row as float32 vectors: in order for float32, as (even, odd) elements for bfloat16.
inline void load_cols16(const float* p, __m256* v) {
  v[0] = _mm256_loadu_ps(p);
  v[1] = _mm256_loadu_ps(p + 8);
}
inline void load_cols16(const bf16_t* p, __m256* v) {
  const tandem_simd::Pairs8 w = tandem_simd::widen_pairs8(p);
  v[0] = w.even;
  v[1] = w.odd;
}
// load_cols16's inverse for 16 float32 sums: bfloat16's (even, odd) vectors interleaved back into column order.
template <typename T>
inline void store_cols16(float* p, __m256 a, __m256 b) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
    a = _mm256_permute2f128_ps(lo, hi, 0x20);
    b = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  _mm256_storeu_ps(p, a);
  _mm256_storeu_ps(p + 8, b);
}

// Scores of 4 keys (`rows`, the first `live` of them stored) for GH query heads: each key's 16 columns loaded and
// widened once for all GH heads, whose q vectors are read from L1 by the FMAs; 4 x GH sums in registers, reduced
// 4 at a time by one transpose-add per head. Per 16 columns and 4 keys of 3 heads, 12 loads and widenings and 24
// FMAs, where a head at a time (8 keys a pass) widened every key again for each head.
template <typename T, int GH>
inline void scores4(const float* qg, int64_t D, int64_t n, const T* const* rows, int live, float scale, float* out) {
  __m256 acc[GH][4];
#pragma GCC unroll 16
  for (int g = 0; g < GH; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
#pragma GCC unroll 16
    for (int j = 0; j < 4; ++j) {
      __m256 k[2];
      load_cols16(rows[j] + c, k);
#pragma GCC unroll 16
      for (int g = 0; g < GH; ++g)
        acc[g][j] = _mm256_fmadd_ps(k[1], _mm256_loadu_ps(qg + g * D + c + 8),
                                    _mm256_fmadd_ps(k[0], _mm256_loadu_ps(qg + g * D + c), acc[g][j]));
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GH; ++g) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    const __m128 s = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)), _mm_set1_ps(scale));
    if (live == 4) {
      _mm_storeu_ps(out + g * n, s);
    } else {
      float lanes[4];
      _mm_storeu_ps(lanes, s);
      std::copy(lanes, lanes + live, out + g * n);
    }
  }
}

// scores16 on 8 lanes, whose scores scores4 computes 4 keys by 3 heads at a time: the next 8 keys into L1 and the
// value rows of these into L2 as each 8 go by, but not the thread's next task. That fetch (a share of its rows with
// each group of keys) paid on Zen 4's AVX-512 kernel; on a 2-core Zen 3, where this kernel is the native one, the
// attention of engine decode steps ran faster without it, alternated in one process: 16 sequences float32
// 0.367 -> 0.302 ms a layer, bfloat16 0.197 -> 0.180, 64 sequences float32 1.175 -> 1.080.
template <typename T>
void scores8(const float* qf, int64_t G, int64_t D, const T* kc, const T* vc, const int32_t* table,
             int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores) {
  const int64_t n = t1 - t0;
  const T* rows[KEYS8];
  for (int64_t t = t0; t < t1; t += KEYS8) {
    const int cnt = static_cast<int>(std::min<int64_t>(KEYS8, t1 - t));
    for (int j = 0; j < KEYS8; ++j) rows[j] = slot_row(kc, table, block_size, t + std::min(j, cnt - 1), D);
    for (int64_t j = t + KEYS8; j < std::min(t + 2 * KEYS8, t1); ++j)
      prefetch_row(slot_row(kc, table, block_size, j, D), D);
    for (int j = 0; j < cnt; ++j) prefetch_row<_MM_HINT_T1>(vc + (rows[j] - kc), D);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      const float* qg = qf + g0 * D;
      float* out = scores + g0 * n + t - t0;
      for (int half = 0; half < 2; ++half) {
        const int live = std::min(4, cnt - 4 * half);
        if (live <= 0) break;
        switch (std::min<int64_t>(3, G - g0)) {
          case 1: scores4<T, 1>(qg, D, n, rows + 4 * half, live, scale, out + 4 * half); break;
          case 2: scores4<T, 2>(qg, D, n, rows + 4 * half, live, scale, out + 4 * half); break;
          default: scores4<T, 3>(qg, D, n, rows + 4 * half, live, scale, out + 4 * half); break;
        }
      }
    }
  }
}

// values_regs on 8 lanes for GN query heads and the columns [c0, c0 + 8 NV): their sums in GN x NV registers (at
// most 12). GN is a constant and the loops over the array are unrolled by pragma, or GCC 12 keeps the sums in
// registers and still stores every one of them to the stack on every key (1.6x slower on a 2-core Zen 4).
// Each key's row is taken 16 columns at a time for all GN heads (12 sums, 2 row vectors, a weight and bfloat16's
// mask: the 16 registers). The weights are broadcast again for each 16 columns, from a pointer an empty asm hides:
// GCC would otherwise keep all GN of them live across the row and spill two sums, a store and a reload on every key.
// `fetch`: bring the next rows in as the pass goes.
template <typename T, int NV, int GN>
void values8_pass(const float* scores, int64_t n, int64_t D, const T* vc, const int32_t* table, int64_t block_size,
                  int64_t t0, int64_t t1, int64_t c0, bool fetch, float* acc) {
  __m256 a[GN][NV];
#pragma GCC unroll 16
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) a[g][v] = _mm256_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    const T* vrow = slot_row(vc, table, block_size, t, D) + c0;
    if (fetch && t + VALUE_PREFETCH < t1) prefetch_row(slot_row(vc, table, block_size, t + VALUE_PREFETCH, D), D);
#pragma GCC unroll 16
    for (int v = 0; v < NV; v += 2) {
      __m256 row[2];
      load_cols16(vrow + v * 8, row);
      const float* ps = scores + t - t0;
      asm volatile("" : "+r"(ps));
#pragma GCC unroll 16
      for (int g = 0; g < GN; ++g) {
        const __m256 p = _mm256_broadcast_ss(ps + g * n);
        a[g][v] = _mm256_fmadd_ps(p, row[0], a[g][v]);
        a[g][v + 1] = _mm256_fmadd_ps(p, row[1], a[g][v + 1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 16
    for (int v = 0; v < NV; v += 2) store_cols16<T>(acc + g * D + c0 + v * 8, a[g][v], a[g][v + 1]);
}

// values8_pass for the gn <= GN heads at `scores`: GN a constant, chosen down from the most that fit.
template <typename T, int NV, int GN>
void values8_heads(int64_t gn, const float* scores, int64_t n, int64_t D, const T* vc, const int32_t* table,
                   int64_t block_size, int64_t t0, int64_t t1, int64_t c0, bool fetch, float* acc) {
  if constexpr (GN > 1)
    if (gn < GN) return values8_heads<T, NV, GN - 1>(gn, scores, n, D, vc, table, block_size, t0, t1, c0, fetch, acc);
  values8_pass<T, NV, GN>(scores, n, D, vc, table, block_size, t0, t1, c0, fetch, acc);
}

// All G heads' value sums: the columns 32 at a time (16 for D = 16), up to 12 / NV heads a pass; each column
// range's passes read their own part of the value rows, so together they read each row once.
template <typename T, int NV>
void values8(const float* scores, int64_t G, int64_t D, const T* vc, const int32_t* table, int64_t block_size,
             int64_t t0, int64_t t1, float* acc) {
  constexpr int GM = 12 / NV;
  const int64_t n = t1 - t0;
  for (int64_t c0 = 0; c0 < D; c0 += NV * 8)
    for (int64_t g0 = 0; g0 < G; g0 += GM)  // the first pass brings the rows in
      values8_heads<T, NV, GM>(std::min<int64_t>(GM, G - g0), scores + g0 * n, n, D, vc, table, block_size, t0, t1,
                               c0, c0 == 0 && g0 == 0, acc + g0 * D);
}

template <typename T>
bool attend_part_vec(const float* qf, const T*, int64_t G, int64_t D, const T* kc, const T* vc,
                     const int32_t* table, int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores,
                     float* m, float* l, float* acc, const NextTask<T>&) {
  if (!vector_head(D)) return false;
  const int64_t n = t1 - t0;  // > 0 (attend_range)
  scores8<T>(qf, G, D, kc, vc, table, block_size, t0, t1, scale, scores);
  const __m256i tail = lanes_below(n % 8);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    m[g] = tandem_simd::row_max8(sg, n);
    const __m256 top = _mm256_set1_ps(m[g]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = tandem_simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), top));
      _mm256_storeu_ps(sg + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {  // masked-off lanes load 0, and their exponentials are masked out of the sum
      const __m256 e = _mm256_and_ps(tandem_simd::exp8(_mm256_sub_ps(_mm256_maskload_ps(sg + i, tail), top)),
                                     _mm256_castsi256_ps(tail));
      _mm256_maskstore_ps(sg + i, tail, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[g] = tandem_simd::sum8(sum);
  }
  if (D == 16)
    values8<T, 2>(scores, G, D, vc, table, block_size, t0, t1, acc);
  else
    values8<T, 4>(scores, G, D, vc, table, block_size, t0, t1, acc);
  return true;
}
#else
template <typename T>
bool attend_part_vec(const float*, const T*, int64_t, int64_t, const T*, const T*, const int32_t*, int64_t,
                     int64_t, int64_t, float, float*, float*, float*, float*, const NextTask<T>&) {
  return false;
}
#endif

// The part [t0, t1) with the fastest loops this build has.
template <typename T>
void attend_range(const float* qf, const T* qraw, int64_t G, int64_t D, const T* kc, const T* vc,
                  const int32_t* table, int64_t block_size, int64_t t0, int64_t t1, float scale, float* scores,
                  float* m, float* l, float* acc, const NextTask<T>& next) {
  if (t1 <= t0) {  // an empty part: nothing to add, and a maximum no other part's loses to
    std::fill(acc, acc + G * D, 0.f);
    std::fill(m, m + G, -INFINITY);
    std::fill(l, l + G, 0.f);
    return;
  }
  if (!attend_part_vec<T>(qf, qraw, G, D, kc, vc, table, block_size, t0, t1, scale, scores, m, l, acc, next))
    attend_part<T>(qf, G, D, kc, vc, table, block_size, t0, t1, scale, scores, m, l, acc);
}

// Keys per part of a sequence in decode attention: a 1,024-token context is 4 parts per K/V head, 12 tasks for
// 3 heads, which 2 threads share evenly; parts are merged by their maxima and sums (split-K).
constexpr int64_t PART_KEYS = 256;

}  // namespace

// One query token per sequence: q [B, Hq, D] (rows may be strided), cache [2, Hkv, slots, D],
// block_table [B, max_blocks] int32, context_lens [B] int32 -> [B, Hq * D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size, double scale) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode_attention: q [B, Hq, D]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous() && cache.size(3) == q.size(2),
              "paged_decode_attention: cache [2, Hkv, slots, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_decode_attention: q and cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: int32 block_table and context_lens");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = cache.size(1), S = cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0, "paged_decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(block_table.size(0) == B && context_lens.size(0) == B, "paged_decode_attention: batch mismatch");
  auto table = block_table.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t max_blocks = table.size(1), G = Hq / Hkv, q_stride = q.stride(0);
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && (lp[b] + block_size - 1) / block_size <= max_blocks, "paged_decode_attention: context length");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && (tp[b * max_blocks + i] + 1) * block_size <= S,
                  "paged_decode_attention: block id out of range");
  }
  auto out = at::empty({B, Hq * D}, q.options());
  dispatch(q, "paged_decode_attention", [&](auto tag) {
    using T = decltype(tag);
    const T* qp = ptr<T>(q);
    const T* kp = ptr<T>(cache);
    const T* vp = kp + Hkv * S * D;
    T* op = mut_ptr<T>(out);
    // Tasks: (sequence, K/V head, part of PART_KEYS keys). Parts depend on the sequence's length only, so a
    // sequence's result is the same in any batch; one long sequence still spreads over the threads.
    std::vector<int64_t> first(B + 1, 0);  // the first task of each sequence
    for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + Hkv * ((lp[b] + PART_KEYS - 1) / PART_KEYS);
    const int64_t tasks = first[B];
    std::vector<int64_t> seq_of(tasks);
    for (int64_t b = 0; b < B; ++b) std::fill(seq_of.begin() + first[b], seq_of.begin() + first[b + 1], b);
    // Per task: its heads' maxima, sums and unnormalised outputs (uninitialised: every task writes its own).
    std::unique_ptr<float[]> m(new float[tasks * G]), l(new float[tasks * G]), acc(new float[tasks * G * D]);
    const auto write = [&](int64_t b, int64_t h, int64_t g, const float* o, float total) {
      T* dst = op + b * Hq * D + (h * G + g) * D;
      int64_t d = 0;
#if defined(__AVX512F__)
      const __m512 sum = _mm512_set1_ps(total);
      for (; d + LANES <= D; d += LANES) store16(dst + d, _mm512_div_ps(_mm512_loadu_ps(o + d), sum));
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 sum = _mm256_set1_ps(total);
      for (; d + 8 <= D; d += 8) tandem_simd::store8(dst + d, _mm256_div_ps(_mm256_loadu_ps(o + d), sum));
#endif
      for (; d < D; ++d) dst[d] = from_float<T>(o[d] / total);
    };
    const bool q_as_is = scores_read_raw_q<T>(D);  // else every path reads q in float32
    const bool q_pairs = q_in_pair_order<T>(D);
    // Task i's keys: its sequence, K/V head and key range. The loop below writes the same arithmetic out again for
    // its own task: running it through this lambda measured 8-16% slower (docs/benchmarks.md, fifth pass).
    const auto task = [&](int64_t i) {
      const int64_t b = seq_of[i], parts = (first[b + 1] - first[b]) / Hkv, k = i - first[b];
      const int64_t t0 = k % parts * PART_KEYS;
      return NextTask<T>{kp + k / parts * S * D, vp + k / parts * S * D, tp + b * max_blocks, t0,
                         std::min<int64_t>(lp[b], t0 + PART_KEYS)};
    };
    at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores(G * PART_KEYS), qf(G * D);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = seq_of[i], parts = (first[b + 1] - first[b]) / Hkv, k = i - first[b];
        const int64_t h = k / parts, t0 = k % parts * PART_KEYS, t1 = std::min<int64_t>(lp[b], t0 + PART_KEYS);
        const T* qh = qp + b * q_stride + h * G * D;
        const NextTask<T> next = i + 1 < i1 ? task(i + 1) : NextTask<T>{};
        if (q_pairs)
          q_pairs_to_float(qh, G * D, qf.data());
        else if (!q_as_is)
          for (int64_t j = 0; j < G * D; ++j) qf[j] = to_float(qh[j]);
        float* a = &acc[i * G * D];
        attend_range<T>(qf.data(), qh, G, D, kp + h * S * D, vp + h * S * D, tp + b * max_blocks, block_size, t0, t1,
                        static_cast<float>(scale), scores.data(), &m[i * G], &l[i * G], a, next);
        if (parts == 1)  // the whole sequence: normalise here, nothing to merge
          for (int64_t g = 0; g < G; ++g) write(b, h, g, a + g * D, l[i * G + g]);
      }
    });
    if (tasks == B * Hkv) return;  // every sequence in one part, normalised in its task: nothing to merge
    at::parallel_for(0, B * Hkv * G, 16, [&](int64_t i0, int64_t i1) {  // merge the parts of each query head
      std::vector<float> o(D);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = i % G, h = i / G % Hkv, b = i / G / Hkv, parts = (first[b + 1] - first[b]) / Hkv;
        if (parts == 1) continue;
        const int64_t task0 = first[b] + h * parts;
        float mx = -INFINITY, total = 0.f;
        for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, m[(task0 + p) * G + g]);
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t at = (task0 + p) * G + g;
          const float w = std::exp(m[at] - mx);
          total += w * l[at];
          for (int64_t d = 0; d < D; ++d) o[d] += w * acc[at * D + d];
        }
        write(b, h, g, o.data(), total);
      }
    });
  });
  return out;
}

// `nbytes` (rounded up to whole 2 MiB pages) of uninitialised memory, 2 MiB-aligned and marked for transparent huge
// pages, as a uint8 tensor that frees it. Where the kernel grants them ("madvise" or "always" mode), each 2 MiB is
// one TLB entry instead of 512: the packed weights and the KV cache are read in runs of a few KB scattered over
// hundreds of MB, and on a 2-core Zen 4 a pass over the default model's matrices at 16 rows ran 12.7-13.0 ms on
// 4 KiB pages against 11.5-11.6 on 2 MiB pages, decode attention over 30 layers' caches 2.9 against 2.4-2.6.
// Fresh pages from mmap, never from the heap: memory the heap hands back may already be faulted in as 4 KiB pages,
// which the advice does not turn into huge ones.
at::Tensor huge_page_buffer(int64_t nbytes) {
  constexpr size_t PAGE = size_t(2) << 20;
  TORCH_CHECK(nbytes >= 0, "huge_page_buffer: a negative size");
  const size_t size = std::max(PAGE, (static_cast<size_t>(nbytes) + PAGE - 1) / PAGE * PAGE);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t span = size + PAGE;  // room to align the start, the rest unmapped
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "huge_page_buffer: out of memory");
  char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + PAGE - 1) & ~uintptr_t(PAGE - 1));
  const size_t head = static_cast<size_t>(start - static_cast<char*>(raw));
  if (head) munmap(raw, head);
  if (span - head - size) munmap(start + size, span - head - size);
  madvise(start, size, MADV_HUGEPAGE);  // advice only: without huge pages it is plain memory
  return at::from_blob(start, {static_cast<int64_t>(size)}, [size](void* p) { munmap(p, size); }, at::kByte);
#else
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, PAGE, size) == 0, "huge_page_buffer: out of memory");
  return at::from_blob(p, {static_cast<int64_t>(size)}, [](void* q) { std::free(q); }, at::kByte);
#endif
}
