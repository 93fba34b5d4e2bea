// One Llama/Qwen2 decoder layer as one C++ call, for int4 weights in the kernel's layout (int4_vnni.cpp) and
// bfloat16 activations on x86-64 CPUs with AVX-512 VNNI or AVX2 + FMA (specstream.kernels.decoder_layer).
//
// A decode step of Qwen2.5-1.5B at int4 spends about 45 ms in the int4 products and, in the layer written as
// PyTorch operations, another 10-15 ms in about 50 small operations per layer (norms, RoPE, cache writes, casts,
// SiLU, residual adds) and their dispatch. Here the products (int4_vnni.cpp) and the attention (row_attention.cpp)
// are the same kernels, called from C++, and everything between them is plain loops over the rows. The idea is
// llama.cpp's: a forward is a graph of a few fused operations per layer, not an interpreter's worth of calls.
//
// Every step mirrors the PyTorch layer of stages/speculative/models/llama.py at bfloat16, rounding where it rounds:
//   h  = bf16(w1 * bf16(x * rsqrt(mean(x^2) + eps)))         RMSNorm, sums in float32 (16 lanes, fixed order)
//   qkv = int4(h) + bias                                     one fused product, bias added in float, rounded
//   q, k <- RoPE: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
//   the KV cache columns write_index[b, t] of slot slots[b] <- k, v (padding rows write zeros, as the padded
//   PyTorch layout does; non-finite values replaced as torch.nan_to_num when `sanitize`)
//   a  = bf16(row_attention(q, cache, mask, pos))            row-invariant attention
//   x1 = bf16(x + int4(a) + bias)
//   x2 = bf16(x1 + int4(bf16(bf16(silu(g)) * u)) + bias)     [g; u] = int4(RMSNorm(x1)) (+ bias)
// The float32 sums of the norms and the exp of SiLU are this file's, so the bits can differ from the PyTorch
// layer's in the last place; every row's work depends on that row alone (threads split rows, output channels or
// attention items, never one row's reduction), so the layer is row-invariant as its kernels are.
//
// Rows: x is [N, H], the real tokens of a batch of B rows padded to T (packed; rows[i] = b * T + t of row i), or
// all B * T tokens (rows = arange). The attention runs on the padded [B, T] layout, as in PyTorch.
#define SPECSTREAM_NO_MODULE
#include "int4_vnni.cpp"
#include "row_attention.cpp"
#undef SPECSTREAM_NO_MODULE

#include <cmath>
#include <limits>

namespace layer {
namespace {

using bf16 = at::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }
inline bf16 rnd(float v) { return bf16(v); }  // round to nearest even, PyTorch's float -> bf16

void check(bool ok, const char* what) { TORCH_CHECK(ok, "decoder_layer: ", what); }

// out[n] = bf16(w * bf16(x[n] * rsqrt(mean(x[n]^2) + eps)))
void rms_norm(const bf16* x, const bf16* w, int64_t N, int64_t H, float eps, bf16* out) {
  at::parallel_for(0, N, 4, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const bf16* xr = x + n * H;
      float lanes[16] = {0};
      for (int64_t i = 0; i < H; ++i) {
        const float v = f32(xr[i]);
        lanes[i & 15] += v * v;
      }
      float ss = 0.0f;
      for (int l = 0; l < 16; ++l) ss += lanes[l];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      bf16* o = out + n * H;
      for (int64_t i = 0; i < H; ++i) o[i] = rnd(f32(w[i]) * f32(rnd(f32(xr[i]) * r)));
    }
  });
}

// y[n, j] = bf16(y[n, j] + b[j])
void add_bias(bf16* y, const bf16* b, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) y[n * F + j] = rnd(f32(y[n * F + j]) + f32(b[j]));
}

inline bf16 finite(bf16 v, bool sanitize) {
  if (!sanitize) return v;
  const float x = f32(v);
  if (std::isnan(x)) return bf16(0.0f);
  if (std::isinf(x)) return x > 0 ? std::numeric_limits<bf16>::max() : std::numeric_limits<bf16>::lowest();
  return v;
}

// RoPE of one head (D values) in place of `out`: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
inline void rope(const bf16* x, const bf16* cos, const bf16* sin, int64_t D, bf16* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -f32(x[d + half]) : f32(x[d - half]);
    out[d] = rnd(f32(rnd(f32(x[d]) * f32(cos[d]))) + f32(rnd(rot * f32(sin[d]))));
  }
}

}  // namespace

// One decoder layer; returns (x' [N, H] bf16, q [B, Hq, T, D] bf16 after RoPE when `return_q`, else undefined).
std::tuple<torch::Tensor, torch::Tensor> decoder_layer(
    torch::Tensor x, torch::Tensor rows, int64_t B, int64_t T, torch::Tensor ln1, torch::Tensor ln2, double eps,
    torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b, torch::Tensor o_w, c10::optional<torch::Tensor> o_b,
    torch::Tensor gu_w, c10::optional<torch::Tensor> gu_b, torch::Tensor down_w,
    c10::optional<torch::Tensor> down_b, int64_t Hq, int64_t Hkv, int64_t D, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor write_index,
    torch::Tensor read_slots, int64_t read_first, torch::Tensor mask, torch::Tensor pos, double scale,
    bool sanitize, int64_t prefetch, bool return_q) {
  const auto bf = torch::kBFloat16;
  check(x.dim() == 2 && x.scalar_type() == bf && x.is_contiguous(), "x must be [N, H] contiguous bf16");
  const int64_t N = x.size(0), H = x.size(1), F = (Hq + 2 * Hkv) * D;
  check(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.size(0) == N && rows.is_contiguous(),
        "rows must be [N] int64");
  check(ln1.scalar_type() == bf && ln2.scalar_type() == bf && ln1.numel() == H && ln2.numel() == H &&
            ln1.is_contiguous() && ln2.is_contiguous(),
        "norm weights must be [H] bf16");
  check(cos.scalar_type() == bf && sin.scalar_type() == bf && cos.is_contiguous() && sin.is_contiguous() &&
            cos.numel() == B * T * D && sin.numel() == B * T * D,
        "cos and sin must be [B * T, D] contiguous bf16");
  check(k_cache.dim() == 4 && k_cache.scalar_type() == bf && v_cache.sizes() == k_cache.sizes() &&
            v_cache.scalar_type() == bf && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
            k_cache.size(1) == Hkv && k_cache.size(3) == D,
        "caches must be [slots, Hkv, L, D] bf16");
  check(slots.scalar_type() == torch::kInt64 && slots.numel() == B && write_index.scalar_type() == torch::kInt64 &&
            write_index.numel() == B * T && slots.is_contiguous() && write_index.is_contiguous(),
        "slots [B] and write_index [B, T] must be contiguous int64");
  check(D % 2 == 0 && Hq % Hkv == 0, "head sizes");
  for (const auto* b : {&qkv_b, &o_b, &gu_b, &down_b})
    check(!b->has_value() || ((*b)->scalar_type() == bf && (*b)->is_contiguous()), "biases must be bf16");
  check(!qkv_b || qkv_b->numel() == F, "the q/k/v bias must have (Hq + 2 Hkv) * D entries");
  check(!o_b || o_b->numel() == H, "the output bias must have H entries");
  check(!down_b || down_b->numel() == H, "the down bias must have H entries");
  const int64_t S = mask.size(-1);

  // 1. attention input norm, the fused q/k/v product
  auto h = torch::empty({N, H}, x.options());
  rms_norm(static_cast<const bf16*>(x.data_ptr()), static_cast<const bf16*>(ln1.data_ptr()), N, H,
           static_cast<float>(eps), static_cast<bf16*>(h.data_ptr()));
  auto qkv = int4::int4_mm(h, qkv_w, prefetch);
  check(qkv.size(1) == F, "the q/k/v product's width is not (Hq + 2 Hkv) * D");
  if (qkv_b) add_bias(static_cast<bf16*>(qkv.data_ptr()), static_cast<const bf16*>(qkv_b->data_ptr()), N, F);

  // 2. RoPE, the KV cache writes; q in the padded layout [B, T, Hq, D]
  auto q = torch::zeros({B, T, Hq, D}, x.options());
  const bf16* qkvp = static_cast<const bf16*>(qkv.data_ptr());
  const bf16* cp = static_cast<const bf16*>(cos.data_ptr());
  const bf16* sp = static_cast<const bf16*>(sin.data_ptr());
  bf16* qp = static_cast<bf16*>(q.data_ptr());
  bf16* kc = static_cast<bf16*>(k_cache.data_ptr());
  bf16* vc = static_cast<bf16*>(v_cache.data_ptr());
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const int64_t* wip = write_index.data_ptr<int64_t>();
  const int64_t c0 = k_cache.stride(0), c1 = k_cache.stride(1), c2 = k_cache.stride(2);
  const int64_t v0 = v_cache.stride(0), v1 = v_cache.stride(1), v2 = v_cache.stride(2);
  const int64_t L = k_cache.size(2), NS = k_cache.size(0);
  std::vector<char> real(B * T, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t p = rp[i];
    check(p >= 0 && p < B * T, "rows out of range");
    real[p] = 1;
    const int64_t b = p / T, slot = slp[b], col = wip[p];
    check(slot >= 0 && slot < NS && col >= 0 && col < L, "slot or cache column out of range");
    const bf16* row = qkvp + i * F;
    for (int64_t hh = 0; hh < Hq; ++hh) rope(row + hh * D, cp + p * D, sp + p * D, D, qp + (p * Hq + hh) * D);
    std::vector<bf16> tmp(D);
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      rope(row + (Hq + hh) * D, cp + p * D, sp + p * D, D, tmp.data());
      bf16* kd = kc + slot * c0 + hh * c1 + col * c2;
      bf16* vd = vc + slot * v0 + hh * v1 + col * v2;
      const bf16* vs = row + (Hq + Hkv + hh) * D;
      for (int64_t d = 0; d < D; ++d) {
        kd[d] = finite(tmp[d], sanitize);
        vd[d] = finite(vs[d], sanitize);
      }
    }
  }
  for (int64_t p = 0; p < B * T; ++p) {  // padding rows: zeros, at their (scratch) columns
    if (real[p]) continue;
    const int64_t slot = slp[p / T], col = wip[p];
    check(slot >= 0 && slot < NS && col >= 0 && col < L, "slot or cache column out of range");
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      std::fill_n(kc + slot * c0 + hh * c1 + col * c2, D, bf16(0.0f));
      std::fill_n(vc + slot * v0 + hh * v1 + col * v2, D, bf16(0.0f));
    }
  }

  // 3. attention over the first S columns of each row's read slot, then the output product
  torch::Tensor keys, values;
  if (read_first >= 0) {
    keys = k_cache.narrow(0, read_first, B).narrow(2, 0, S);
    values = v_cache.narrow(0, read_first, B).narrow(2, 0, S);
  } else {
    keys = k_cache.narrow(2, 0, S).index_select(0, read_slots);
    values = v_cache.narrow(2, 0, S).index_select(0, read_slots);
  }
  auto qh = q.permute({0, 2, 1, 3});  // [B, Hq, T, D], head dimension contiguous
  auto att = rowattn::row_attention(qh, keys, values, mask, pos, scale);  // [B, T, Hq, D] float32
  auto a = torch::empty({N, Hq * D}, x.options());
  const float* ap = att.data_ptr<float>();
  bf16* app = static_cast<bf16*>(a.data_ptr());
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < Hq * D; ++j) app[i * Hq * D + j] = rnd(ap[rp[i] * Hq * D + j]);
  auto o = int4::int4_mm(a, o_w, prefetch);
  check(o.size(1) == H, "the output projection's width is not H");
  if (o_b) add_bias(static_cast<bf16*>(o.data_ptr()), static_cast<const bf16*>(o_b->data_ptr()), N, H);
  auto x1 = torch::empty({N, H}, x.options());
  const bf16* xp = static_cast<const bf16*>(x.data_ptr());
  const bf16* op = static_cast<const bf16*>(o.data_ptr());
  bf16* x1p = static_cast<bf16*>(x1.data_ptr());
  for (int64_t i = 0; i < N * H; ++i) x1p[i] = rnd(f32(xp[i]) + f32(op[i]));

  // 4. the MLP: norm, [gate; up], SiLU(gate) * up, down, residual
  rms_norm(x1p, static_cast<const bf16*>(ln2.data_ptr()), N, H, static_cast<float>(eps),
           static_cast<bf16*>(h.data_ptr()));
  auto gu = int4::int4_mm(h, gu_w, prefetch);
  const int64_t I = gu.size(1) / 2;
  check(!gu_b || gu_b->numel() == 2 * I, "the gate/up bias must match the gate/up product");
  if (gu_b) add_bias(static_cast<bf16*>(gu.data_ptr()), static_cast<const bf16*>(gu_b->data_ptr()), N, 2 * I);
  auto act = torch::empty({N, I}, x.options());
  const bf16* gup = static_cast<const bf16*>(gu.data_ptr());
  bf16* actp = static_cast<bf16*>(act.data_ptr());
  at::parallel_for(0, N * I, 4096, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t n = e / I, j = e % I;
      const float g = f32(gup[n * 2 * I + j]);
      const float s = f32(rnd(g / (1.0f + std::exp(-g))));
      actp[e] = rnd(s * f32(gup[n * 2 * I + I + j]));
    }
  });
  auto dn = int4::int4_mm(act, down_w, prefetch);
  check(dn.size(1) == H, "the down projection's width is not H");
  if (down_b) add_bias(static_cast<bf16*>(dn.data_ptr()), static_cast<const bf16*>(down_b->data_ptr()), N, H);
  const bf16* dp = static_cast<const bf16*>(dn.data_ptr());
  for (int64_t i = 0; i < N * H; ++i) x1p[i] = rnd(f32(x1p[i]) + f32(dp[i]));
  return {x1, return_q ? qh : torch::Tensor()};
}

}  // namespace layer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &simd::parallel_threads, "threads at::parallel_for spreads n items over");
  m.attr("isa") = simd::kIsa;
  // the layer touches no Python object: other Python threads (the server's event loop) run meanwhile
  m.def("decoder_layer", &layer::decoder_layer, "one int4 decoder layer (see decoder_layer.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_mm", &int4::int4_mm, "the int4 product of int4_vnni.cpp", pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("prefetch") = int4::kPrefetchGroups, pybind11::arg("bias") = pybind11::none());
  m.def("row_attention", &rowattn::row_attention, "the row-invariant attention of row_attention.cpp");
}
