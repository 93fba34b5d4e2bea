// Int4 weight x int8 activation products on x86-64 CPUs with AVX-512 VNNI or AVX2 + FMA
// (specstream.kernels.int4_vnni; the compiler flags pick the instruction set, simd16.h).
//
// The idea is llama.cpp's for its Q4 x Q8 dot products: quantize each activation row to int8 once per call, one
// scale per group of 32 columns (as llama.cpp's Q8_0 blocks), multiply the 4-bit weight codes with it in integer
// arithmetic, and apply the float scales once per group. The weights are interleaved by blocks of 16 output
// channels, in the manner of llama.cpp's repacked "4x8" / "8x8" CPU layouts: the int32 lanes are output channels
// and an activation enters as 4 bytes broadcast to every lane. No horizontal sums are needed, and the unpacked
// codes of a block are used for up to 8 activation rows at a time, so an extra row (a token-tree node, a request
// of a batch) costs a few instructions per 512 weights.
//   AVX-512 VNNI: one 512-bit register holds 4 columns of 16 channels; VPDPBUSD multiplies unsigned code bytes by
//                 signed activation bytes and sums each 4 into an int32 lane.
//   AVX2:         two 256-bit registers (channels 0-7, 8-15); VPMADDUBSW and VPMADDWD give the same int32 sums
//                 (the comment at the AVX2 quantize_row), and the float work is the same operations in the same
//                 order, so both builds compute the same bits.
//
// Layouts (contiguous):
//   codes  [N/16, K/32, 4, 64] uint8  block b, group g, quarter j: byte 4c + i holds, for channel 16b + c,
//                                      column 32g + 8j + i in its low nibble and 32g + 8j + 4 + i in its high one
//   scales [N/16, K/32, 16] bf16       w = (q - 8) * scale + zero, q in 0..15 (PyTorch's int4 convention)
//   zeros  [N/16, K/32, 16] bf16
//   x      [M, K] bf16 (or float32)    -> y [M, N] bf16 (float32)
//
// Row invariance: every activation row goes through the same instructions in the same order whatever M is and
// whichever rows share its tile, and threads split output channels only (never K), so a row's result does not
// depend on the rows beside it. Speculative verification relies on this: the target's bits for a token are the
// same in a tree of 21 nodes and alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "simd16.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace int4 {
namespace {

constexpr int64_t kGroup = 32;   // input columns per scale (weights and activations)
constexpr int64_t kLanes = 16;   // output channels per block
constexpr int kMaxTile = 8;      // activation rows per pass over a block's codes
constexpr int64_t kChunkBytes = 96 * 1024;  // int8 activation bytes of the rows a thread's blocks pass over at once
constexpr int64_t kChunkWeightBytes = 1 << 20;  // packed weights up to this size take the rows in chunks
constexpr int64_t kGroupBytes = 320;  // one group of a block: 256 bytes of codes, 16 bf16 scales, 16 bf16 zeros
// Software prefetch distance, groups of one block ahead: 0 (none, the hardware prefetcher alone) or 8. Which
// streams faster depends on the CPU (on this project's 2-core AMD EPYC, none: 4-10 % faster on one row); the Python side
// times both once per process and passes its choice (int4_vnni.prefetch_distance)
constexpr int64_t kPrefetchGroups = 8;

#if defined(SPECSTREAM_AVX512) && defined(__AVX512VNNI__)
// One activation row: codes q [K] int8, per group of 32 the scale d[g] = amax / 127 and the scaled code sum
// gsum[g] = d[g] * sum(q in g) (the zero-point term).
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* d, float* gsum) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const __m512 v0 = simd::load_bf16(x + g * kGroup), v1 = simd::load_bf16(x + g * kGroup + 16);
    const bool nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // a NaN in the group makes its scale NaN (the output NaN, as a float kernel gives); below 127 / FLT_MAX
    // the inverse would overflow, and such a group counts as zero
    const float dd = nan ? std::numeric_limits<float>::quiet_NaN() : m / 127.0f;
    const __m512 inv = _mm512_set1_ps(!nan && m > 127.0f / std::numeric_limits<float>::max() ? 127.0f / m : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even (MXCSR default)
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtsepi32_epi8(i1));
    d[g] = dd;
    gsum[g] = nan ? dd : dd * float(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The unpacked codes of one group of a block: quarter j's low and high nibbles
struct Codes {
  __m512i lo[4], hi[4];
};

inline Codes unpack(const uint8_t* wg) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  Codes c;
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(wg + j * 64);
    c.lo[j] = _mm512_and_si512(v, nib);
    c.hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  }
  return c;
}

// the 16 channels' integer dot products with the 32 int8 codes x of one group, as float
inline simd::F16 dot(const Codes& c, const int8_t* x) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    a = _mm512_dpbusd_epi32(a, c.lo[j], bcast4(x + 8 * j));
    b = _mm512_dpbusd_epi32(b, c.hi[j], bcast4(x + 8 * j + 4));
  }
  return _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
}

// One block of 16 output channels for R activation rows: out[r * o_stride + c], float.
template <int R, int PF>
inline void block(const uint8_t* w, const int8_t* xq, const float* xd, const float* xg, int64_t K, float* out,
                  int64_t o_stride) {
  const int64_t G = K / kGroup;
  const simd::F16 eight = simd::set1(8.0f);
  simd::F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * kGroupBytes;
    if constexpr (PF > 0)
      for (int l = 0; l < 5; ++l)  // the group PF ahead (5 cache lines)
        _mm_prefetch(reinterpret_cast<const char*>(wg + PF * kGroupBytes + 64 * l), _MM_HINT_T0);
    const Codes c = unpack(wg);
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(wg + 256);
    const simd::F16 sc = simd::load_bf16(sz);
    const simd::F16 off = simd::fmsub(eight, sc, simd::load_bf16(sz + kLanes));  // w = scale * q - off
    for (int r = 0; r < R; ++r) {
      const simd::F16 t = dot(c, xq + r * K + g * kGroup);
      acc[r] = simd::fmadd(t, simd::mul(sc, simd::set1(xd[r * G + g])), acc[r]);
      acc[r] = simd::fnmadd(off, simd::set1(xg[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) simd::storef(out + r * o_stride, acc[r]);
}

#elif !defined(SPECSTREAM_AVX512)
// AVX2: the same integers as the VNNI path. VPMADDUBSW multiplies code and activation bytes and sums pairs into
// int16 lanes; the 8 products of a channel's 4-column quarter (4 low-nibble and 4 high-nibble pairs) stay below
// 8 * 2 * 15 * 128 = 30720 < 32767, so no sum saturates, and VPMADDWD with ones sums neighbouring pairs into the
// int32 lanes VPDPBUSD gives. The float work after it is the same operations in the same order.
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* d, float* gsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint16_t* xg = x + g * kGroup;
    const __m256 v[4] = {simd::bf16x8(xg), simd::bf16x8(xg + 8), simd::bf16x8(xg + 16), simd::bf16x8(xg + 24)};
    int nanbits = 0;
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      nanbits |= _mm256_movemask_ps(_mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
    const bool nan = nanbits != 0;
    const float dd = nan ? std::numeric_limits<float>::quiet_NaN() : m / 127.0f;
    const __m256 inv = _mm256_set1_ps(!nan && m > 127.0f / std::numeric_limits<float>::max() ? 127.0f / m : 0.0f);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
    // saturating int32 -> int16 -> int8 (as VPMOVSDB); the packs interleave 128-bit lanes, the permute undoes it
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm256_permutevar8x32_epi32(b, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(s8, 1), _mm256_castsi256_si128(s8));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    const int32_t sum = _mm_cvtsi128_si32(s4) + _mm_cvtsi128_si32(_mm_shuffle_epi32(s4, 1));
    d[g] = dd;
    gsum[g] = nan ? dd : dd * float(sum);
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One block of 16 output channels for R activation rows: out[r * o_stride + c], float. Quarter j of both halves
// (4 registers of codes) serves every row before the next quarter is loaded, and each broadcast activation word
// serves both halves.
template <int R, int PF>
inline void block(const uint8_t* w, const int8_t* xq, const float* xd, const float* xg, int64_t K, float* out,
                  int64_t o_stride) {
  const int64_t G = K / kGroup;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * kGroupBytes;
    if constexpr (PF > 0)
      for (int l = 0; l < 5; ++l)  // the group PF ahead (5 cache lines)
        _mm_prefetch(reinterpret_cast<const char*>(wg + PF * kGroupBytes + 64 * l), _MM_HINT_T0);
    __m256i sum[R][2];
    for (int j = 0; j < 4; ++j) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + 32));
      const __m256i lo0 = _mm256_and_si256(v0, nib), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
      const __m256i lo1 = _mm256_and_si256(v1, nib), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + r * K + g * kGroup + 8 * j;
        const __m256i bl = bcast4(x), bh = bcast4(x + 4);
        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh));
        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh));
        sum[r][0] = j == 0 ? p0 : _mm256_add_epi16(sum[r][0], p0);
        sum[r][1] = j == 0 ? p1 : _mm256_add_epi16(sum[r][1], p1);
      }
    }
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(wg + 256);
    for (int h = 0; h < 2; ++h) {
      const __m256 sc = simd::bf16x8(sz + 8 * h);
      const __m256 off = _mm256_fmsub_ps(eight, sc, simd::bf16x8(sz + kLanes + 8 * h));  // w = scale * q - off
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(t, _mm256_mul_ps(sc, _mm256_set1_ps(xd[r * G + g])), acc[r][h]);
        acc[r][h] = _mm256_fnmadd_ps(off, _mm256_set1_ps(xg[r * G + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * o_stride, acc[r][0]);
    _mm256_storeu_ps(out + r * o_stride + 8, acc[r][1]);
  }
}

#else
#error "int4_vnni.cpp on AVX-512 needs VNNI (-mavx512vnni); build it for AVX2 otherwise"
#endif


using BlockFn = void (*)(const uint8_t*, const int8_t*, const float*, const float*, int64_t, float*, int64_t);
template <int PF>
struct Blocks {
  static constexpr BlockFn fn[kMaxTile] = {block<1, PF>, block<2, PF>, block<3, PF>, block<4, PF>,
                                           block<5, PF>, block<6, PF>, block<7, PF>, block<8, PF>};
};

void check(bool ok, const char* what) { TORCH_CHECK(ok, "int4_vnni: ", what); }

}  // namespace

// y [M, N] = x [M, K] @ ((codes - 8) * scales + zeros)^T (+ bias), layout above. x bf16 gives y bf16; x float32
// is rounded to bf16 as it is read (round to nearest even, as PyTorch's conversion: the same activation codes as
// x.to(bfloat16) would give) and gives y float32, the accumulator itself, plus the optional bias [N] float32
// (no rounding to bf16 in between: a float32 model keeps its activations in float32 around the product).
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor packed, int64_t prefetch,
                      c10::optional<torch::Tensor> bias = c10::nullopt) {
  check(prefetch == 0 || prefetch == kPrefetchGroups, "prefetch must be 0 or 8");
  check(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  const bool f32 = x.scalar_type() == torch::kFloat;
  check(x.dim() == 2 && (f32 || x.scalar_type() == torch::kBFloat16) && x.is_contiguous(),
        "x must be [M, K] contiguous bf16 or float32");
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  check(K % kGroup == 0, "K must be a multiple of 32");
  check(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
            packed.size(1) == G && packed.size(2) == kGroupBytes,
        "packed must be [N/16, K/32, 320] contiguous uint8");
  const int64_t B = packed.size(0), N = B * kLanes;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check(f32, "a bias is added in the float32 product only");
    check(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N &&
              bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
          "bias must be [N] contiguous float32 on the CPU (N: the packed output channels)");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, G}, x.options().dtype(torch::kFloat));
  auto xg = torch::empty({M, G}, x.options().dtype(torch::kFloat));
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xdp = xd.data_ptr<float>();
  float* xgp = xg.data_ptr<float>();
  if (f32) {
    const float* xf = x.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      std::vector<uint16_t> row(K);
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t k = 0; k < K; k += kLanes) simd::store_bf16(row.data() + k, simd::loadf(xf + m * K + k));
        quantize_row(row.data(), K, xqp + m * K, xdp + m * G, xgp + m * G);
      }
    });
  } else {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, xqp + m * K, xdp + m * G, xgp + m * G);
    });
  }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  uint16_t* yp = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr());
  float* yf = f32 ? y.data_ptr<float>() : nullptr;
  const BlockFn* blocks = prefetch ? Blocks<kPrefetchGroups>::fn : Blocks<0>::fn;
  // A small weight (it stays in cache, read again per chunk at little cost) times many rows (Whisper's encoder:
  // 1500): the rows in chunks whose int8 activations stay in a core's L2 cache while the thread's blocks pass over
  // them. Otherwise each block reads all M rows, and at M = 1500 the activations stream from L3 once per block.
  // A large weight (the Llama layers) keeps one chunk of all rows: its codes, not the activations, must be read
  // once. The order of the loops changes no result (each output is one row's own sum, in the same order).
  const int64_t chunk = K > 0 && B * G * kGroupBytes <= kChunkWeightBytes
                            ? std::max<int64_t>(kMaxTile, kChunkBytes / K / kMaxTile * kMaxTile)
                            : M;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    float tile[kMaxTile * kLanes];
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
     const int64_t m1 = std::min(M, m0 + chunk);
     for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = wp + b * G * kGroupBytes;
      for (int64_t m = m0; m < m1; m += kMaxTile) {
        const int rows = int(std::min<int64_t>(kMaxTile, m1 - m));
        blocks[rows - 1](wb, xqp + m * K, xdp + m * G, xgp + m * G, K, tile, kLanes);
        for (int r = 0; r < rows; ++r) {
          const simd::F16 t = simd::loadf(tile + r * kLanes);
          if (f32)
            simd::storef(yf + (m + r) * N + b * kLanes, bp ? simd::add(t, simd::loadf(bp + b * kLanes)) : t);
          else
            simd::store_bf16(yp + (m + r) * N + b * kLanes, t);
        }
      }
     }
    }
  });
  return y;
}

}  // namespace int4

// decoder_layer.cpp includes this file and defines its own module
#ifndef SPECSTREAM_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &simd::parallel_threads, "threads at::parallel_for spreads n items over");
  m.attr("isa") = simd::kIsa;
  m.def("int4_mm", &int4::int4_mm,
        "y[M,N] = x[M,K] @ ((codes - 8) * scales + zeros)^T (+ bias): bf16 -> bf16, float32 -> float32",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("prefetch") = int4::kPrefetchGroups,
        pybind11::arg("bias") = pybind11::none());
}
#endif
