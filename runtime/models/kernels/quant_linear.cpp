// heterospec_cpu::quant_linear: y = x W^T for a weight-only quantized W (int4 groupwise or
// int8 per row) on the CPU, in one op with two regimes (so that a compiled graph holds no
// branch on the row count M):
//   - M <= many_rows (decode steps, small batches, verify trees): each row of x is quantized
//     to int8 per block of 32 (scale max|x| / 127, as llama.cpp's Q8_0 activations), and
//     integer dot products run straight on the packed weight bytes (AVX-512 VNNI vpdpbusd:
//     64 multiply-adds per instruction; AVX2: 32 per vpmaddubsw). The weight is read once for all rows and never
//     expanded, so a step runs near the memory bandwidth limit. PyTorch's own int4/int8 CPU
//     kernels dequantize each weight to float32 in registers for each small block of rows and
//     multiply with float32 FMAs: compute bound from a few rows (2-3x this time at 16-512).
//   - M > many_rows (prefill chunks, large batches): each tile of W is dequantized once into
//     a bf16 buffer [K, tile] that stays in L2, and the tile's product runs as a bf16 GEMM
//     (at::mm: oneDNN, with AMX or AVX-512 BF16 where the CPU has them); x stays bf16.
//
// Layout (runtime/models/quant_linear.py's blocked_layout packs it): outputs in blocks of 16
// (N % 16 == 0), K % 32 == 0, group % 32 == 0. Within a block, 16 outputs x 4 consecutive k
// make one 64-byte vector: lane i (4 bytes) belongs to output 16b + i.
//   bits 4: q uint8 [N/16, K/32 * 256]: for k block kb (32 weights) and chunk c (0..3),
//           byte j of lane i holds W[16b+i, 32kb+8c+j] in its low nibble and
//           W[16b+i, 32kb+8c+4+j] in its high nibble;  w = s q + o.
//   bits 8: q uint8 [N/16, K * 16]: for quad t, byte j of lane i holds W[16b+i, 4t+j] + 128;
//           w = s (u - 128).
//   scales float16 [N/16, K/group, 16]; offsets (int4 only, optional) float16 like scales
//   (GGUF's own block scales are fp16: exact for Q4_0/Q4_1; as float32 they were a third of
//   an int4 layer's bytes).
// x bf16 [M, K] contiguous; returns bf16 [M, N].
//
// Vector code, chosen when the file is built (-march=native): AVX-512 F/BW and VNNI
// (vpdpbusd), else AVX2 with FMA and F16C (vpmaddubsw and vpmaddwd, as llama.cpp's AVX2 dot
// products; the CPUs without AVX-512 VNNI: AMD Zen 2/3, Intel Skylake and older), else the
// portable code. Every path computes the same integer sums; quant_linear_isa runs any path
// this build has (for tests), quant_linear the best.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HS_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HS_AVX2 1
#endif
#if defined(HS_VNNI) || defined(HS_AVX2)
#include <immintrin.h>
#endif

namespace {

enum class Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };  // Python: cpu_kernels.ISAS

#if defined(HS_VNNI)
constexpr Isa kBestIsa = Isa::kAvx512Vnni;
#elif defined(HS_AVX2)
constexpr Isa kBestIsa = Isa::kAvx2;
#else
constexpr Isa kBestIsa = Isa::kPortable;
#endif

constexpr int64_t kBlock = 16;  // outputs per block
constexpr int64_t kRowTile = 4;  // rows of x per pass over a block's weight (registers)

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline uint16_t bf16_bits(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef HS_VNNI
inline __m512 load_halves(const uint16_t* p) {  // 16 fp16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m256i bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}
#endif

// ---- x quantized per row and block of 32 ---------------------------------------------------

struct QuantizedRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, K/32]: x ~ scale q
  std::vector<float> sum;     // [M, K/32]: scale x the block's sum of q, for the offsets (the sum
                              // of the quantized x, as llama.cpp's Q8_1: the result is then W x_q
                              // exactly; the float sum of x would add o (sum x - sum x_q), and
                              // with Q4_0's o = -8 s that error is 8x a weight's)
  std::vector<int32_t> qsum;  // [M, K/32]: the block's sum of q, for int8's +128
};

template <Isa kIsa>
void quantize_block(const uint16_t* x, int8_t* q, float* scale, float* sum, int32_t* qsum) {
#ifdef HS_VNNI
  if constexpr (kIsa == Isa::kAvx512Vnni) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));  // round to nearest even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
    *scale = amax / 127.f;
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    *sum = *scale * static_cast<float>(*qsum);
    return;
  }
#endif
#ifdef HS_AVX2
  if constexpr (kIsa == Isa::kAvx2) {  // the portable code's arithmetic, 8 lanes at a time
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {  // bf16 -> float32: the bits, 16 places up
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * i))), 16));
      amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], magnitude));
    }
    __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qi[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round to nearest even
      total = _mm256_add_epi32(total, qi[i]);
    }
    // the packs work within 128-bit lanes: their dwords hold q[0..3], q[8..11], q[16..19],
    // q[24..27], q[4..7], ...; the permutation puts them in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(1, 0, 3, 2)));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(2, 3, 0, 1)));
    *scale = amax / 127.f;
    *qsum = _mm_cvtsi128_si32(total4);
    *sum = *scale * static_cast<float>(*qsum);
    return;
  }
#endif
  float v[32], amax = 0.f;
  for (int j = 0; j < 32; ++j) {
    v[j] = bf16_to_float(x[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int32_t qtotal = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
    qtotal += q[j];
  }
  *scale = amax / 127.f;
  *qsum = qtotal;
  *sum = *scale * static_cast<float>(qtotal);
}

template <Isa kIsa>
QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  QuantizedRows a{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks),
                  std::vector<int32_t>(M * blocks)};
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block<kIsa>(xd + i * 32, a.q.data() + i * 32, &a.scale[i], &a.sum[i], &a.qsum[i]);
  });
  return a;
}

// ---- few rows: integer dot products on the packed bytes ------------------------------------

struct Weight {
  const uint8_t* q;
  const uint16_t* scales;   // fp16
  const uint16_t* offsets;  // fp16; nullptr: none
  int64_t bits, K, group;

  int64_t block_bytes() const { return bits == 4 ? K * 8 : K * 16; }
  int64_t groups() const { return K / group; }
};

// Rows m0 .. m0+R of y for output block b, as float32 [R, 16] into out. Loops run over groups
// and then their k blocks (no division in the loop); kBits is a template argument so that
// the inner loop holds no branch.
template <Isa kIsa, int R, int kBits>
void dot_block(const Weight& w, int64_t b, const QuantizedRows& a, int64_t m0, float* out) {
  const int64_t K = w.K, kblocks = K / 32, per_group = w.group / 32, groups = w.groups();
  constexpr int64_t kBlockBytes = kBits == 4 ? 256 : 512;  // one k block of 32 x 16 outputs
  const uint8_t* __restrict qb = w.q + b * w.block_bytes();
  const uint16_t* __restrict sb = w.scales + b * groups * kBlock;
  const uint16_t* __restrict ob = w.offsets ? w.offsets + b * groups * kBlock : nullptr;
  const int8_t* __restrict xq = a.q.data() + m0 * K;  // rows m0 .. m0+R, each K
  const float* __restrict xscale = a.scale.data() + m0 * kblocks;
  const float* __restrict xsum = a.sum.data() + m0 * kblocks;
  const int32_t* __restrict xqsum = a.qsum.data() + m0 * kblocks;
#ifdef HS_VNNI
  if constexpr (kIsa == Isa::kAvx512Vnni) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 s = load_halves(sb + g * kBlock);
      const __m512 o = ob ? load_halves(ob + g * kBlock) : _mm512_setzero_ps();
      for (int64_t kb = g * per_group; kb < (g + 1) * per_group; ++kb) {
        const uint8_t* p = qb + kb * kBlockBytes;
        __m512i wq[8];  // quad t: 16 outputs x k 4t..4t+3 of this block, unsigned bytes
        if constexpr (kBits == 4) {
          for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(p + 64 * c);
            wq[2 * c] = _mm512_and_si512(v, low);
            wq[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          }
        } else {
          for (int t = 0; t < 8; ++t) wq[t] = _mm512_loadu_si512(p + 64 * t);
        }
        for (int r = 0; r < R; ++r) {
          const auto* x4 = reinterpret_cast<const int32_t*>(xq + r * K + kb * 32);
          __m512i dot = _mm512_setzero_si512();
          for (int t = 0; t < 8; ++t) dot = _mm512_dpbusd_epi32(dot, wq[t], _mm512_set1_epi32(x4[t]));
          const int64_t blk = r * kblocks + kb;
          if constexpr (kBits == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * xqsum[blk]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xscale[blk])), acc[r]);
          if (ob) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[blk]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kBlock, acc[r]);
    return;
  }
#endif
#ifdef HS_AVX2
  if constexpr (kIsa == Isa::kAvx2) {
    // two halves of 8 outputs (the 64-byte vector's first and second 32 bytes); vpmaddubsw
    // multiplies unsigned by signed bytes into saturating int16 pair sums, so each operand pair
    // is kept in range: int4 u (0..15) by x (|x| <= 127), whose 8 quads sum to at most
    // 8 x 2 x 15 x 127 = 30480 in int16; int8 |w| (w = u - 128) by x with w's sign, one quad
    // at a time (2 x 128 x 127 = 32512), widened to int32 before the next
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(-128);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * kBlock))),
                           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * kBlock + 8)))};
      __m256 o[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      if (ob) {
        o[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ob + g * kBlock)));
        o[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ob + g * kBlock + 8)));
      }
      for (int64_t kb = g * per_group; kb < (g + 1) * per_group; ++kb) {
        const uint8_t* p = qb + kb * kBlockBytes;
        const int32_t* x4[R];  // each row's k block as 8 quads of int8
        for (int r = 0; r < R; ++r) x4[r] = reinterpret_cast<const int32_t*>(xq + r * K + kb * 32);
        __m256i dot[R][2];
        for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        // each weight vector is loaded and unpacked once for all R rows
        if constexpr (kBits == 4) {
          for (int c = 0; c < 4; ++c) {
            for (int h = 0; h < 2; ++h) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32 * h));
              const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
              for (int r = 0; r < R; ++r)
                dot[r][h] = _mm256_add_epi16(dot[r][h], _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[r][2 * c])),
                    _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[r][2 * c + 1]))));
            }
          }
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(dot[r][h], ones);
        } else {
          for (int t = 0; t < 8; ++t) {
            for (int h = 0; h < 2; ++h) {
              const __m256i w = _mm256_xor_si256(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * t + 32 * h)), bias);  // u - 128
              const __m256i magnitude = _mm256_abs_epi8(w);
              for (int r = 0; r < R; ++r) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x4[r][t]), w));
                dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
              }
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          const int64_t blk = r * kblocks + kb;
          const __m256 xs = _mm256_set1_ps(xscale[blk]), xm = _mm256_set1_ps(xsum[blk]);
          for (int h = 0; h < 2; ++h) {
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(s[h], xs), acc[r][h]);
            if (ob) acc[r][h] = _mm256_fmadd_ps(o[h], xm, acc[r][h]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * kBlock, acc[r][0]);
      _mm256_storeu_ps(out + r * kBlock + 8, acc[r][1]);
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    float acc[kBlock] = {};
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t blk = r * kblocks + kb, g = kb / per_group;
      const int8_t* x = xq + r * K + kb * 32;
      for (int i = 0; i < kBlock; ++i) {
        int32_t dot = 0;
        for (int t = 0; t < 8; ++t) {
          for (int j = 0; j < 4; ++j) {
            const int32_t u = kBits == 4 ? (qb[kb * kBlockBytes + 64 * (t / 2) + 4 * i + j] >> (4 * (t % 2))) & 15
                                         : qb[kb * kBlockBytes + 64 * t + 4 * i + j];
            dot += u * x[4 * t + j];
          }
        }
        if (kBits == 8) dot -= 128 * xqsum[blk];
        acc[i] += static_cast<float>(dot) * (half_to_float(sb[g * kBlock + i]) * xscale[blk]);
        if (ob) acc[i] += half_to_float(ob[g * kBlock + i]) * xsum[blk];
      }
    }
    std::memcpy(out + r * kBlock, acc, sizeof(acc));
  }
}

template <Isa kIsa, int kBits>
void dot_rows(const Weight& w, const QuantizedRows& a, int64_t M, int64_t N, uint16_t* y) {
  at::parallel_for(0, N / kBlock, 1, [&](int64_t begin, int64_t end) {
    float out[kRowTile * kBlock];
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, M - m0);
        switch (rows) {
          case 4: dot_block<kIsa, 4, kBits>(w, b, a, m0, out); break;
          case 3: dot_block<kIsa, 3, kBits>(w, b, a, m0, out); break;
          case 2: dot_block<kIsa, 2, kBits>(w, b, a, m0, out); break;
          default: dot_block<kIsa, 1, kBits>(w, b, a, m0, out); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < kBlock; ++i) y[(m0 + r) * N + b * kBlock + i] = bf16_bits(out[r * kBlock + i]);
      }
    }
  });
}

// ---- many rows: tiles of W dequantized to bf16, then a bf16 GEMM ---------------------------

// Output block b of W as bf16 into columns [col, col + 16) of tile [K, ld].
template <Isa kIsa>
void dequantize_block(const Weight& w, int64_t b, uint16_t* tile, int64_t ld, int64_t col) {
  const int64_t per_group = w.group / 32;
  const uint8_t* qb = w.q + b * w.block_bytes();
  const uint16_t* sb = w.scales + b * w.groups() * kBlock;
  const uint16_t* ob = w.offsets ? w.offsets + b * w.groups() * kBlock : nullptr;
  const int64_t quads_per_group = 8 * per_group;
  for (int64_t g = 0; g < w.groups(); ++g) {
#ifdef HS_VNNI
    const __m512 s = load_halves(sb + g * kBlock);
    const __m512 o = ob ? load_halves(ob + g * kBlock) : _mm512_set1_ps(w.bits == 8 ? -128.f : 0.f);
    const __m512i mask = _mm512_set1_epi32(w.bits == 4 ? 15 : 255);
#endif
    for (int64_t t = g * quads_per_group; t < (g + 1) * quads_per_group; ++t) {  // quad t: k 4t..4t+3
      // int4: quad t sits in chunk (t % 8) / 2 of k block t / 8, in the low (even t) or high nibbles
      const uint8_t* chunk = w.bits == 4 ? qb + (t / 8) * 256 + 64 * ((t % 8) / 2) : qb + 64 * t;
      const int shift = w.bits == 4 ? 4 * (t % 2) : 0;
#ifdef HS_VNNI
      if constexpr (kIsa == Isa::kAvx512Vnni) {
        const __m512i v = _mm512_loadu_si512(chunk);
        for (int j = 0; j < 4; ++j) {
          const __m512 u = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * j + shift), mask));
          const __m512 value = w.bits == 4 ? _mm512_fmadd_ps(u, s, o) : _mm512_mul_ps(_mm512_add_ps(u, o), s);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + (4 * t + j) * ld + col), bf16x16(value));
        }
        continue;
      }
#endif
      for (int j = 0; j < 4; ++j) {
        for (int i = 0; i < kBlock; ++i) {
          const float u = static_cast<float>((chunk[4 * i + j] >> shift) & (w.bits == 4 ? 15 : 255));
          const float scale = half_to_float(sb[g * kBlock + i]);
          const float value =
              w.bits == 4 ? u * scale + (ob ? half_to_float(ob[g * kBlock + i]) : 0.f) : (u - 128.f) * scale;
          tile[(4 * t + j) * ld + col + i] = bf16_bits(value);
        }
      }
    }
  }
}

template <Isa kIsa>
void gemm_rows(const Weight& w, const at::Tensor& x, int64_t N, int64_t tile_bytes, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K;
  // tiles of at most tile_bytes, and at least two per thread where N allows (load balance)
  const int64_t balanced = (N + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t tile_cols = std::max<int64_t>(kBlock, std::min(tile_bytes / (2 * K), balanced) / kBlock * kBlock);
  const int64_t tiles = (N + tile_cols - 1) / tile_cols;
  auto* yd = y.data_ptr<at::BFloat16>();  // written with memcpy: worker threads are not in the caller's InferenceMode
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tile(K * tile_cols);  // bf16 [K, cols]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_cols, cols = std::min(tile_cols, N - n0);
      for (int64_t c = 0; c < cols; c += kBlock) dequantize_block<kIsa>(w, (n0 + c) / kBlock, tile.data(), cols, c);
      at::Tensor part = at::mm(x, at::from_blob(tile.data(), {K, cols}, x.options()));  // [M, cols]
      const auto* src = part.data_ptr<at::BFloat16>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(yd + m * N + n0, src + m * cols, cols * sizeof(at::BFloat16));
    }
  });
}

// ---- the op ---------------------------------------------------------------------------------

template <Isa kIsa>
at::Tensor run(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
               const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t many_rows,
               int64_t tile_bytes) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), blocks = q.size(0), N = blocks * kBlock;
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && K % group == 0, "K and the group must be multiples of 32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 &&
              q.size(1) == (bits == 4 ? K * 8 : K * 16), "q: contiguous uint8 [N/16, K*8] (4 bits) or [N/16, K*16]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == blocks && scales.size(1) == K / group && scales.size(2) == kBlock,
              "scales: contiguous float16 [N/16, K/group, 16]");
  TORCH_CHECK(!offsets.has_value() || (bits == 4 && offsets->scalar_type() == at::kHalf &&
              offsets->is_contiguous() && offsets->sizes() == scales.sizes()), "offsets: int4 only, float16 like scales");
  const auto halves = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  const Weight w{q.data_ptr<uint8_t>(), halves(scales), offsets.has_value() ? halves(*offsets) : nullptr, bits, K,
                 group};
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (M > many_rows) {
    gemm_rows<kIsa>(w, x, N, tile_bytes, y);
  } else {
    const QuantizedRows a = quantize_rows<kIsa>(x);
    auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    if (bits == 4)
      dot_rows<kIsa, 4>(w, a, M, N, yd);
    else
      dot_rows<kIsa, 8>(w, a, M, N, yd);
  }
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t many_rows,
                        int64_t tile_bytes) {
  return run<kBestIsa>(x, q, scales, offsets, bits, group, many_rows, tile_bytes);
}

bool isa_built(int64_t isa) {
  switch (static_cast<Isa>(isa)) {
    case Isa::kPortable: return true;
#ifdef HS_AVX2
    case Isa::kAvx2: return true;
#endif
#ifdef HS_VNNI
    case Isa::kAvx512Vnni: return true;
#endif
    default: return false;
  }
}

// quant_linear with the code of one instruction set (Isa), which this build must have: so
// that a test can run every path the CPU can, whichever quant_linear picks
at::Tensor quant_linear_isa(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t many_rows,
                            int64_t tile_bytes, int64_t isa) {
  TORCH_CHECK(isa_built(isa), "quant_linear_isa: instruction set ", isa, " is not in this build");
  switch (static_cast<Isa>(isa)) {
#ifdef HS_VNNI
    case Isa::kAvx512Vnni: return run<Isa::kAvx512Vnni>(x, q, scales, offsets, bits, group, many_rows, tile_bytes);
#endif
#ifdef HS_AVX2
    case Isa::kAvx2: return run<Isa::kAvx2>(x, q, scales, offsets, bits, group, many_rows, tile_bytes);
#endif
    default: return run<Isa::kPortable>(x, q, scales, offsets, bits, group, many_rows, tile_bytes);
  }
}

int64_t best_isa() { return static_cast<int64_t>(kBestIsa); }

}  // namespace

TORCH_LIBRARY(heterospec_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int bits, int group, int many_rows, "
        "int tile_bytes) -> Tensor");
  m.def("quant_linear_isa(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int bits, int group, "
        "int many_rows, int tile_bytes, int isa) -> Tensor");
  m.def("best_isa() -> int", &best_isa);
  m.def("isa_built(int isa) -> bool", &isa_built);
}

TORCH_LIBRARY_IMPL(heterospec_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_isa", &quant_linear_isa);
}
