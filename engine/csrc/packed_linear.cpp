// Linear layers on weights repacked once at load into column panels, for a register-blocked
// micro-kernel with no reductions: y = x W^T (+ b).
//
// Why a second linear kernel: the row-streaming kernel of cpu_ops.cpp keeps one float32
// accumulator per (weight row, x row) pair and must sum each across its 16 lanes at the end; with
// K = 576 that reduction and the scattered stores cost about a quarter of a 16-64-row matmul, and
// each loaded x vector serves only 4 weight rows. Here a panel holds NR = 16 * NV output columns
// laid out k-major, so one vector load covers 16 columns at one k (one pair of k for bfloat16) and
// one broadcast of x[m][k] feeds NV vectors: an MR x NV block of accumulators (4 x 6 = 24 of the
// 32 registers) that needs no reduction and stores whole vectors. Decode's 16-128 rows become
// compute-bound on the dot-product units instead of on shuffles.
//
// Layouts (K_pad = K rounded up to the element step S: 2 for bfloat16, 1 for float32):
//   packed[panel][k / S][v][lane][s] = W[panel * NR + v * 16 + lane][k + s], zero past N and K.
// Each output's sum runs over k in the same order whatever M is or where its row falls in a
// tile, so a row's result does not depend on the batch it came in.
//
// On CPUs with AMX, bfloat16 runs on the tiles over these same panels (amx_panels below) wherever K is
// a whole number of 32-k chunks; the dot-product micro-kernel serves float32 and the rest. On CPUs without
// AVX512_BF16, bfloat16 pairs are widened in registers to float32 FMAs (widened_step). On CPUs with AVX2 and
// FMA but no AVX-512, an 8-lane micro-kernel reads the same panels (vector_sums, panel_sums, panels8).

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "simd_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// What a micro-tile writes: its outputs as they are, or (gate_up panels, see CpuKernels.prepare_gate_up)
// silu(gate) * up of the panel's two halves.
enum class Out { Plain, SiluMul };

using bf16_t = uint16_t;

constexpr int NV = 6;         // vectors of 16 output columns per panel
constexpr int NR = 16 * NV;   // output columns per panel
static_assert(NV % 2 == 0, "packed_linear_silu splits a panel's vectors into gate and up halves");
constexpr int MR = 4;         // rows of x per micro-tile
// Rows of x per pass over a panel: the panel (NR x K, 110-300 KB at the default model's K) stays
// in L2 while these rows go by, and is read from memory once.
constexpr int64_t M_BLOCK = 256;

int64_t step_of(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 2 : 1; }
template <typename T>
constexpr int64_t step_of_t = std::is_same_v<T, float> ? 1 : 2;

// What a thread fetches while it works on its last panel: its first panel of the layer that comes next.
struct Tail {
  const char* data = nullptr;
  int64_t bytes = 0;
};

// How the tiles of one panel share out the fetch of what comes after it: the next panel of the call, or on the
// last panel `tail`, `rate` / 256 lines per tick over `ticks` ticks in all (tandem_simd::PacedFetch). slice(i):
// where the fetch of a tile that starts after i ticks begins (null: nothing left, or nothing to fetch).
struct PanelFetch {
  const char* next = nullptr;
  int64_t lines = 0;
  int rate = 0;

  PanelFetch() = default;
  PanelFetch(const char* next_panel, int64_t panel_bytes, bool last, Tail tail, int64_t ticks)
      : next(last ? tail.data : next_panel), lines(((last ? tail.bytes : panel_bytes) + 63) / 64),
        rate(static_cast<int>((lines * 256 + ticks - 1) / ticks)) {}

  const char* slice(int64_t ticks_before) const {
    const char* at = next ? next + ticks_before * rate / 256 * 64 : nullptr;
    return at && at < next + lines * 64 ? at : nullptr;
  }
};

#if defined(__AVX512F__)
constexpr bool PACKED = true;

using tandem_simd::Step;

// bfloat16 runs on AVX512_BF16's dot products where the CPU has them, else widened (widened_step).
#if defined(__AVX512BF16__)
constexpr bool DOT_PRODUCTS_BF16 = true;
#else
constexpr bool DOT_PRODUCTS_BF16 = false;
#endif
bool widened_bf16 = false;  // widened even where vdpbf16ps is there (set_widened_bf16, for tests)

using tandem_simd::columns;
using tandem_simd::store16;

// An output of T x T products stored as Y: float32 outputs of bfloat16 inputs hold the bfloat16 rounding,
// the same values as a bfloat16 output read back as float32.
template <typename T, typename Y>
inline void store_out(Y* y, __m512 v, __mmask16 mask) {
  if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<Y, float>) {
    const __m512i bits = _mm512_cvtepu16_epi32(tandem_simd::to_bf16(v));
    v = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  }
  store16(y, v, mask);
}

// silu(gate) * up with the roundings of the unfused ops: the projection's outputs, the SiLU, the product.
template <typename T>
inline __m512 silu_mul16(__m512 gate, __m512 up) {
  using tandem_simd::round16;
  const __m512 g = round16(gate, T{}), u = round16(up, T{});
  const __m512 e = tandem_simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), T{}), u);
}

// One pair of k of R rows of x, widened to float32 beforehand, against a panel step of bfloat16 pairs, each weight
// vector widened once (WidenedStep's widening and order, so the same bits): written out because in Step's loop
// order GCC keeps all NV widened pairs live at once, 12 registers, and spills accumulators. Against that order
// on a 2-core Ice Lake Xeon, as a share of packed float32's rate in the same run: 0.97 / 0.87 / 0.95 at
// 64 / 256 / 1,024 rows against 0.67 / 0.75 / 0.71.
template <int R>
inline void widened_step(const float* x, int64_t K, const bf16_t* w, __m512 (&acc)[R][NV]) {
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const auto wv = tandem_simd::WidenedStep::widen(w + v * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r][v] = _mm512_fmadd_ps(wv.odd, _mm512_set1_ps(x[r * K + 1]), acc[r][v]);
      acc[r][v] = _mm512_fmadd_ps(wv.even, _mm512_set1_ps(x[r * K]), acc[r][v]);
    }
  }
}

// R rows of x against one panel: y[0..R) x [0, cols), `cols` < NR only in the last panel (< NR / 2 for
// Out::SiluMul, whose outputs are half the panel's columns).
// `next`: the slice of the next panel this tile fetches into L2 while it computes, `rate` / 256 cache lines
// per step (null: none). Without it a panel's first tile waits on memory and its other tiles on the
// multipliers, one after the other; with it the stream and the arithmetic overlap (16 rows: 15.6 -> 13.0
// ms for the default model's matrices, bfloat16, on a 2-core EPYC), paced evenly over the whole panel
// (tandem_simd::PacedFetch).
template <typename T, int R, typename Y, Out O, typename X = T>
inline void micro(const X* x, int64_t K, const T* panel, int64_t steps, const float* bias, int64_t cols, Y* y,
                  int64_t ldy, const char* next, int rate) {
  using St = Step<T>;
  // The loops over acc fully unrolled, the stores' column test inside: with `v * 16 < cols` in the loop bound
  // GCC kept acc as a stack array, zeroed by memset and copied in and out of registers around the k loop.
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const __m512 b = bias ? _mm512_maskz_loadu_ps(columns(cols - v * 16), bias + v * 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
  const T* w = panel;
  tandem_simd::PacedFetch<_MM_HINT_T2> fetch{next, rate};
  for (int64_t s = 0; s < steps; ++s, w += NR * St::S) {
    fetch.step();
    if constexpr (!std::is_same_v<X, T>) {
      widened_step<R>(x + s * 2, K, w, acc);
    } else {
      for (int r = 0; r < R; ++r) {
        const auto xv = St::bcast(x + r * K + s * St::S);
        for (int v = 0; v < NV; ++v) acc[r][v] = St::fma(acc[r][v], w + v * 16 * St::S, xv);
      }
    }
  }
  if constexpr (O == Out::SiluMul) {
#pragma GCC unroll 8
    for (int v = 0; v < NV / 2; ++v)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        if (v * 16 < cols)
          store_out<T>(y + r * ldy + v * 16, silu_mul16<T>(acc[r][v], acc[r][v + NV / 2]), columns(cols - v * 16));
  } else {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        if (v * 16 < cols) store_out<T>(y + r * ldy + v * 16, acc[r][v], columns(cols - v * 16));
  }
}

// Rows [m0, m1) of x against panels [p0, p1): each panel is read from memory once and meets the rows from L2 in
// tiles of at most MR rows, as even as the rows allow (9 rows: 3, 3, 3; engine decode steps on a 2-core Zen 4
// against tiles of MR and the rest: batch 5 18.37 -> 14.95 ms float32 and 10.01 -> 8.43 bfloat16, batch 9 23.28 ->
// 19.43 and 12.57 -> 10.32, batch 17 36.41 -> 33.19 and 18.01 -> 16.60; batch 6-7 float32 18.02 -> 14.84 and
// level, bfloat16 level). The tiles of one panel share out the prefetch of the next, and those of the last panel the
// prefetch of `tail`. Not for one tile (up to MR rows), whose pass reads the panel front to back as the hardware's
// stream prefetch follows, where each software fetch holds a line-fill buffer until its line arrives: engine decode
// steps on a 2-core Zen 4, alternated with fetching from 3 rows, batch 3 14.96 -> 12.12 ms float32 and 10.30 ->
// 9.12 bfloat16, batch 4 14.72 -> 11.96 and 9.75 -> 7.31 (a Zen 5 measured the two level at batch 4). From two
// tiles the fetch pays (batch 8 without it: 17.83 -> 19.32 ms float32, 10.02 -> 10.63 bfloat16).
template <typename T, typename Y, Out O, typename X = T>
void panels(const X* x, int64_t K, int64_t m0, int64_t m1, const T* packed, int64_t steps, int64_t p0, int64_t p1,
            const float* bias, int64_t N, Y* y, Tail tail) {
  constexpr int64_t width = O == Out::SiluMul ? NR / 2 : NR;  // outputs per panel; N counts outputs
  const int64_t panel_size = steps * NR * Step<T>::S;
  const int64_t rows = m1 - m0, tiles = (rows + MR - 1) / MR;
  const bool fetch = tiles > 1;
  for (int64_t p = p0; p < p1; ++p) {
    const T* panel = packed + p * panel_size;
    const PanelFetch ahead = fetch ? PanelFetch(reinterpret_cast<const char*>(panel + panel_size),
                                                panel_size * int64_t(sizeof(T)), p + 1 == p1, tail, tiles * steps)
                                   : PanelFetch();
    const int rate = ahead.rate;
    const int64_t n0 = p * width, cols = std::min<int64_t>(width, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * rows / tiles, r1 = (t + 1) * rows / tiles;
      const char* pf = ahead.slice(t * steps);
      const X* xm = x + (m0 + r0) * K;
      Y* ym = y + (m0 + r0) * N + n0;
      switch (r1 - r0) {
        case 1: micro<T, 1, Y, O, X>(xm, K, panel, steps, b, cols, ym, N, pf, rate); break;
        case 2: micro<T, 2, Y, O, X>(xm, K, panel, steps, b, cols, ym, N, pf, rate); break;
        case 3: micro<T, 3, Y, O, X>(xm, K, panel, steps, b, cols, ym, N, pf, rate); break;
        default: micro<T, MR, Y, O, X>(xm, K, panel, steps, b, cols, ym, N, pf, rate); break;
      }
    }
  }
}

#if defined(TANDEM_AMX)
// bfloat16 on AMX tiles, over the same panels. The dot-product kernel above keeps two cores' vdpbf16ps busy
// at 16 rows and is compute-bound from there (its 64-row pass over the default model's matrices costs several
// times the weights' read); one TDPBF16PS does a 16 x 16 x 32 block, 16 times the work per instruction, so a
// panel costs its read from memory at any decode batch. oneDNN's own AMX GEMM, which the plain layout would
// need, ran 106 GFLOP/s at 16 rows and 341 at 64 (step profile on a 2-core Xeon with AMX).
//
// A panel's k-major layout is already the tiles' B layout: at each pair of k its 16-column vectors are rows
// of 64 bytes (16 columns x 2 k), so 16 pairs of one vector are a 16-row B tile with a stride of one panel
// step. Blocks of up to 32 rows of x run through tandem_amx::matmul_2x2, three pairs of vectors per panel: two
// B tiles in flight (a first version kept all six vectors' sums in tiles with one B tile, loaded only after the
// last product had read it: 19.3-20.4 ms against 16.7-17.0 at one row over the default model's matrices).
constexpr int KC = 32;  // k per tile step

// The block's sums out through the same stores (and SiLU) as the dot-product kernel's accumulators.
template <typename Y, Out O>
inline void amx_store(const float* acc, int rows, const float* bias, int64_t cols, Y* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r, acc += NR, y += ldy) {
    if constexpr (O == Out::SiluMul) {
      for (int v = 0; v < NV / 2 && v * 16 < cols; ++v)
        store_out<bf16_t>(y + v * 16, silu_mul16<bf16_t>(_mm512_load_ps(acc + v * 16),
                                                         _mm512_load_ps(acc + (v + NV / 2) * 16)),
                          columns(cols - v * 16));
    } else {
      for (int v = 0; v < NV && v * 16 < cols; ++v) {
        const __mmask16 mask = columns(cols - v * 16);
        __m512 a = _mm512_load_ps(acc + v * 16);
        if (bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, bias + v * 16));
        store_out<bf16_t>(y + v * 16, a, mask);
      }
    }
  }
}

// panels() for the tiles: rows [m0, m1) of x against panels [p0, p1), 32 rows at a time; the blocks of each
// panel share out the fetch of the next panel (or `tail`), paced over every chunk of every pair of vectors
// (it used to go out in whole lines per chunk during the first block's first pair: 64 rows 23.4 -> 21.4 ms,
// 16 rows 13.4 -> 12.7, means of six in-process pairs on a 2-core AMX Xeon). Each tile op runs a 16 x 16 x 32
// block in one order, so a row's sums do not depend on M or on where the row falls: batch invariance holds here.
template <typename Y, Out O>
void amx_panels(const bf16_t* x, int64_t K, int64_t m0, int64_t m1, const bf16_t* packed, int64_t steps,
                int64_t p0, int64_t p1, const float* bias, int64_t N, Y* y, Tail tail) {
  constexpr int64_t width = O == Out::SiluMul ? NR / 2 : NR;
  const int64_t panel_size = steps * NR * 2, chunks = steps * 2 / KC, blocks = (m1 - m0 + 31) / 32;
  alignas(64) float acc[32 * NR];
  int configured = 0;
  for (int64_t p = p0; p < p1; ++p) {
    const bf16_t* panel = packed + p * panel_size;
    const PanelFetch ahead(reinterpret_cast<const char*>(panel + panel_size), panel_size * 2, p + 1 == p1, tail,
                           blocks * chunks * (NV / 2));
    const int rate = ahead.rate;
    const int64_t n0 = p * width, cols = std::min<int64_t>(width, N - n0);
    for (int64_t m = m0, b = 0; m < m1; m += 32, ++b) {
      const int rows = static_cast<int>(std::min<int64_t>(32, m1 - m));
      if (rows != configured) tandem_amx::configure_2x2(configured = rows);
      const char* pf = ahead.slice(b * chunks * (NV / 2));  // this block's share
      tandem_amx::matmul_2x2(x + m * K, K * 2, rows, panel, NR * 4, KC / 2 * NR * 2, chunks, NV / 2, acc, NR * 4, pf,
                             rate);
      amx_store<Y, O>(acc, rows, bias ? bias + n0 : nullptr, cols, y + m * N + n0, N);
    }
  }
  _tile_release();
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA without AVX-512 (Zen 1-3; Intel's cores from Haswell to Alder Lake): the same panels, 8 lanes a
// vector. A pass runs R <= 6 rows of x against one 16-column vector of a panel (two 8-lane halves) over all of k:
// 2R accumulators, the two halves' weights and a broadcast fit the 16 registers. Two FMAs a cycle at a latency of
// four want 8 sums in flight; 4 rows (8 accumulators) left none to spare, and on a 2-core Zen 3 one core ran float32
// at 61% of its FMA rate, 6 rows at 97% (bfloat16 83% -> 92%). bfloat16 is widened as WidenedStep does (odd element
// by a mask, even by a shift; odd FMA first), from x widened once per call. The sums go through a
// buffer to the epilogue, 8 outputs a vector: the bias is each sum's first term, as on AVX-512; the rounding and the
// SiLU (exp8_any, exp16's bits) are the AVX-512 epilogue's on 8 lanes.
constexpr bool PACKED = true;
constexpr int MR8 = 6;  // rows of x per pass, at most
// Up to this many rows, each row goes through the panel front to back on its own (panel_sums), the first from
// memory and the second from L2. A 2-row tile's vector passes, without the paced fetch, read the panel in six
// interleaved strides that the hardware's stream prefetch does not follow: engine decode steps of the default model
// at batch 2, x86-64-v3 build on a 2-core Zen 4, alternated with the tiles' build, 28.4 -> 13.4 ms in float32 and
// 19.0 -> 8.8 in bfloat16 (batch 1: ~9). At batch 3 the tiles with the fetch win (14.1 against 15.6 ms float32,
// 9.3 against 11.3 bfloat16), though over the matrices back to back rows one at a time measured faster there too.
constexpr int64_t ROWWISE = 2;
// k steps a turn of vector_sums' loop (see there).
constexpr int UNROLL = 4;

// One k step (one pair of k for bfloat16) of vector_sums: R rows' sums of the 16 columns at w.
template <typename T, int R>
__attribute__((always_inline)) inline void vector_step(const float* x, int64_t K, int64_t s, const T* w,
                                                       __m256 (&acc)[R][2]) {
  if constexpr (std::is_same_v<T, float>) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + s);
      acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
    }
  } else {
    const __m256i* pairs = reinterpret_cast<const __m256i*>(w);
    const float* xs = x + 2 * s;  // row r's pair at xs[r * K]
    __m256 wv[2];
    // The odd elements by a mask, which ran faster than two shifts in its place (one core, 64 rows: 92% of the FMA
    // rate against 87%).
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) wv[h] = tandem_simd::pairs_odd8(_mm256_loadu_si256(pairs + h));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xo = _mm256_broadcast_ss(xs + r * K + 1);
      acc[r][0] = _mm256_fmadd_ps(wv[0], xo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(wv[1], xo, acc[r][1]);
    }
    // The even half's broadcasts wait for the odd half's last FMA: GCC otherwise hoists them above the odd
    // FMAs, runs out of registers and spills accumulators (6 rows: 66% of one core's FMA rate, 88% without).
    asm("" : "+r"(xs) : "x"(acc[R - 1][1]));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) wv[h] = tandem_simd::pairs_even8(_mm256_loadu_si256(pairs + h));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(xs + r * K);
      acc[r][0] = _mm256_fmadd_ps(wv[0], xe, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(wv[1], xe, acc[r][1]);
    }
  }
}

// R rows of x (float32, row stride K) against one 16-column vector of a panel, `w` at its first step: the 16
// sums of each row to out[r * NR, +16), starting from init[16]. Not inlined: compiled on its own, GCC keeps all 12
// accumulators in registers, where inlined into the epilogue's caller it spilled some of them to the stack.
// UNROLL steps a turn of the loop, and the fetch's count once a turn: a step of 5 rows is 10 FMAs among some 27
// instructions, more than a Zen 3 core issues in the FMAs' 5 cycles, so the loop's own counting and the fetch's
// check, once a step, held the 5-row tiles to ~80% of the 6-row tiles' rate a row. Engine decode steps at batch 16
// (tiles 5, 5, 6), 2-core Zen 3, alternated with the loop a step a turn: float32 63.7 -> 52.9 ms (two steps a
// turn: 56.8), bfloat16 41.7 -> 39.2; perf: the 5-row tiles' share 24.7% -> 19.3%, the 6-row tile's level.
template <typename T, int R>
__attribute__((noinline)) void vector_sums(const float* x, int64_t K, const T* w, int64_t steps, const float* init,
                                           float* out, tandem_simd::PacedFetch<_MM_HINT_T2>& paced) {
  constexpr int64_t stride = NR * step_of_t<T>;
  tandem_simd::PacedFetch<_MM_HINT_T2> fetch = paced;  // in registers for the loop
  __m256 acc[R][2];
  const __m256 lo = _mm256_loadu_ps(init), hi = _mm256_loadu_ps(init + 8);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = lo, acc[r][1] = hi;
  int64_t s = 0;
  for (; s + UNROLL <= steps; s += UNROLL, w += UNROLL * stride) {
    fetch.step(UNROLL);
#pragma GCC unroll UNROLL
    for (int u = 0; u < UNROLL; ++u) vector_step<T, R>(x, K, s + u, w + u * stride, acc);
  }
  for (; s < steps; ++s, w += stride) {
    fetch.step();
    vector_step<T, R>(x, K, s, w, acc);
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * NR, acc[r][0]);
    _mm256_storeu_ps(out + r * NR + 8, acc[r][1]);
  }
  paced = fetch;
}

// One row of x against a whole panel, all NV vectors at each k step: the panel read front to back, as the
// streaming kernel reads a matrix. (Vector by vector, one row's passes stride over the panel six times, which
// a single stream from memory does not hide: 25.2 against 21.3 ms for the default model's bfloat16 matrices at
// one row.) The same sums in the same order as vector_sums, so a row's bits do not depend on its batch.
template <typename T>
inline void panel_sums(const float* x, const T* w, int64_t steps, const float* init, float* out) {
  __m256 acc[NV * 2];
  for (int i = 0; i < NV * 2; ++i) acc[i] = _mm256_loadu_ps(init + i * 8);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t s = 0; s < steps; ++s, w += NR) {
      const __m256 xv = _mm256_broadcast_ss(x + s);
#pragma GCC unroll 12
      for (int i = 0; i < NV * 2; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * 8), xv, acc[i]);
    }
  } else {
    for (int64_t s = 0; s < steps; ++s, w += NR * 2) {
      const __m256 xe = _mm256_broadcast_ss(x + 2 * s), xo = _mm256_broadcast_ss(x + 2 * s + 1);
#pragma GCC unroll 12
      for (int i = 0; i < NV * 2; ++i) {
        const tandem_simd::Pairs8 wv = tandem_simd::widen_pairs8(w + i * 16);
        acc[i] = _mm256_fmadd_ps(wv.even, xe, _mm256_fmadd_ps(wv.odd, xo, acc[i]));
      }
    }
  }
  for (int i = 0; i < NV * 2; ++i) _mm256_storeu_ps(out + i * 8, acc[i]);
}

// The first `cols` outputs of one row from its sums `sr` [NR] (silu(gate) * up of the two halves for SiluMul),
// 8 at a time: what store_out and silu_mul16 do on AVX-512. Y = float keeps T's rounding (logits).
template <typename T, typename Y, Out O>
inline void store_row8(const float* sr, int64_t cols, Y* yr) {
  using tandem_simd::round8;
  for (int64_t c = 0; c < cols; c += 8) {
    __m256 v;
    if constexpr (O == Out::SiluMul) {
      const __m256 g = round8(_mm256_loadu_ps(sr + c), T{}), u = round8(_mm256_loadu_ps(sr + c + NR / 2), T{});
      v = tandem_simd::silu_mul8<T>(g, u);
    } else {
      v = _mm256_loadu_ps(sr + c);
    }
    if constexpr (std::is_same_v<Y, float>) v = round8(v, T{});  // (bfloat16 stores round as they store)
    tandem_simd::store8(yr + c, v, cols - c);
  }
}

// Rows [m0, m1) of x against panels [p0, p1). A panel's sums go vector by vector, and within a vector tile by
// tile, in tiles of at most MR8 rows as even as the rows allow (16 rows: 5, 5, 6), so that no thin tile runs short
// of accumulators; the outputs are stored once a panel's vectors are all done. Vector-major, one 16-column slice
// of the panel (K x 64 bytes in float32) serves all the tiles while it is hot, where tile-major passes read the
// whole panel (up to K x 384 bytes: 590 KB for the down projection's) once per tile, from an L2 that also takes
// the fetch of the next panel (16 rows of the default model's matrices, x86-64-v3 build on a 2-core Zen 4, two runs:
// float32 24.9 -> 23.0 and 24.6 -> 24.1 ms, bfloat16 24.2 -> 23.7 and 23.1 -> 22.8; engine steps at batch 16 1-2%;
// a Zen 3 has half that L2). The next panel (or `tail`) is fetched over
// the passes, as panels() does on AVX-512. Without the fetch a panel's first pass waited on memory: in an
// x86-64-v3 build on a 2-core Zen 4, 16 rows of the default model's layers 49.8 -> 27.0 ms in float32 and 37.9
// -> 26.0 in bfloat16 (step profile). Up to ROWWISE rows, a row at a time instead.
template <typename T, typename Y, Out O>
void panels8(const float* x, int64_t K, int64_t m0, int64_t m1, const T* packed, int64_t steps, int64_t p0,
             int64_t p1, const float* bias, int64_t N, Y* y, Tail tail) {
  constexpr int64_t width = O == Out::SiluMul ? NR / 2 : NR;
  const int64_t panel_size = steps * NR * step_of_t<T>;
  const int64_t rows = m1 - m0, tiles = (rows + MR8 - 1) / MR8;
  thread_local std::vector<float> buffer;
  buffer.resize(rows * NR);
  float* sums = buffer.data();
  for (int64_t p = p0; p < p1; ++p) {
    const T* panel = packed + p * panel_size;
    const int64_t n0 = p * width, cols = std::min<int64_t>(width, N - n0);
    alignas(32) float init[NR];  // each sum's first term: the bias, zero past the panel's columns
    for (int c = 0; c < NR; ++c) init[c] = bias && c < cols ? bias[n0 + c] : 0.f;
    if (rows <= ROWWISE) {
      for (int64_t r = 0; r < rows; ++r) panel_sums<T>(x + (m0 + r) * K, panel, steps, init, sums + r * NR);
    } else {
      const PanelFetch ahead(reinterpret_cast<const char*>(panel + panel_size), panel_size * int64_t(sizeof(T)),
                             p + 1 == p1, tail, tiles * NV * steps);
      tandem_simd::PacedFetch<_MM_HINT_T2> paced{ahead.slice(0), ahead.rate};
      for (int v = 0; v < NV; ++v) {
        if ((O == Out::SiluMul ? v % (NV / 2) : v) * 16 >= cols) continue;  // no output of this vector is wanted
        const T* w = panel + v * 16 * step_of_t<T>;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = t * rows / tiles, r1 = (t + 1) * rows / tiles;
          const float* xm = x + (m0 + r0) * K;
          float* out = sums + r0 * NR + v * 16;
          switch (r1 - r0) {  // 3 to 6: more than ROWWISE rows split as evenly as they go
            case 3: vector_sums<T, 3>(xm, K, w, steps, init + v * 16, out, paced); break;
            case 4: vector_sums<T, 4>(xm, K, w, steps, init + v * 16, out, paced); break;
            case 5: vector_sums<T, 5>(xm, K, w, steps, init + v * 16, out, paced); break;
            default: vector_sums<T, MR8>(xm, K, w, steps, init + v * 16, out, paced); break;
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) store_row8<T, Y, O>(sums + r * NR, cols, y + (m0 + r) * N + n0);
  }
}
#else
constexpr bool PACKED = false;
#endif

template <typename T>
void pack(const T* w, int64_t N, int64_t K, int64_t S, T* out) {
  const int64_t steps = (K + S - 1) / S, num_panels = (N + NR - 1) / NR;
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t c = 0; c < NR; ++c)
          for (int64_t e = 0; e < S; ++e) {
            const int64_t n = p * NR + c, k = s * S + e;
            out[((p * steps + s) * NR + c) * S + e] = n < N && k < K ? w[n * K + k] : T{};
          }
  });
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Thread `tid` of `threads`' first panel in a call on `next` (rows of x in one block of M_BLOCK, as decode has).
Tail tail_of(const c10::optional<at::Tensor>& next, int64_t next_N, int64_t tid, int64_t threads) {
  if (!next.has_value() || !next->defined() || next_N <= 0 || !next->is_contiguous()) return {};
  const int64_t num_panels = (next_N + NR - 1) / NR, chunk = (num_panels + threads - 1) / threads;
  if (tid * chunk >= num_panels) return {};
  const int64_t panel_bytes = next->numel() * next->element_size() / num_panels;
  return {static_cast<const char*>(next->data_ptr()) + tid * chunk * panel_bytes, panel_bytes};
}
#endif

}  // namespace

bool packed_linear_supported(const at::Tensor& weight) {
  return PACKED && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16);
}

// weight [N, K] -> its panels, flat; the same dtype.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear_weight: a 2-D CPU weight");
  TORCH_CHECK(packed_linear_supported(weight), "pack_linear_weight: this CPU has no packed kernel for ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), S = step_of(weight);
  const int64_t steps = (K + S - 1) / S, num_panels = (N + NR - 1) / NR;
  auto w = weight.contiguous();
  auto out = at::empty({num_panels * steps * NR * S}, weight.options());
  if (S == 2)
    pack(reinterpret_cast<const bf16_t*>(w.data_ptr()), N, K, S, reinterpret_cast<bf16_t*>(out.data_ptr()));
  else
    pack(w.data_ptr<float>(), N, K, S, out.data_ptr<float>());
  return out;
}

namespace {

// The work of packed_linear and packed_linear_silu: x [M, K] against `num_panels` packed panels -> [M, N] outputs.
template <Out O>
at::Tensor run_packed(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      int64_t num_panels, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& next, int64_t next_N, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), op, ": x and weight dtypes differ");
  TORCH_CHECK(packed_linear_supported(packed), op, ": no packed kernel here for ", packed.scalar_type());
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous(), op, ": the weight must come from pack_linear_weight");
  const int64_t M = x.size(0), S = step_of(x);
  int64_t K = x.size(1);
  const int64_t steps = (K + S - 1) / S;
  TORCH_CHECK(packed.numel() == num_panels * steps * NR * S, op, ": the packed weight is not [", N, ", ", K, "]");
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0 || N == 0) return y;
  auto xc = x.contiguous();
  if (K % S) {  // an odd K: x gets the zero column the panels were padded with
    xc = at::constant_pad_nd(xc, {0, 1});
    K += 1;
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, op, ": bias must have one value per output");
    b = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t m_blocks = (M + M_BLOCK - 1) / M_BLOCK;
#endif
#if defined(__AVX512F__)
  const bool amx = S == 2 && tandem_amx::usable(K);  // K padded: one kernel for every call on a weight
  auto run = [&](auto tag, auto out_tag) {
    using T = decltype(tag);
    using Y = decltype(out_tag);
    const T* xp = reinterpret_cast<const T*>(xc.data_ptr());
    const T* wp = reinterpret_cast<const T*>(packed.data_ptr());
    Y* yp = reinterpret_cast<Y*>(y.data_ptr());
    // Without AVX512_BF16 (or with set_widened_bf16), bfloat16 rows of x widened once per call, for widened_step
    // to broadcast from memory.
    const bool widen = std::is_same_v<T, bf16_t> && (!DOT_PRODUCTS_BF16 || widened_bf16);
    const at::Tensor xw = widen ? xc.to(at::kFloat) : at::Tensor();
    // Work items are (row block, panel) pairs, panel-major within a row block, so each thread streams
    // its own run of panels from memory.
    at::parallel_for(0, m_blocks * num_panels, 1, [&](int64_t i0, int64_t i1) {
      const Tail tail = tail_of(next, next_N, at::get_thread_num(), at::get_num_threads());
      for (int64_t i = i0; i < i1;) {
        const int64_t mb = i / num_panels, p = i % num_panels;
        const int64_t p1 = std::min<int64_t>(num_panels, p + (i1 - i));
        const int64_t m0 = mb * M_BLOCK, m1 = std::min<int64_t>(M, (mb + 1) * M_BLOCK);
        const Tail t = p1 - p == i1 - i ? tail : Tail{};
#if defined(TANDEM_AMX)
        if constexpr (std::is_same_v<T, bf16_t>)
          if (amx && !widen) {
            amx_panels<Y, O>(xp, K, m0, m1, wp, steps, p, p1, bp, N, yp, t);
            i += p1 - p;
            continue;
          }
#endif
        if (widen)
          panels<T, Y, O, float>(xw.data_ptr<float>(), K, m0, m1, wp, steps, p, p1, bp, N, yp, t);
        else
          panels<T, Y, O>(xp, K, m0, m1, wp, steps, p, p1, bp, N, yp, t);
        i += p1 - p;
      }
    });
  };
#elif defined(__AVX2__) && defined(__FMA__)
  auto run = [&](auto tag, auto out_tag) {
    using T = decltype(tag);
    using Y = decltype(out_tag);
    const at::Tensor xf = xc.to(at::kFloat);  // bfloat16 rows widened once per call
    const float* xp = xf.data_ptr<float>();
    const T* wp = reinterpret_cast<const T*>(packed.data_ptr());
    Y* yp = reinterpret_cast<Y*>(y.data_ptr());
    at::parallel_for(0, m_blocks * num_panels, 1, [&](int64_t i0, int64_t i1) {
      const Tail tail = tail_of(next, next_N, at::get_thread_num(), at::get_num_threads());
      for (int64_t i = i0; i < i1;) {
        const int64_t mb = i / num_panels, p = i % num_panels;
        const int64_t p1 = std::min<int64_t>(num_panels, p + (i1 - i));
        const int64_t m0 = mb * M_BLOCK, m1 = std::min<int64_t>(M, (mb + 1) * M_BLOCK);
        const Tail t = p1 - p == i1 - i ? tail : Tail{};
        panels8<T, Y, O>(xp, K, m0, m1, wp, steps, p, p1, bp, N, yp, t);
        i += p1 - p;
      }
    });
  };
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (S == 2) {
    if (float_out)
      run(bf16_t{}, float{});
    else
      run(bf16_t{}, bf16_t{});
  } else {
    run(float{}, float{});
  }
#endif
  return y;
}

}  // namespace

// x [M, K] against packed panels of an [N, K] weight -> [M, N]; float32 accumulation, rounded once to x's dtype.
// `float_out`: the result as float32 (still rounded to x's dtype), as logits are wanted, without a second pass.
// `next`: the packed weight of the layer that runs next (its [N', K'] has next_N rows). Each thread starts a
// call on a cold first panel, with nothing to overlap its fetch with; here it fetches that panel of the next
// call while it computes its last one (at::parallel_for gives thread t the t-th equal run of panels).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& next,
                         int64_t next_N, bool float_out) {
  return run_packed<Out::Plain>("packed_linear", x, packed, N, (N + NR - 1) / NR, bias, next, next_N, float_out);
}

// silu(x G^T) * (x U^T) -> [M, I] for a gate_up weight [G; U] (each [I, K]) packed with each panel holding
// NR / 2 columns of G and then the same columns of U (zero rows past I): the MLP's activation done on the
// accumulators, without writing the [M, 2I] projection and reading it back. Same bits as packed_linear then
// silu_mul.
at::Tensor packed_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t I,
                              const c10::optional<at::Tensor>& next, int64_t next_N) {
  return run_packed<Out::SiluMul>("packed_linear_silu", x, packed, I, (I + NR / 2 - 1) / (NR / 2), c10::nullopt,
                                  next, next_N, false);
}

// Turns the AMX tiles on or off for bfloat16 (packed_linear, prefill_attention; on by default); whether they are
// now on: false where the build or the CPU has none. For tests and benchmarks that compare the two kernels.
bool set_amx(bool enabled) {
  tandem_amx::enabled = enabled;
  return enabled && tandem_amx::permitted();
}

// Runs bfloat16 in packed_linear widened to float32 FMAs (widened_step), as on CPUs without AVX512_BF16, or not
// (the default); whether it now does: true wherever the CPU has no AVX512_BF16. For tests, which compare the two
// kernels where both exist.
bool set_widened_bf16(bool enabled) {
#if defined(__AVX512F__)
  widened_bf16 = enabled;
  return enabled || !DOT_PRODUCTS_BF16;
#else
  (void)enabled;
  return PACKED;  // AVX2: bfloat16 is always widened
#endif
}

// Columns per half-panel of packed_linear_silu's layout (the rows of G, then of U, that one panel holds).
int64_t packed_silu_half_panel() { return NR / 2; }
