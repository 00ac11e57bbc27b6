// MoE ops on the CPU: routing (permute / unpermute), grouped SwiGLU and the grouped / dual GEMMs. GEMMs run
// through ATen in the accumulation dtype (fp32 for 16-bit inputs) and are rounded once.
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <sptr/dispatch.h>

#include <cmath>

#include "moe_host.h"

namespace sptr {
namespace {

at::ScalarType acc_type(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Row range of group g, clamped into [0, R] (bad offsets stay in bounds).
std::pair<int64_t, int64_t> group_rows(const int64_t* off, int64_t g, int64_t R) {
  const int64_t lo = std::min(std::max<int64_t>(off[g], 0), R);
  return {lo, std::min(std::max(off[g + 1], lo), R)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_cpu(const at::Tensor& x,
                                                                           const at::Tensor& expert_ids,
                                                                           int64_t num_experts,
                                                                           int64_t num_out_tokens, int64_t align) {
  const int64_t K = check_permute_args(x, expert_ids, num_experts, num_out_tokens, align);
  const int64_t T = x.size(0), H = x.size(1), slots = T * K, E = num_experts;
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0);
  for (int64_t s = 0; s < slots; ++s)
    if (id[s] >= 0 && id[s] < E) ++count[id[s]];
  // start[e]: first position of expert e in the global sorted order; the first num_out_tokens positions stay.
  std::vector<int64_t> start(E + 1, 0), base(E, 0);
  auto tokens_per_expert = at::empty({E}, x.options().dtype(at::kLong));
  auto offsets = at::empty({E + 1}, x.options().dtype(at::kLong));
  int64_t* kept = tokens_per_expert.mutable_data_ptr<int64_t>();
  int64_t* off = offsets.mutable_data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    start[e + 1] = start[e] + count[e];
    kept[e] = std::min(std::max<int64_t>(num_out_tokens - start[e], 0), count[e]);
    off[e + 1] = off[e] + (kept[e] + align - 1) / align * align;
  }
  auto row_id_map = at::empty({slots}, x.options().dtype(at::kInt));
  int32_t* map = row_id_map.mutable_data_ptr<int32_t>();
  auto x_perm = at::zeros({permuted_rows(num_out_tokens, E, align), H}, x.options());
  std::vector<int64_t> rank(E, 0);
  std::vector<std::pair<int64_t, int64_t>> copies;  // (row, token)
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t t = s / K, k = s % K, e = id[s];
    int32_t row = -1;
    if (e >= 0 && e < E) {
      const int64_t r = rank[e]++;
      if (r < kept[e]) row = static_cast<int32_t>(off[e] + r);
    }
    map[k * T + t] = row;
    if (row >= 0) copies.emplace_back(row, t);
  }
  if (!copies.empty()) {
    auto rows = at::empty({static_cast<int64_t>(copies.size())}, x.options().dtype(at::kLong));
    auto toks = at::empty_like(rows);
    for (size_t i = 0; i < copies.size(); ++i) {
      rows.mutable_data_ptr<int64_t>()[i] = copies[i].first;
      toks.mutable_data_ptr<int64_t>()[i] = copies[i].second;
    }
    x_perm.index_copy_(0, rows, x.index_select(0, toks));
  }
  return {x_perm, row_id_map, tokens_per_expert, offsets};
}

at::Tensor moe_unpermute_fwd_cpu(const at::Tensor& x_perm, const at::Tensor& row_id_map,
                                 const c10::optional<at::Tensor>& probs, int64_t T) {
  const int64_t K = check_unpermute_args(x_perm, row_id_map, probs, T);
  const int64_t H = x_perm.size(1), R = x_perm.size(0);
  auto out = at::empty({T, H}, x_perm.options());
  const at::Tensor y = x_perm.contiguous(), w = combine_weights(probs, x_perm), map = row_id_map.contiguous();
  SPTR_DISPATCH_FLOATING(y.scalar_type(), "moe_unpermute_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const acc_t* wp = w.defined() ? w.const_data_ptr<acc_t>() : nullptr;
    const int32_t* mp = map.const_data_ptr<int32_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = mp[k * T + t];
          if (r < 0 || r >= R) continue;
          const acc_t wk = wp ? wp[t * K + k] : acc_t(1);
          for (int64_t h = 0; h < H; ++h) acc[h] += wk * static_cast<acc_t>(yp[r * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) op[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_bwd_cpu(const at::Tensor& grad, const at::Tensor& x_perm,
                                                         const at::Tensor& row_id_map,
                                                         const c10::optional<at::Tensor>& probs, bool probs_grad) {
  const int64_t T = grad.size(0);
  const int64_t K = check_unpermute_args(x_perm, row_id_map, probs, T);
  SPTR_CHECK_VALUE(grad.dim() == 2 && grad.size(1) == x_perm.size(1), "grad must be [T, H] with H = ",
                    x_perm.size(1), ", got ", grad.sizes());
  SPTR_CHECK_SAME_DTYPE(grad, x_perm);
  const int64_t H = x_perm.size(1), R = x_perm.size(0);
  auto grad_perm = at::zeros({R, H}, x_perm.options());
  const bool want_pg = probs_grad && probs.has_value();
  auto grad_probs = at::zeros({want_pg ? T : 0, want_pg ? K : 0}, x_perm.options().dtype(acc_type(x_perm)));
  const at::Tensor g = grad.contiguous(), y = x_perm.contiguous(), w = combine_weights(probs, x_perm),
                   map = row_id_map.contiguous();
  SPTR_DISPATCH_FLOATING(y.scalar_type(), "moe_unpermute_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const acc_t* wp = w.defined() ? w.const_data_ptr<acc_t>() : nullptr;
    const int32_t* mp = map.const_data_ptr<int32_t>();
    scalar_t* dp = grad_perm.mutable_data_ptr<scalar_t>();
    acc_t* pg = want_pg ? grad_probs.mutable_data_ptr<acc_t>() : nullptr;
    // Each token owns its rows (a row belongs to one slot), so tokens run in parallel without races.
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = mp[k * T + t];
          if (r < 0 || r >= R) continue;
          const acc_t wk = wp ? wp[t * K + k] : acc_t(1);
          acc_t dot = 0;
          for (int64_t h = 0; h < H; ++h) {
            const acc_t gv = static_cast<acc_t>(gp[t * H + h]);
            dp[r * H + h] = static_cast<scalar_t>(wk * gv);
            dot += gv * static_cast<acc_t>(yp[r * H + h]);
          }
          if (pg) pg[t * K + k] = dot;
        }
    });
  });
  return {grad_perm, grad_probs};
}

// f(r, w) for every row r of every group (width w), groups in order, rows of a group in parallel.
template <typename F>
void for_each_group_row(const at::Tensor& offsets, at::IntArrayRef widths, int64_t R, const F& f) {
  const at::Tensor off = offsets.contiguous();
  for (size_t g = 0; g < widths.size(); ++g) {
    const auto [lo, hi] = group_rows(off.const_data_ptr<int64_t>(), g, R);
    at::parallel_for(lo, hi, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) f(r, widths[g]);
    });
  }
}

template <typename acc_t>
acc_t silu(acc_t g) {
  return g / (acc_t(1) + std::exp(-g));
}

at::Tensor moe_swiglu_fwd_cpu(const at::Tensor& h, const at::Tensor& offsets, at::IntArrayRef widths) {
  check_swiglu_args(h, offsets, widths);
  const int64_t R = h.size(0), W = max_width(widths), ld = h.size(1);
  auto out = at::zeros({R, W}, h.options());
  const at::Tensor hc = h.contiguous();
  SPTR_DISPATCH_FLOATING(h.scalar_type(), "moe_swiglu_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* hp = hc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_group_row(offsets, widths, R, [&](int64_t r, int64_t w) {
      for (int64_t j = 0; j < w; ++j) {
        const acc_t gate = static_cast<acc_t>(hp[r * ld + j]), up = static_cast<acc_t>(hp[r * ld + w + j]);
        op[r * W + j] = static_cast<scalar_t>(silu(gate) * up);
      }
    });
  });
  return out;
}

at::Tensor moe_swiglu_bwd_cpu(const at::Tensor& grad, const at::Tensor& h, const at::Tensor& offsets,
                              at::IntArrayRef widths) {
  check_swiglu_args(h, offsets, widths);
  const int64_t R = h.size(0), W = max_width(widths), ld = h.size(1);
  SPTR_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == R && grad.size(1) == W, "grad must be [", R, ", ", W,
                    "], got ", grad.sizes());
  SPTR_CHECK_SAME_DTYPE(grad, h);
  auto dh = at::zeros({R, ld}, h.options());
  const at::Tensor hc = h.contiguous(), gc = grad.contiguous();
  SPTR_DISPATCH_FLOATING(h.scalar_type(), "moe_swiglu_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* hp = hc.const_data_ptr<scalar_t>();
    const scalar_t* gp = gc.const_data_ptr<scalar_t>();
    scalar_t* dp = dh.mutable_data_ptr<scalar_t>();
    for_each_group_row(offsets, widths, R, [&](int64_t r, int64_t w) {
      for (int64_t j = 0; j < w; ++j) {
        const acc_t gate = static_cast<acc_t>(hp[r * ld + j]), up = static_cast<acc_t>(hp[r * ld + w + j]);
        const acc_t d = static_cast<acc_t>(gp[r * W + j]);
        const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-gate));
        dp[r * ld + j] = static_cast<scalar_t>(d * up * sig * (acc_t(1) + gate * (acc_t(1) - sig)));
        dp[r * ld + w + j] = static_cast<scalar_t>(d * gate * sig);
      }
    });
  });
  return dh;
}

at::Tensor moe_grouped_linear_cpu(const at::Tensor& x, at::TensorList weights, const at::Tensor& offsets) {
  const int64_t width = check_grouped_linear_args(x, weights, offsets);
  const int64_t R = x.size(0), G = offsets.numel() - 1, P = weights.size() / G;
  auto out = at::zeros({R, width}, x.options());
  const at::Tensor off = offsets.contiguous();
  for (int64_t g = 0; g < G; ++g) {
    const auto [lo, hi] = group_rows(off.const_data_ptr<int64_t>(), g, R);
    if (hi == lo) continue;
    const at::Tensor xs = x.slice(0, lo, hi).slice(1, 0, weights[g * P].size(1)).to(acc_type(x));
    int64_t col = 0;
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& w = weights[g * P + p];
      out.slice(0, lo, hi).slice(1, col, col + w.size(0)).copy_(at::mm(xs, w.to(acc_type(x)).t()));
      col += w.size(0);
    }
  }
  return out;
}

std::vector<at::Tensor> moe_grouped_linear_wgrad_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& offsets, at::IntArrayRef out_features,
                                                     at::IntArrayRef in_features) {
  check_wgrad_args(grad, x, offsets, out_features, in_features);
  const int64_t R = x.size(0), G = offsets.numel() - 1;
  const at::Tensor off = offsets.contiguous();
  std::vector<at::Tensor> dw;
  for (int64_t g = 0; g < G; ++g) {
    const auto [lo, hi] = group_rows(off.const_data_ptr<int64_t>(), g, R);
    const at::Tensor gs = grad.slice(0, lo, hi).slice(1, 0, out_features[g]).to(acc_type(x));
    const at::Tensor xs = x.slice(0, lo, hi).slice(1, 0, in_features[g]).to(acc_type(x));
    dw.push_back(at::mm(gs.t(), xs).to(x.scalar_type()));
  }
  return dw;
}

void dual_gemm_out_cpu(const at::Tensor& a0, const at::Tensor& a1, const at::Tensor& w0, const at::Tensor& w1,
                       bool trans_a, bool trans_b, const at::Tensor& c0, const at::Tensor& c1) {
  check_dual_args(a0, a1, w0, w1);
  const at::Tensor* as[2] = {&a0, &a1};
  const at::Tensor* ws[2] = {&w0, &w1};
  const at::Tensor* cs[2] = {&c0, &c1};
  for (int e = 0; e < 2; ++e) {
    const DualShape s = dual_shape(*as[e], *ws[e], trans_a, trans_b, e);
    check_dual_out(*cs[e], s, a0, e, {&a0, &a1, &w0, &w1});
    const at::Tensor A = (trans_a ? as[e]->t() : *as[e]).to(acc_type(a0));
    const at::Tensor B = (trans_b ? ws[e]->t() : *ws[e]).to(acc_type(a0));
    cs[e]->copy_(at::mm(A, B));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(sptr, CPU, m) {
  m.impl("moe_permute", &moe_permute_cpu);
  m.impl("moe_unpermute_fwd", &moe_unpermute_fwd_cpu);
  m.impl("moe_unpermute_bwd", &moe_unpermute_bwd_cpu);
  m.impl("moe_swiglu_fwd", &moe_swiglu_fwd_cpu);
  m.impl("moe_swiglu_bwd", &moe_swiglu_bwd_cpu);
  m.impl("moe_grouped_linear", &moe_grouped_linear_cpu);
  m.impl("moe_grouped_linear_wgrad", &moe_grouped_linear_wgrad_cpu);
  m.impl("dual_gemm", &dual_gemm_alloc<dual_gemm_out_cpu>);
  m.impl("dual_gemm_out", &dual_gemm_out_cpu);
}

}  // namespace sptr
