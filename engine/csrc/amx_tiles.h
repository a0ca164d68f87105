// AMX tile plumbing shared by the kernel files that run bfloat16 on the tiles (packed_linear.cpp,
// prefill_attention.cpp): the process's permission to use them and a thread's tile configuration.
#pragma once

#include <atomic>
#include <cstdint>

namespace tandem_amx {
// Whether bfloat16 runs on the tiles where it can (set_amx; tests and benchmarks compare the two kernels).
inline std::atomic<bool> enabled{true};
}  // namespace tandem_amx

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TANDEM_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "simd_math.h"

namespace tandem_amx {

// Linux hands out the 8 KB of tile state only to a process that asks for it (once, for all its threads).
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg through asm with the config as a memory operand: GCC 12's _tile_loadconfig does not tell the
// optimiser that it reads the struct, which may then drop the stores that fill it (the first tile op then
// faults as unconfigured).
inline void load(const TileConfig& c) { asm volatile("ldtilecfg %0" : : "m"(c)); }

// The 2 x 2 layout: C 0, 1 (rows 0-15 of x, two vectors of 16 columns), C 2, 3 (rows 16..rows-1; unused, and
// left unconfigured, for 16 rows or fewer), A 4 and 5 (those rows, 32 k), B 6 and 7 (16 pairs of k x 16 columns).
inline void configure_2x2(int rows) {
  TileConfig c;
  const int top = rows < 16 ? rows : 16, bottom = rows > 16 ? rows - 16 : 0;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[4] = top;
  c.rows[2] = c.rows[3] = c.rows[5] = bottom;
  if (!bottom) c.colsb[2] = c.colsb[3] = c.colsb[5] = 0;
  c.rows[6] = c.rows[7] = 16;
  load(c);
}

// The 32 lines of the two B tiles at `w` (16 rows of 128 bytes, ldb bytes apart) into L1. Tile loads wait on
// every line they miss, and nothing fetches a B tile's rows ahead of them: a panel is wider than L1, so each
// chunk's B tiles came from L2 while the tiles stood idle. Fetched one chunk ahead, they are in L1 by the time
// the loads run (in-process A/B on a 2-core AMX Xeon: 1,024 rows over the default model's matrices 134.4 -> 126.8
// ms, prefill attention of 1,024 tokens 65.6 -> 62.3, the engine's whole prefill 3-4% faster; two chunks ahead
// was slower, x's rows fetched too slower still).
inline void fetch_b_tiles(const uint16_t* w, int64_t ldb) {
  const char* p = reinterpret_cast<const char*>(w);
  for (int r = 0; r < 16; ++r, p += ldb) {
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
}

// c [rows, 32 * pairs] (float32, ldc bytes per row) = a [rows, 32 * chunks] b, rows <= 32, in the 2 x 2 layout
// (configure_2x2(rows) first). b's tile for 16-column vector j and chunk c (16 pairs of k, k-major pairs) starts
// at b + c * b_chunk + j * 32 elements, ldb bytes per pair of k. Each chunk's products are summed in one order,
// whatever rows is. `next`, if any: what the caller reads next, fetched into L2 while the tiles compute,
// `rate` / 256 cache lines per chunk of every pair of vectors.
inline void matmul_2x2(const uint16_t* a, int64_t lda, int rows, const uint16_t* b, int64_t ldb, int64_t b_chunk,
                       int64_t chunks, int64_t pairs, float* c, int64_t ldc, const char* next = nullptr,
                       int rate = 0) {
  tandem_simd::PacedFetch<_MM_HINT_T1> fetch{next, rate};
  const bool two = rows > 16;
  for (int64_t j = 0; j < pairs; ++j) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const uint16_t* w = b + j * 64;
    for (int64_t k = 0; k < chunks; ++k, w += b_chunk) {
      fetch.step();
      if (k + 1 < chunks)  // the next chunk's B tiles, or the next pair's first
        fetch_b_tiles(w + b_chunk, ldb);
      else if (j + 1 < pairs)
        fetch_b_tiles(b + (j + 1) * 64, ldb);
      _tile_loadd(4, a + k * 32, lda);
      _tile_loadd(6, w, ldb);
      _tile_loadd(7, w + 32, ldb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, reinterpret_cast<const char*>(a + k * 32) + 16 * lda, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* cj = c + j * 32;
    _tile_stored(0, cj, ldc);
    _tile_stored(1, cj + 16, ldc);
    if (two) {
      _tile_stored(2, reinterpret_cast<char*>(cj) + 16 * ldc, ldc);
      _tile_stored(3, reinterpret_cast<char*>(cj + 16) + 16 * ldc, ldc);
    }
  }
}

}  // namespace tandem_amx
#else
namespace tandem_amx {
inline bool permitted() { return false; }
}  // namespace tandem_amx
#endif

namespace tandem_amx {
// Whether a bfloat16 product summing over k elements runs on the tiles: built with them, switched on, permitted,
// and k a whole number of 32-element chunks (so every call on one weight or head size takes the same kernel).
inline bool usable(int64_t k) { return enabled && k % 32 == 0 && permitted(); }
}  // namespace tandem_amx
