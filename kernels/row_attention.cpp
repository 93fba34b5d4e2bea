// Row-invariant attention on x86-64 CPUs with AVX-512 or AVX2 + FMA (specstream.kernels.row_attention; the
// compiler flags pick the instruction set, simd16.h: the same operations in the same order on both).
// Built as part of decoder_layer.cpp's module, which exports it.
//
// One query row's output is a function of its own query and of the keys and values it may see, taken in the order
// of their positions, and of nothing else: not the other rows of the call, not how many cache columns the call
// reads, not whether the row's token sits in a token tree (its ancestors at node columns) or is decoded alone (its
// ancestors committed in place). Greedy speculative decoding at bfloat16 activations needs exactly that, so that
// the target's logits for a token are the same bits in a tree of 21 nodes as in plain decoding. The idea is the
// fixed reduction order of batch-invariant kernels (Thinking Machines, "Defeating Nondeterminism in LLM
// Inference", 2025); here each row simply owns its whole reduction:
//   1. its visible columns (mask), ordered by the position stored for each column (ties cannot occur: a row sees
//      each position once);
//   2. scores s_i = scale * <q, k_i>, each one dot of D/16 FMAs over 16 float32 lanes and one horizontal sum;
//   3. m = max_i s_i (exact, order-free), p_i = exp(s_i - m) by one fixed polynomial (simd::exp_nonpos),
//      l = sum of p_i with lane i mod 16 accumulating index i, then one horizontal sum;
//   4. o = sum_i p_i v_i in position order, FMAs over D lanes; out = o / l.
// Work items are (batch row, query row, key/value head), split over threads as whole items, so threads never
// share a reduction.
//
// Shapes (last dim contiguous, other strides free: the cache's slot views are read in place):
//   q      [B, Hq, T, D]  float32 or bfloat16
//   k, v   [B, Hkv, S, D] float32 or bfloat16 (the same dtype)
//   mask   [B, T, S]      bool, contiguous: column s visible to query row t
//   pos    [B, S]         int64, contiguous: the position held by each cache column
//   -> out [B, T, Hq, D]  float32 (a row with no visible column gives zeros)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "simd16.h"
#include <algorithm>
#include <cstdint>
#include <vector>

namespace rowattn {
namespace {

constexpr int kMaxChunks = 16;  // D up to 256

inline simd::F16 load16(const float* p) { return simd::loadf(p); }
inline simd::F16 load16(const at::BFloat16* p) { return simd::load_bf16(reinterpret_cast<const uint16_t*>(p)); }

template <typename QT, typename KT>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
            const torch::Tensor& pos, double scale_d, torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), G = Hq / Hkv, C = D / 16;
  const QT* qp = q.data_ptr<QT>();
  const KT* kp = k.data_ptr<KT>();
  const KT* vp = v.data_ptr<KT>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float scale = static_cast<float>(scale_d);
  at::parallel_for(0, B * T * Hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int64_t> cols;
    std::vector<float> scores;
    std::vector<float> qf(G * D);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (T * Hkv), t = (w / Hkv) % T, h = w % Hkv;
      float* orow = op + ((b * T + t) * Hq + h * G) * D;
      // 1. visible columns in position order (in place they already are; tree nodes may not be)
      cols.clear();
      const bool* mrow = mp + (b * T + t) * S;
      const int64_t* prow = pp + b * S;
      bool sorted = true;
      for (int64_t s = 0; s < S; ++s) {
        if (mrow[s]) {
          if (!cols.empty() && prow[s] < prow[cols.back()]) sorted = false;
          cols.push_back(s);
        }
      }
      if (!sorted)
        std::stable_sort(cols.begin(), cols.end(), [&](int64_t a, int64_t c) { return prow[a] < prow[c]; });
      const int64_t n = static_cast<int64_t>(cols.size());
      if (n == 0) {
        std::fill(orow, orow + G * D, 0.0f);
        continue;
      }
      const int64_t np = (n + 15) / 16 * 16;
      scores.resize(G * np);
      for (int64_t g = 0; g < G; ++g) {
        const QT* qrow = qp + b * qs0 + (h * G + g) * qs1 + t * qs2;
        for (int64_t c = 0; c < C; ++c) simd::storef(&qf[g * D + c * 16], load16(qrow + c * 16));
      }
      // 2. scores
      const KT* kbase = kp + b * ks0 + h * ks1;
      for (int64_t i = 0; i < n; ++i) {
        const KT* krow = kbase + cols[i] * ks2;
        simd::F16 kv[kMaxChunks];
        for (int64_t c = 0; c < C; ++c) kv[c] = load16(krow + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          simd::F16 acc = simd::mul(load16(qg), kv[0]);
          for (int64_t c = 1; c < C; ++c) acc = simd::fmadd(load16(qg + c * 16), kv[c], acc);
          scores[g * np + i] = simd::reduce_add(acc) * scale;
        }
      }
      // 3. softmax weights, 4. the weighted sum of values
      const KT* vbase = vp + b * vs0 + h * vs1;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * np];
        float m = sg[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
        const simd::F16 mv = simd::set1(m);
        simd::F16 lsum = simd::zero();
        for (int64_t i = 0; i < np; i += 16) {
          // lanes past n (the padding of the scores) give zeros
          const simd::F16 s = simd::keep_first(simd::loadf(sg + i), n - i);
          const simd::F16 p = simd::keep_first(simd::exp_nonpos(simd::sub(s, mv)), n - i);
          simd::storef(sg + i, p);
          lsum = simd::add(lsum, p);
        }
        const float l = simd::reduce_add(lsum);
        simd::F16 acc[kMaxChunks];
        for (int64_t c = 0; c < C; ++c) acc[c] = simd::zero();
        for (int64_t i = 0; i < n; ++i) {
          const KT* vrow = vbase + cols[i] * vs2;
          const simd::F16 p = simd::set1(sg[i]);
          for (int64_t c = 0; c < C; ++c) acc[c] = simd::fmadd(p, load16(vrow + c * 16), acc[c]);
        }
        const simd::F16 lv = simd::set1(l);
        for (int64_t c = 0; c < C; ++c) simd::storef(orow + g * D + c * 16, simd::div(acc[c], lv));
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "row_attention: ", what); }

torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, torch::Tensor pos,
                            double scale) {
  check(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-d");
  check(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v differ in shape or dtype");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  check(k.size(0) == B && k.size(3) == D, "k does not match q's batch or head size");
  check(Hq % k.size(1) == 0, "query heads are not a multiple of key/value heads");
  check(D % 16 == 0 && D / 16 <= kMaxChunks, "head size must be a multiple of 16, at most 256");
  check(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
  const int64_t S = k.size(2);
  check(mask.scalar_type() == torch::kBool && mask.dim() == 3 && mask.size(0) == B && mask.size(1) == T &&
            mask.size(2) == S,
        "mask must be bool [B, T, S]");
  check(pos.scalar_type() == torch::kInt64 && pos.dim() == 2 && pos.size(0) == B && pos.size(1) == S,
        "pos must be int64 [B, S]");
  mask = mask.contiguous();
  pos = pos.contiguous();
  auto out = torch::empty({B, T, Hq, D}, q.options().dtype(torch::kFloat32));
  if (B * T == 0) return out;
  const bool qbf = q.scalar_type() == torch::kBFloat16, kbf = k.scalar_type() == torch::kBFloat16;
  check(qbf || q.scalar_type() == torch::kFloat32, "q must be float32 or bfloat16");
  check(kbf || k.scalar_type() == torch::kFloat32, "k and v must be float32 or bfloat16");
  if (qbf && kbf) attend<at::BFloat16, at::BFloat16>(q, k, v, mask, pos, scale, out);
  else if (qbf) attend<at::BFloat16, float>(q, k, v, mask, pos, scale, out);
  else if (kbf) attend<float, at::BFloat16>(q, k, v, mask, pos, scale, out);
  else attend<float, float>(q, k, v, mask, pos, scale, out);
  return out;
}

}  // namespace
}  // namespace rowattn
