// Helpers of the ops' autograd, which is registered in C++ (an Autograd-key kernel built on
// torch::autograd::Function, one <family>_autograd.cpp per op family) rather than with
// torch.library.register_autograd: its Python autograd.Function costs ~45 µs of host time per call with
// gradients on, more than the rest of a call (benchmarks/RESULTS.md, "Host overhead").
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <sptr/checks.h>

#include <initializer_list>
#include <optional>

namespace sptr {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op `name` ("sptr::<name>") as a typed handle; callers keep it in a function-local static.
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// A saved tensor back as an optional argument (undefined: an absent one).
inline OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A backward built on a backward kernel that is not itself differentiable: under create_graph=True PyTorch
// would only warn and give second-order gradients of exactly zero; fail instead, naming the op.
inline void refuse_double_backward(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return;
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(!(t->defined() && t->requires_grad()),
                msg(op, " has no second-order gradient: its backward is a fused kernel that is not differentiable. "
                        "Call torch.autograd.grad / backward without create_graph=True through it (double "
                        "backward, Hessian-vector products and gradient penalties are not supported by this op)"));
  }
}

// Whether a gradient that autograd handed to a backward is referenced by nothing else, so the backward may
// overwrite it (as autograd's AccumulateGrad takes over gradients it alone holds): no user tensor, hook,
// retained .grad or view holds it or its memory (the engine gives up its own reference before the call; the
// backward must take its gradient list by reference, since a copy of the list would count), its memory came
// from an allocator (not a NumPy array or DLPack capsule: those storages are not resizable), and it is a plain
// dense tensor, never a traced one (torch.compile's fake and functional tensors, subclasses) or a ZeroTensor.
inline bool sole_reference(const Tensor& g) {
  return g.defined() && g.layout() == at::kStrided && !g.requires_grad() && g.use_count() == 1 &&
         g.has_storage() && g.storage().use_count() == 1 && g.storage().resizable() &&
         !g.unsafeGetTensorImpl()->is_python_dispatch() && !g.key_set().has(c10::DispatchKey::Functionalize) &&
         !g._is_zerotensor() && g.is_non_overlapping_and_dense();
}

}  // namespace sptr
