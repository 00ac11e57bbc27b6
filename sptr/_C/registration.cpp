// Every schema of the sptr library, in one place. Device files only add TORCH_LIBRARY_IMPL blocks, so a
// CPU-only build registers every op with its CPU kernel.
#include <Python.h>
#include <torch/library.h>

// Importable as a Python module (sptr._C._kernels) so the loader can find it like any extension; the ops
// themselves are reached through torch.ops.sptr.
extern "C" {
PyMODINIT_FUNC PyInit__kernels(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module);
#ifdef SPTR_WITH_SM90A
  constexpr int sm90a = 1;
#else
  constexpr int sm90a = 0;
#endif
  // Whether the CUTLASS (sm_90a) grouped GEMM was built: sptr._C.has_sm90_grouped_gemm().
  if (m != nullptr && PyModule_AddIntConstant(m, "built_with_sm90a", sm90a) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}

TORCH_LIBRARY(sptr, m) {
  // Window attention (SparseTransformer pair layout). Pair ops take int32/int64 indices and
  // int8/16/32/64 rel_idx; absent tables give empty gradient tensors.
  m.def("window_precompute_all(Tensor counts, int num_points) -> (Tensor, Tensor, Tensor, Tensor)");
  // The int64 window cell key of each point (torch_cluster's grid rule; the origin is `start`, else the column
  // minima; `shift` moves the points by half a cell), and from the keys (stable window-major order, int32
  // window offsets (W+1)).
  m.def("window_cells(Tensor xyz, Tensor batch, Tensor size, Tensor? start, bool shift) -> Tensor");
  m.def("window_sort(Tensor cells) -> (Tensor, Tensor)");
  // Each point's int32 quantisation cell inside its window (float32 sizes), in `order` (window order) if given.
  m.def("window_quantised_coords(Tensor xyz, Tensor? order, Tensor window_size, Tensor quant_size, bool shift) -> "
        "Tensor");
  // SphereFormer's (θ, β, r) of each point (N, 3) in xyz's dtype, torch's ops to the bit; differentiable through
  // those ops when xyz requires grad.
  m.def("cart2sphere(Tensor xyz) -> Tensor");
  // LayerNorm over the last dimension: (y, mean, rstd), statistics [rows] in the op-math type; the backward
  // gives (dx, dweight, dbias), the last two empty where there is no weight / bias.
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, bool has_bias) -> "
      "(Tensor, Tensor, Tensor)");
  // out[dest[i]] = x[i] for a permutation dest with inverse source (q/k/v into window order and back); the
  // gradient is the same op with dest and source swapped.
  m.def("window_permute_rows(Tensor x, Tensor dest, Tensor source, ScalarType? dtype=None) -> Tensor");
  m.def(
      "window_pair_logits_fwd(Tensor q, Tensor k, Tensor index_0, Tensor index_1, Tensor? table_q, "
      "Tensor? table_k, Tensor? rel_idx, bool with_qk) -> Tensor");
  m.def(
      "window_pair_logits_bwd(Tensor grad, Tensor q, Tensor k, Tensor index_0, Tensor index_1, Tensor? table_q, "
      "Tensor? table_k, Tensor? rel_idx, bool with_qk) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "window_aggregate_fwd(Tensor attn, Tensor v, Tensor index_0_offsets, Tensor index_1, Tensor? table_v, "
      "Tensor? rel_idx) -> Tensor");
  m.def(
      "window_aggregate_bwd(Tensor grad, Tensor attn, Tensor v, Tensor index_0, Tensor index_0_offsets, "
      "Tensor index_1, Tensor? table_v, Tensor? rel_idx) -> (Tensor, Tensor, Tensor)");
  m.def("window_softmax_fwd(Tensor src, Tensor indptr) -> Tensor");
  m.def("window_softmax_bwd(Tensor grad, Tensor out, Tensor indptr) -> Tensor");

  // Fused window attention: tokens sorted by window, window_offsets (W+1) in CSR form. Optional
  // relative-position tables (L,3,h,d) indexed from per-token int32 coords (N,3) (rel = c_i - c_j + rel_shift;
  // column 2 from the radius (N,) by exponential bins of radial_a when given). lse: (N,h) in the accumulation
  // dtype. `deterministic` is for the backward (the forward saves it); the backward returns empty table
  // gradients for absent tables.
  m.def(
      "window_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor window_offsets, Tensor? coords, Tensor? radius, "
      "Tensor? table_q, Tensor? table_k, Tensor? table_v, int rel_shift, float radial_a, float scale, "
      "bool deterministic) -> (Tensor, Tensor)");
  m.def(
      "window_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor window_offsets, Tensor? coords, Tensor? radius, Tensor? table_q, Tensor? table_k, Tensor? table_v, "
      "int rel_shift, float radial_a, float scale, bool deterministic) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  // Multimodal RoPE. mrope_section is the undoubled [t, h, w] split of head_dim / 2 (empty: cos/sin are
  // already composed, shape [B, S, D]); hf_layout selects HF's per-half streams, else Wall-X's contiguous ones.
  // promote: fp16/bf16 q, k with fp32 tables give fp32 results (type promotion, the tables unrounded); the
  // backward then takes fp32 gradients and returns them in input_dtype. Otherwise tables are cast to q's dtype.
  m.def(
      "mrope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout, "
      "bool promote=False) "
      "-> (Tensor, Tensor)");
  m.def(
      "mrope_fwd_out(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout, "
      "Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.def(
      "mrope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout) -> ()");
  // mrope_ of q_base.as_strided(q_size, q_stride) and k_base.as_strided(k_size, k_stride), views that cover
  // their contiguous bases: autograd records the bases as modified (no gradient copies for the views).
  m.def(
      "mrope_rebased_(Tensor(a!) q_base, Tensor(b!) k_base, Tensor cos, Tensor sin, int[] mrope_section, "
      "bool hf_layout, int[] q_size, int[] q_stride, int[] k_size, int[] k_stride) -> ()");
  m.def(
      "mrope_bwd(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout, "
      "ScalarType? input_dtype=None) "
      "-> (Tensor, Tensor)");
  // mrope_bwd in place: the autograd's form for gradients that nothing else references.
  m.def(
      "mrope_bwd_(Tensor(a!) grad_q, Tensor(b!) grad_k, Tensor cos, Tensor sin, int[] mrope_section, "
      "bool hf_layout) -> ()");

  // Qwen2.5-VL index functions (transformers 4.49 semantics).
  m.def(
      "rope_index(Tensor input_ids, Tensor? image_grid_thw, Tensor? video_grid_thw, Tensor? second_per_grid_ts, "
      "Tensor? attention_mask, int spatial_merge_size, int image_token_id, int video_token_id, "
      "int vision_start_token_id, float tokens_per_second) -> (Tensor, Tensor)");
  // num_tokens (sum of t*h*w) fixes the output sizes without reading a GPU grid (no host sync); the window
  // offsets are then padded to num_tokens / merge^2 + 1 entries by repeating the total (empty windows).
  m.def(
      "vision_rot_pos_emb(Tensor inv_freq, Tensor grid_thw, int spatial_merge_size, SymInt? num_tokens=None) "
      "-> Tensor");
  m.def(
      "vision_window_index(Tensor grid_thw, int spatial_merge_size, int window_size, int spatial_merge_unit, "
      "SymInt? num_tokens=None) -> (Tensor, Tensor)");

  // MoE routing. expert_ids [T, K] int32/int64; slots whose id is outside [0, num_experts) are dropped. Rows
  // are grouped by expert (stable in (t, k) order), the first num_out_tokens slots of that order kept, and
  // expert e's rows start at expert_offsets[e] (a multiple of `align`; padding rows are zero). row_id_map
  // int32 [K * T] is k-major (entry k * T + t: the row of slot (t, k), or -1). Returns (x_perm, row_id_map,
  // tokens_per_expert [E], expert_offsets [E + 1]), all on x's device, with no host synchronisation.
  m.def(
      "moe_permute(Tensor x, Tensor expert_ids, int num_experts, int num_out_tokens, int align) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // out[t] = sum_k probs[t, k] * x_perm[row_id_map[k * T + t]] over kept copies, fp32 accumulation (probs
  // absent: weights 1). The backward gives d x_perm (rows of no slot are zero) and, when asked, d probs (fp32).
  m.def("moe_unpermute_fwd(Tensor x_perm, Tensor row_id_map, Tensor? probs, int num_tokens) -> Tensor");
  m.def(
      "moe_unpermute_bwd(Tensor grad, Tensor x_perm, Tensor row_id_map, Tensor? probs, bool probs_grad) "
      "-> (Tensor, Tensor)");
  // SwiGLU of grouped rows: group g (rows [off[g], off[g+1])) reads gate columns [0, w_g) and up columns
  // [w_g, 2 w_g) of h; output [R, max w] (zero elsewhere), fp32 math, one rounding.
  m.def("moe_swiglu_fwd(Tensor h, Tensor group_offsets, int[] widths) -> Tensor");
  m.def("moe_swiglu_bwd(Tensor grad, Tensor h, Tensor group_offsets, int[] widths) -> Tensor");
  // Grouped GEMMs with device-side group offsets (int64 [G + 1]): rows [off[g], off[g+1]) of x times the
  // nn.Linear weights of group g (weights[g * P + p], [n_gp, k_g], outputs of the P parts side by side);
  // output [R, max_g sum_p n_gp], zero outside each group's columns and rows. wgrad: dW_g = grad_gᵀ x_g.
  m.def("moe_grouped_linear(Tensor x, Tensor[] weights, Tensor group_offsets) -> Tensor");
  m.def(
      "moe_grouped_linear_wgrad(Tensor grad, Tensor x, Tensor group_offsets, int[] out_features, "
      "int[] in_features) -> Tensor[]");
  // Two GEMMs of independent shapes in one call: out_e = op(a_e) · op(w_e), fp32 accumulation.
  m.def(
      "dual_gemm(Tensor a0, Tensor a1, Tensor w0, Tensor w1, bool trans_a, bool trans_b) -> (Tensor, Tensor)");
  m.def(
      "dual_gemm_out(Tensor a0, Tensor a1, Tensor w0, Tensor w1, bool trans_a, bool trans_b, Tensor(a!) c0, "
      "Tensor(b!) c1) -> ()");
}
