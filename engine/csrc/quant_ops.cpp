// Weight-only quantized linear layers: y = x W^T with W stored as unsigned integers in blocks of 32
// along K, each block with a scale and either an offset (w = scale * u + offset) or a zero point
// (w = scale * (u - zero)). That one form holds GGUF's Q4_0 (zero 8), Q4_1 (offset m) and Q8_0
// (u = q + 128, zero 128) with their float16 scales as the file has them (a matmul reads no more bytes
// than the file holds), and int8 per-channel weights (one float32 scale per row, zero 128).
//
// Decode reads every weight once per step, so fewer bytes per weight is speed; the dot products
// run on integers: x is quantized per 32-block to int8 (scale d, as llama.cpp's Q8 activations),
// and AVX-512 VNNI multiplies 64 weight bytes by 64 activation bytes per instruction.
//
// Layout (what engine/quant/packing.py writes): a row's blocks go in chunks of 16, and inside a
// chunk the bytes are interleaved so that 32-bit lane l of every vector belongs to block l:
// step s (0..7) holds bytes 4s..4s+3 of each of the chunk's L blocks, so eight dpbusd leave the
// 16 blocks' integer sums in 16 lanes with no horizontal reduction. 4-bit weights pack steps 2t
// (low nibbles) and 2t+1 (high nibbles) into one byte. A row's last chunk holds only its L =
// nb % 16 blocks, read with masked loads, so no byte is padding. x is laid out the same way.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;    // weights per quantization block
constexpr int64_t CHUNK = 16;    // blocks per interleaved chunk (one per 32-bit lane)
constexpr int QROWS = 4;         // weight rows per kernel block (the packer pads N to a multiple)

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct QWeight {
  const uint8_t* data;       // [Npad, row_bytes]
  const uint16_t* scale;     // float16 [Npad, nb] (per block), or null
  const uint16_t* offset;    // float16 [Npad, nb], or null: w = scale * (u - zero)
  const float* row_scale;    // float32 [Npad] (per row), or null
  float zero;
  int64_t row_bytes;
  int64_t nb;
  int bits;
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

struct QX {
  const int8_t* q;  // [M, K] interleaved
  const float* d;   // [M, nb] block scales
  const float* s;   // [M, nb] d * sum(q) of each block
  int64_t K;
  int64_t nb;
};

inline int64_t chunk_lanes(int64_t nb, int64_t c) { return std::min<int64_t>(CHUNK, nb - c * CHUNK); }
inline int64_t weight_chunk_bytes(int bits) { return CHUNK * BLOCK * bits / 8; }

// Quantizes each 32-block of x to int8 (round to nearest even of x / d, d = max|x| / 127) into the
// interleaved layout. The same arithmetic, in the same order, as engine.quant.reference.
template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / BLOCK;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    float vals[BLOCK];
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t j = 0; j < nb; ++j) {
        const T* src = x + m * K + j * BLOCK;
        float amax = 0.f;
        for (int64_t i = 0; i < BLOCK; ++i) {
          if constexpr (std::is_same_v<T, float>) vals[i] = src[i];
          else vals[i] = bf16_to_float(src[i]);
          amax = std::max(amax, std::fabs(vals[i]));
        }
        const float dj = amax / 127.f;
        const float inv = dj != 0.f ? 1.f / dj : 0.f;
        const int64_t c = j / CHUNK, l = j % CHUNK, L = chunk_lanes(nb, c);
        int8_t* dst = q + m * K + c * CHUNK * BLOCK;
        int32_t sum = 0;
        for (int64_t i = 0; i < BLOCK; ++i) {
          const int v = static_cast<int>(std::nearbyint(vals[i] * inv));
          sum += v;
          dst[(i / 4) * 4 * L + l * 4 + i % 4] = static_cast<int8_t>(v);
        }
        d[m * nb + j] = dj;
        s[m * nb + j] = dj * static_cast<float>(sum);
      }
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAVE_VNNI = true;

// Full chunks use plain loads (masked byte loads are slower on some cores); the last one is masked.
template <bool FULL>
inline __m512i load_bytes(__mmask64 bm, const void* p) {
  if constexpr (FULL) return _mm512_loadu_si512(p);
  else return _mm512_maskz_loadu_epi8(bm, p);
}

inline __m512 load_halves(const uint16_t* p, __mmask16 lm) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lm, p));
}

// The integer sums of chunk c: iacc[r][m] lane l = sum over block l of u * q.
template <int BITS, int MT, bool FULL>
inline void chunk_sums(const QWeight& W, int64_t n, const QX& X, int64_t m0, int64_t c, int64_t L, __mmask64 bm,
                       __m512i (&iacc)[QROWS][MT]) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int64_t step = 4 * L;
  for (int r = 0; r < QROWS; ++r)
    for (int m = 0; m < MT; ++m) iacc[r][m] = _mm512_setzero_si512();
  const int8_t* xc[MT];
  for (int m = 0; m < MT; ++m) xc[m] = X.q + (m0 + m) * X.K + c * CHUNK * BLOCK;
  const int64_t woff = c * weight_chunk_bytes(BITS);
  if constexpr (BITS == 4) {
    for (int t = 0; t < 4; ++t) {
      __m512i xl[MT], xh[MT];
      for (int m = 0; m < MT; ++m) {
        xl[m] = load_bytes<FULL>(bm, xc[m] + (2 * t) * step);
        xh[m] = load_bytes<FULL>(bm, xc[m] + (2 * t + 1) * step);
      }
      for (int r = 0; r < QROWS; ++r) {
        const __m512i v = load_bytes<FULL>(bm, W.data + (n + r) * W.row_bytes + woff + t * step);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int m = 0; m < MT; ++m)
          iacc[r][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(iacc[r][m], lo, xl[m]), hi, xh[m]);
      }
    }
  } else {
    for (int s = 0; s < 8; ++s) {
      __m512i xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = load_bytes<FULL>(bm, xc[m] + s * step);
      for (int r = 0; r < QROWS; ++r) {
        const __m512i v = load_bytes<FULL>(bm, W.data + (n + r) * W.row_bytes + woff + s * step);
        for (int m = 0; m < MT; ++m) iacc[r][m] = _mm512_dpbusd_epi32(iacc[r][m], v, xv[m]);
      }
    }
  }
}

// out[r * MT + m] = sum over K of w(n + r, k) * xq(m0 + m, k), for QROWS weight rows.
template <int BITS, int MT>
void qblock(const QWeight& W, int64_t n, const QX& X, int64_t m0, float* out) {
  __m512 acc[QROWS][MT];
  for (int r = 0; r < QROWS; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t nchunks = (W.nb + CHUNK - 1) / CHUNK;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t L = chunk_lanes(W.nb, c), step = 4 * L;
    const __mmask64 bm = L == CHUNK ? ~0ULL : (1ULL << step) - 1;
    const __mmask16 lm = static_cast<__mmask16>(L == CHUNK ? 0xffff : (1u << L) - 1);
    __m512i iacc[QROWS][MT];
    if (L == CHUNK) chunk_sums<BITS, MT, true>(W, n, X, m0, c, L, bm, iacc);
    else chunk_sums<BITS, MT, false>(W, n, X, m0, c, L, bm, iacc);
    __m512 dx[MT], sx[MT];
    for (int m = 0; m < MT; ++m) {
      dx[m] = _mm512_maskz_loadu_ps(lm, X.d + (m0 + m) * X.nb + c * CHUNK);
      sx[m] = _mm512_maskz_loadu_ps(lm, X.s + (m0 + m) * X.nb + c * CHUNK);
    }
    for (int r = 0; r < QROWS; ++r) {
      const int64_t at = (n + r) * W.nb + c * CHUNK;
      const __m512 ws = W.row_scale ? _mm512_set1_ps(W.row_scale[n + r]) : load_halves(W.scale + at, lm);
      const __m512 wo = W.offset ? load_halves(W.offset + at, lm) : _mm512_mul_ps(ws, _mm512_set1_ps(-W.zero));
      for (int m = 0; m < MT; ++m) {
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r][m]), dx[m]);
        acc[r][m] = _mm512_fmadd_ps(wo, sx[m], _mm512_fmadd_ps(dot, ws, acc[r][m]));
      }
    }
  }
  for (int r = 0; r < QROWS; ++r)
    for (int m = 0; m < MT; ++m) out[r * MT + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#else
constexpr bool HAVE_VNNI = false;

// Portable version of the same sums, in layout order (so compilers vectorise the lane loop).
template <int BITS, int MT>
void qblock(const QWeight& W, int64_t n, const QX& X, int64_t m0, float* out) {
  for (int r = 0; r < QROWS; ++r)
    for (int m = 0; m < MT; ++m) {
      const uint8_t* wrow = W.data + (n + r) * W.row_bytes;
      const int8_t* xrow = X.q + (m0 + m) * X.K;
      float total = 0.f;
      for (int64_t c = 0; c * CHUNK < W.nb; ++c) {
        const int64_t L = chunk_lanes(W.nb, c), step = 4 * L;
        int32_t isum[CHUNK] = {0};
        const uint8_t* wc = wrow + c * weight_chunk_bytes(BITS);
        const int8_t* xc = xrow + c * CHUNK * BLOCK;
        for (int s = 0; s < 8; ++s)
          for (int64_t i = 0; i < step; ++i) {
            const int u = BITS == 8 ? wc[s * step + i] : (wc[(s / 2) * step + i] >> (4 * (s % 2))) & 0x0f;
            isum[i / 4] += u * xc[s * step + i];
          }
        for (int64_t l = 0; l < L; ++l) {
          const int64_t j = c * CHUNK + l;
          const float ws = W.row_scale ? W.row_scale[n + r] : half_to_float(W.scale[(n + r) * W.nb + j]);
          const float wo = W.offset ? half_to_float(W.offset[(n + r) * W.nb + j]) : ws * -W.zero;
          const float xd = X.d[(m0 + m) * X.nb + j], xs = X.s[(m0 + m) * X.nb + j];
          total += static_cast<float>(isum[l]) * xd * ws + wo * xs;
        }
      }
      out[r * MT + m] = total;
    }
}
#endif

constexpr int QMAX_TILE = 2;  // rows of x per tile: 4 x 2 integer and float accumulators fit the registers

template <int BITS, typename T>
void qlinear_rows(const QWeight& W, const QX& X, int64_t M, const float* bias, int64_t N, int64_t b0, int64_t b1,
                  T* y) {
  float r[QROWS * QMAX_TILE];
  for (int64_t bi = b0; bi < b1; ++bi) {
    const int64_t n = bi * QROWS;
    const int rows = static_cast<int>(std::min<int64_t>(QROWS, N - n));
    for (int64_t m0 = 0; m0 < M; m0 += QMAX_TILE) {
      const int mt = static_cast<int>(std::min<int64_t>(QMAX_TILE, M - m0));
      if (mt == 2) qblock<BITS, 2>(W, n, X, m0, r);
      else qblock<BITS, 1>(W, n, X, m0, r);
      for (int i = 0; i < rows; ++i) {
        const float b = bias ? bias[n + i] : 0.f;
        for (int m = 0; m < mt; ++m) {
          const float v = r[i * mt + m] + b;
          if constexpr (std::is_same_v<T, float>) y[(m0 + m) * N + n + i] = v;
          else y[(m0 + m) * N + n + i] = float_to_bf16(v);
        }
      }
    }
  }
}

}  // namespace

// x [M, K] float32 or bfloat16 -> [M, N] in x's dtype. `data` [Npad, row_bytes] uint8 in the
// interleaved layout; `scale` float16 [Npad, K / 32] (per block) or float32 [Npad, 1] (per row);
// `offset` float16 like a per-block scale, or none (then w = scale * (u - zero)); `bits` 4 or 8;
// `bias` [N] or none; N <= Npad the real number of rows.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& scale,
                      const c10::optional<torch::Tensor>& offset, int64_t zero, int64_t bits, int64_t N,
                      const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "qlinear: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "qlinear: float32 or bfloat16 x");
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: 4 or 8 bits");
  TORCH_CHECK(data.scalar_type() == torch::kByte && data.is_contiguous() && data.dim() == 2, "qlinear: data uint8 [N, B]");
  const int64_t M = x.size(0), K = x.size(1), Npad = data.size(0), nb = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && data.size(1) == K * bits / 8, "qlinear: K must be a multiple of 32 matching data");
  TORCH_CHECK(Npad % QROWS == 0 && N <= Npad && N > 0, "qlinear: rows must be padded to a multiple of 4");
  const bool per_row = scale.scalar_type() == torch::kFloat;
  TORCH_CHECK(scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == Npad &&
              (per_row ? scale.size(1) == 1 : scale.scalar_type() == torch::kHalf && scale.size(1) == nb),
              "qlinear: scale float16 [N, K/32] or float32 [N, 1]");
  const bool has_offset = offset.has_value() && offset->defined();
  TORCH_CHECK(!has_offset || (!per_row && offset->scalar_type() == torch::kHalf && offset->is_contiguous() &&
                              offset->sizes() == scale.sizes()), "qlinear: offset float16 shaped like the scale");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qlinear: bias must have one value per output");
    b = bias->to(torch::kFloat).contiguous();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xc = x.contiguous();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  xq.resize(M * K);
  xd.resize(M * nb);
  xs.resize(M * nb);
  if (x.scalar_type() == torch::kFloat) quantize_x(xc.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
  else quantize_x(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, xq.data(), xd.data(), xs.data());
  const QWeight W{data.data_ptr<uint8_t>(),
                  per_row ? nullptr : reinterpret_cast<const uint16_t*>(scale.data_ptr()),
                  has_offset ? reinterpret_cast<const uint16_t*>(offset->data_ptr()) : nullptr,
                  per_row ? scale.data_ptr<float>() : nullptr,
                  static_cast<float>(zero), data.size(1), nb, static_cast<int>(bits)};
  const QX X{xq.data(), xd.data(), xs.data(), K, nb};
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool f32 = x.scalar_type() == torch::kFloat;
  void* yp = y.data_ptr();
  at::parallel_for(0, (N + QROWS - 1) / QROWS, 8, [&](int64_t b0, int64_t b1) {
    if (f32) {
      if (bits == 4) qlinear_rows<4>(W, X, M, bp, N, b0, b1, static_cast<float*>(yp));
      else qlinear_rows<8>(W, X, M, bp, N, b0, b1, static_cast<float*>(yp));
    } else {
      if (bits == 4) qlinear_rows<4>(W, X, M, bp, N, b0, b1, static_cast<uint16_t*>(yp));
      else qlinear_rows<8>(W, X, M, bp, N, b0, b1, static_cast<uint16_t*>(yp));
    }
  });
  return y;
}

bool qlinear_vnni() { return HAVE_VNNI; }
