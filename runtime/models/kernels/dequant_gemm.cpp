// heterospec::dequant_gemm: y = x W^T for a weight-only quantized W, for inputs of many
// rows (prefill chunks, large batches, verify trees). PyTorch's CPU int4/int8 weight-only
// kernels dequantize the weight in registers again for each small block of rows and
// multiply with float32 FMAs, so their cost grows with the rows at float32 FMA speed; here each tile of W is dequantized once per
// call into a bf16 buffer that stays in L2, and the tile's product runs as a bf16 GEMM
// (at::mm: oneDNN, with AMX or AVX-512 BF16 where the CPU has them).
//
// Layouts (runtime/models/quant_linear.py packs them):
//   bits 4: q uint8 [N, K/2]; within each group of 32 weights of a row, byte j holds
//           weight j in its low nibble and weight j + 16 in its high nibble;
//           scales, offsets float32 [N, K/group]: w = s q + o.
//   bits 8: q int8 [N, K]; scales float32 [N, K/group], offsets absent: w = s q.
// x bf16 [M, K] contiguous; returns bf16 [M, N].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HS_AVX512 1
#endif

namespace {

inline uint16_t bf16_bits(float f) {  // round to nearest even (weights are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef HS_AVX512
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

// One row of W (K weights) as bf16 into dst.
void dequant_row_int4(const uint8_t* q, const float* s, const float* o, int64_t K, int64_t group, uint16_t* dst) {
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const float scale = s[k0 / group], offset = o[k0 / group];
    const uint8_t* b = q + k0 / 2;
#ifdef HS_AVX512
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    __m512 vs = _mm512_set1_ps(scale), vo = _mm512_set1_ps(offset);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k0), bf16x16(_mm512_fmadd_ps(lo, vs, vo)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k0 + 16), bf16x16(_mm512_fmadd_ps(hi, vs, vo)));
#else
    for (int j = 0; j < 16; ++j) {
      dst[k0 + j] = bf16_bits(scale * static_cast<float>(b[j] & 15) + offset);
      dst[k0 + j + 16] = bf16_bits(scale * static_cast<float>(b[j] >> 4) + offset);
    }
#endif
  }
}

void dequant_row_int8(const int8_t* q, const float* s, int64_t K, int64_t group, uint16_t* dst) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const float scale = s[k0 / group];
#ifdef HS_AVX512
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k0))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k0), bf16x16(_mm512_mul_ps(w, _mm512_set1_ps(scale))));
#else
    for (int j = 0; j < 16; ++j) dst[k0 + j] = bf16_bits(scale * static_cast<float>(q[k0 + j]));
#endif
  }
}

at::Tensor dequant_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t tile_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), align = bits == 4 ? 32 : 16;
  TORCH_CHECK(K % align == 0 && group % align == 0 && K % group == 0, "K and the group must be multiples of ", align);
  TORCH_CHECK(q.is_contiguous() && q.size(1) == (bits == 4 ? K / 2 : K), "q: contiguous [N, K/2] (4 bits) or [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales: contiguous float32 [N, K/group]");
  TORCH_CHECK(bits == 8 || (offsets.has_value() && offsets->scalar_type() == at::kFloat &&
              offsets->is_contiguous() && offsets->sizes() == scales.sizes()), "offsets: float32 like scales");
  at::Tensor y = at::empty({M, N}, x.options());
  // tiles of at most tile_bytes, and at least two per thread where N allows (load balance)
  const int64_t balanced = (N + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t tile_rows = std::max<int64_t>(16, std::min(tile_bytes / (2 * K), balanced) / 16 * 16);
  const int64_t tiles = (N + tile_rows - 1) / tile_rows, groups = K / group;
  auto* yd = y.data_ptr<at::BFloat16>();  // written with memcpy: worker threads are not in the caller's InferenceMode
  const float* sd = scales.data_ptr<float>();
  const float* od = bits == 4 ? offsets->data_ptr<float>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> tile(tile_rows * K);  // bf16 [tile_rows, K]
    at::Tensor out = at::empty({M, tile_rows}, x.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, rows = std::min(tile_rows, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        if (bits == 4)
          dequant_row_int4(q.data_ptr<uint8_t>() + n * (K / 2), sd + n * groups, od + n * groups, K, group,
                           tile.data() + r * K);
        else
          dequant_row_int8(q.data_ptr<int8_t>() + n * K, sd + n * groups, K, group, tile.data() + r * K);
      }
      at::Tensor w = at::from_blob(tile.data(), {rows, K}, x.options());
      at::Tensor part = rows == tile_rows ? out : at::empty({M, rows}, x.options());
      at::mm_out(part, x, w.t());  // [M, rows]
      const auto* src = part.data_ptr<at::BFloat16>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(yd + m * N + n0, src + m * rows, rows * sizeof(at::BFloat16));
    }
  });
  return y;
}

// The layer's whole matmul: PyTorch's weight-only kernel up to `many_rows` rows (it reads
// the weight once, in its own layout: small_weight, small_scales), dequant_gemm above.
// One op, so that a compiled graph holds no branch on the row count.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group,
                        const at::Tensor& small_weight, const at::Tensor& small_scales, int64_t many_rows,
                        int64_t tile_bytes) {
  if (x.size(0) > many_rows) return dequant_gemm(x.contiguous(), q, scales, offsets, bits, group, tile_bytes);
  if (bits == 4) return at::_weight_int4pack_mm_for_cpu(x, small_weight, group, small_scales);
  return at::_weight_int8pack_mm(x, small_weight, small_scales);
}

}  // namespace

TORCH_LIBRARY(heterospec_cpu, m) {
  m.def("dequant_gemm(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int bits, int group, int tile_bytes) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int bits, int group, Tensor small_weight, "
        "Tensor small_scales, int many_rows, int tile_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterospec_cpu, CPU, m) {
  m.impl("dequant_gemm", &dequant_gemm);
  m.impl("quant_linear", &quant_linear);
}
