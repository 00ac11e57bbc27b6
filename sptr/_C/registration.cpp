// Every schema of the sptr library, in one place. Device files only add TORCH_LIBRARY_IMPL blocks, so a
// CPU-only build registers every op with its CPU kernel.
#include <Python.h>
#include <torch/library.h>

// Importable as a Python module (sptr._C._kernels) so the loader can find it like any extension; the ops
// themselves are reached through torch.ops.sptr.
extern "C" {
PyMODINIT_FUNC PyInit__kernels(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(sptr, m) {
  // Window attention (SparseTransformer pair layout). Pair ops take int32/int64 indices and
  // int8/16/32/64 rel_idx; absent tables give empty gradient tensors.
  m.def("window_precompute_all(Tensor counts, int num_points) -> (Tensor, Tensor, Tensor, Tensor)");
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
  m.def(
      "mrope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout) "
      "-> (Tensor, Tensor)");
  m.def(
      "mrope_fwd_out(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout, "
      "Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.def(
      "mrope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout) -> ()");
  m.def(
      "mrope_bwd(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int[] mrope_section, bool hf_layout) "
      "-> (Tensor, Tensor)");

  // Qwen2.5-VL index functions (transformers 4.49 semantics).
  m.def(
      "rope_index(Tensor input_ids, Tensor? image_grid_thw, Tensor? video_grid_thw, Tensor? second_per_grid_ts, "
      "Tensor? attention_mask, int spatial_merge_size, int image_token_id, int video_token_id, "
      "int vision_start_token_id, float tokens_per_second) -> (Tensor, Tensor)");
  m.def("vision_rot_pos_emb(Tensor inv_freq, Tensor grid_thw, int spatial_merge_size) -> Tensor");
  m.def(
      "vision_window_index(Tensor grid_thw, int spatial_merge_size, int window_size, int spatial_merge_unit) "
      "-> (Tensor, Tensor)");
}
