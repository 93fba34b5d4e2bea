// Vectors of 16 float32 lanes for specstream's CPU kernels (int4_vnni.cpp, row_attention.cpp), on AVX-512 (one
// zmm register) or on AVX2 + FMA (two ymm registers, lanes 0-7 and 8-15).
//
// The kernels are written once against these functions, and the compiler flags pick the instruction set
// (specstream.kernels.int4_vnni.ISAS). Every function does the same float operations in the same order on both:
// lane-wise arithmetic is lane-wise on both, reduce_add follows GCC's _mm512_reduce_add_ps tree (upper half plus
// lower half, then 128, 64 and 32 bits), and exp_nonpos scales by 2^n with one rounding as VSCALEFPS does. The
// kernels' order of operations, and so their row invariance, is the same on either instruction set.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>

namespace simd {

// exp(r) on |r| <= ln2 / 2 by its Taylor polynomial of degree 7, highest coefficient first (Horner)
constexpr float kExpTaylor[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                 1.0f / 6.0f,    0.5f,           1.0f,           1.0f};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPECSTREAM_AVX512 1
constexpr const char* kIsa = "avx512";

using F16 = __m512;

inline F16 zero() { return _mm512_setzero_ps(); }
inline F16 set1(float v) { return _mm512_set1_ps(v); }
inline F16 loadf(const float* p) { return _mm512_loadu_ps(p); }
inline void storef(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 add(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 sub(F16 a, F16 b) { return _mm512_sub_ps(a, b); }
inline F16 mul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 div(F16 a, F16 b) { return _mm512_div_ps(a, b); }
inline F16 fmadd(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline F16 fnmadd(F16 a, F16 b, F16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline F16 fmsub(F16 a, F16 b, F16 c) { return _mm512_fmsub_ps(a, b, c); }    // a * b - c
inline float reduce_add(F16 v) { return _mm512_reduce_add_ps(v); }

// 16 bfloat16 (raw uint16) -> float32
inline F16 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float32 -> bfloat16, round to nearest even (PyTorch's conversion), NaNs kept NaN
inline void store_bf16(uint16_t* p, F16 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// lanes n.. set to zero (n in 0..16)
inline F16 keep_first(F16 v, int64_t n) {
  const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
  return _mm512_maskz_mov_ps(live, v);
}

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 7 (relative error
// below 1e-8 on that range), times 2^n; below -103 (exp < 2^-148) the result is 0.
inline F16 exp_nonpos(F16 x) {
  const __m512 lo = _mm512_set1_ps(-103.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";

struct F16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F16 loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storef(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 add(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 sub(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 mul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fmsub(F16 a, F16 b, F16 c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }

// the order of GCC's _mm512_reduce_add_ps: (hi + lo), then its upper 128 bits plus its lower, then 64, then 32
inline float reduce_add(F16 v) {
  const __m256 s8 = _mm256_add_ps(v.hi, v.lo);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}

inline __m256 bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline F16 load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }

// 8 float32 -> 8 bfloat16 bit patterns in int32 lanes, round to nearest even, NaNs kept NaN
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store_bf16(uint16_t* p, F16 v) {
  // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7]; the permute puts them in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits(v.lo), bf16_bits(v.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

inline F16 keep_first(F16 v, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), idx);
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lo)), _mm256_and_ps(v.hi, _mm256_castsi256_ps(hi))};
}

// 2^k for integral k in -126..127, from its exponent bits
inline __m256 pow2(__m256 k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}

// the AVX-512 version's operations; p * 2^n with one rounding as VSCALEFPS: p * 2^(n + 32) is exact (n >= -149
// here), and the product with 2^-32 rounds once, into the subnormals where it falls there
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-103.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(p, pow2(_mm256_add_ps(n, _mm256_set1_ps(32.0f)))),
                                      _mm256_set1_ps(2.3283064365386963e-10f));  // 2^-32
  return _mm256_andnot_ps(tiny, scaled);
}
inline F16 exp_nonpos(F16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#else
#error "specstream's CPU kernels need AVX-512 (F, BW, VL, DQ) or AVX2 with FMA"
#endif

// How many threads at::parallel_for spreads n items over: 1 when the module was built without OpenMP (ATen's
// parallel_for is OpenMP pragmas in its headers, compiled into each extension), else up to torch's thread count.
// Each module exports it; specstream.kernels.int4_vnni.compile_extension checks it after every build.
inline int64_t parallel_threads(int64_t n) {
  std::mutex lock;
  std::set<std::thread::id> seen;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> hold(lock);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace simd
