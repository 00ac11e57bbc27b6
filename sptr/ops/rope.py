"""Multimodal RoPE (Qwen2-VL / Qwen2.5-VL mRoPE) on q and k in one kernel.

q ``[B, Hq, S, D]``, k ``[B, Hk, S, D]`` (any strides, e.g. transposed ``[B, S, H, D]`` views), one dtype in
fp16/bf16/fp32/fp64; cos/sin ``[3, B, S, D]`` (stride 0 over B allowed) with ``mrope_section`` (undoubled,
e.g. ``[16, 24, 24]``), or an already composed ``[B, S, D]``; fp32 or q's dtype. The result equals
transformers' ``apply_multimodal_rotary_pos_emb`` bit for bit (same rounding in q's dtype). The autograd of
``mrope_fwd`` (trainable cos/sin included) is registered in C++ (rope_autograd.cpp), for its host time.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor

import sptr._C  # noqa: F401

from ._checks import FLOATING, cast, check_no_overlap, check_tensor, is_int

_ops = torch.ops.sptr
LAYOUTS = ("hf", "wallx")


@torch.library.register_fake("sptr::mrope_fwd")
def _mrope_fake(q, k, cos, sin, mrope_section, hf_layout, promote=False):
    dtype = torch.promote_types(q.dtype, cos.dtype) if promote else q.dtype
    return torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)


@torch.library.register_fake("sptr::mrope_bwd")
def _mrope_bwd_fake(grad_q, grad_k, cos, sin, mrope_section, hf_layout, input_dtype=None):
    dtype = grad_q.dtype if input_dtype is None else input_dtype
    return torch.empty_like(grad_q, dtype=dtype), torch.empty_like(grad_k, dtype=dtype)


@torch.library.register_fake("sptr::mrope_fwd_out")
def _mrope_out_fake(q, k, cos, sin, mrope_section, hf_layout, q_out, k_out):
    return None


@torch.library.register_fake("sptr::mrope_")
def _mrope_inplace_fake(q, k, cos, sin, mrope_section, hf_layout):
    return None


@torch.library.register_fake("sptr::mrope_bwd_")
def _mrope_bwd_inplace_fake(grad_q, grad_k, cos, sin, mrope_section, hf_layout):
    return None


def _check(q, k, cos, sin, mrope_section, section_layout):
    for name, t in (("q", q), ("k", k)):
        check_tensor(name, t, dim=4, dtypes=FLOATING)
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; q and k must share a dtype")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(name, t, device=q.device)
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q and k must share B, S and D, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[-1]}")
    if cos.dtype not in (torch.float32, q.dtype) or sin.dtype != cos.dtype:
        raise TypeError(f"cos/sin must be float32 or q's dtype {q.dtype}, got {cos.dtype} / {sin.dtype}")
    if section_layout not in LAYOUTS:
        raise ValueError(f"section_layout must be one of {LAYOUTS}, got {section_layout!r}")
    if cos.dim() == 4:
        if not isinstance(mrope_section, (list, tuple)) or not all(is_int(s) for s in mrope_section):
            raise TypeError(f"mrope_section must be a list of 3 ints (as transformers' split needs), got "
                            f"{mrope_section!r}")
        if len(mrope_section) != 3 or sum(mrope_section) != q.shape[-1] // 2 or min(mrope_section) < 0:
            raise ValueError(f"mrope_section must be 3 ints >= 0 summing to head_dim / 2 = {q.shape[-1] // 2}, got "
                             f"{mrope_section}")
        return [int(s) for s in mrope_section]
    if cos.dim() != 3:
        raise ValueError(f"cos must be [3, B, S, D] or composed [B, S, D], got {tuple(cos.shape)}")
    if mrope_section is not None:
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} are a composed [B, S, D] table, which takes "
                         f"mrope_section=None (got {mrope_section}); per-stream tables are [3, B, S, D]")
    return []


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mrope_section: Sequence[int] | None = None, *,
                 section_layout: str = "hf") -> tuple[Tensor, Tensor]:
    """Rotated ``(q, k)`` (new tensors), differentiable in q, k and cos/sin, with PyTorch's type promotion of
    transformers' ``q * cos + rotate_half(q) * sin``: fp16/bf16 q, k with fp32 cos/sin (autocast) give fp32
    results computed from the fp32 tables; tables of q's dtype give q's dtype.

    ``mrope_section`` is the undoubled split ``[t, h, w]`` of ``head_dim / 2`` for ``[3, B, S, D]`` tables
    (None for composed ``[B, S, D]`` tables). ``section_layout='wallx'`` reproduces the published Wall-X
    kernel's contiguous sections (not a rotation on vision tokens; opt-in only).

    The backward rotates the incoming gradient in place where autograd alone holds it (the gradient of the next
    op, as in a model); a gradient the caller passed or a hook received is never written.
    """
    section = _check(q, k, cos, sin, mrope_section, section_layout)
    promote = cos.dtype == torch.float32 and q.dtype in (torch.float16, torch.bfloat16)
    return _ops.mrope_fwd(q, k, cos, sin, section, section_layout == "hf", promote)


def _bump_versions(*tensors: Tensor) -> None:
    """Version counters of tensors a kernel wrote in place (the dispatcher does not for custom ops), so that
    autograd refuses a backward through values saved before the write."""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version([t for t in tensors if not t.is_inference()])


def _same_view(a: Tensor, b: Tensor) -> bool:
    same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return a is b or (same_storage and a.storage_offset() == b.storage_offset() and a.shape == b.shape
                      and a.stride() == b.stride())


@torch.library.register_fake("sptr::mrope_rebased_")
def _mrope_rebased_fake(q_base, k_base, cos, sin, mrope_section, hf_layout, q_size, q_stride, k_size, k_stride):
    return None


@functools.lru_cache(maxsize=256)
def _dense_order(shape: tuple, stride: tuple) -> tuple | None:
    """For a tensor of this geometry that is dense (its elements fill a contiguous block): its dims from outermost
    to innermost in memory, its shape in that order, and the permutation back; else None. Cached: a model
    rotates tensors of a few geometries."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], -shape[d]))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order, [shape[d] for d in order], sorted(range(len(shape)), key=order.__getitem__)


def _covering_base(x: Tensor) -> Tensor | None:
    """The contiguous tensor x is a dense view of, all of it (x itself where x is not a view), or None."""
    base = x if x._base is None else x._base
    if (base.is_contiguous() and base.numel() == x.numel() and base.storage_offset() == x.storage_offset()
            and _dense_order(tuple(x.shape), x.stride()) is not None):
        return base
    return None


def _view_as(base: Tensor, like: Tensor) -> Tensor:
    """`like`'s geometry over its covering base, by view and permute (whose gradients are free)."""
    _, shape, inverse = _dense_order(tuple(like.shape), like.stride())
    return base.view(shape).permute(inverse)


def apply_rotary_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mrope_section: Sequence[int] | None = None, *,
                  section_layout: str = "hf") -> tuple[Tensor, Tensor]:
    """In-place :func:`apply_rotary` (exact: each thread reads its rotation pair before writing it). The result
    keeps q's dtype, so fp32 cos/sin are cast to it first (transformers' low-precision models do the same).

    q and k must not share memory. Differentiable as PyTorch's in-place ops are (versions bumped, a leaf that
    requires grad refused). Use the returned tensors: where q and k are dense views of whole contiguous
    tensors (a projection's output seen as ``[B, H, S, D]``, as in transformers' attention), the rotation is
    recorded on those tensors and the results are fresh views of them, so the backward rotates the gradient
    in one kernel and copies nothing; other views (slices of a fused qkv output, say) and trainable cos/sin
    take an out-of-place rotation copied in with ``copy_``.
    """
    section = _check(q, k, cos, sin, mrope_section, section_layout)
    check_no_overlap("q", q, "k", k)
    hf = section_layout == "hf"
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad
                                        or sin.requires_grad)
    if not grad:
        _ops.mrope_(q, k, cos, sin, section, hf)
        _bump_versions(q, k)
        return q, k
    rebased = not (cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling())
    q_base, k_base = (_covering_base(q), _covering_base(k)) if rebased else (None, None)
    if q_base is None or k_base is None:
        q_rot, k_rot = _ops.mrope_fwd(q, k, cast(cos, q.dtype), cast(sin, q.dtype), section, hf, False)
        q.copy_(q_rot)
        k.copy_(k_rot)
        return q, k
    _ops.mrope_rebased_(q_base, k_base, cast(cos, q.dtype), cast(sin, q.dtype), section, hf, q.shape, q.stride(),
                        k.shape, k.stride())
    return _view_as(q_base, q), _view_as(k_base, k)


def rope(q, k, cos, sin, q_out, k_out, mrope_section_doubled, *, section_layout: str = "hf") -> None:
    """Wall-X backend signature: writes rotated q, k into ``q_out``, ``k_out`` (may be ``q``, ``k``), in q's
    dtype with the tables cast to it (the published kernel's arithmetic). As PyTorch's ``out=`` functions, it
    does not record autograd: with inputs that require grad use :func:`apply_rotary` (or ``q_out=q, k_out=k``,
    which is :func:`apply_rotary_`)."""
    section = [int(s) // 2 for s in mrope_section_doubled] if cos.dim() == 4 else None
    if q_out is q and k_out is k:
        apply_rotary_(q, k, cos, sin, section, section_layout=section_layout)
        return
    sec = _check(q, k, cos, sin, section, section_layout)
    for name, t in (("q_out", q_out), ("k_out", k_out)):
        check_tensor(name, t, device=q.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin, q_out, k_out)):
        raise RuntimeError("rope(q_out=..., k_out=...) writes into q_out and k_out outside autograd, so it takes no "
                           "input that requires grad; use sptr.ops.apply_rotary (out of place) or q_out=q, k_out=k")
    check_no_overlap("q_out", q_out, "k_out", k_out)
    for out_name, out, in_name, x in (("q_out", q_out, "k", k), ("k_out", k_out, "q", q),
                                      ("q_out", q_out, "q", q), ("k_out", k_out, "k", k)):
        if not (out_name[0] == in_name[0] and _same_view(out, x)):  # exactly in place is exact; partly is not
            check_no_overlap(out_name, out, in_name, x)
    _ops.mrope_fwd_out(q, k, cos, sin, sec, section_layout == "hf", q_out, k_out)
    _bump_versions(q_out, k_out)


def rope_bwd(grad_q_out, grad_k_out, q, k, cos, sin, grad_q, grad_k, mrope_section_doubled, *,
             section_layout: str = "hf") -> None:
    """Wall-X backend signature: writes the input gradients into ``grad_q``, ``grad_k`` (values of q, k unused)."""
    section = [int(s) // 2 for s in mrope_section_doubled] if cos.dim() == 4 else None
    sec = _check(grad_q_out, grad_k_out, cos, sin, section, section_layout)
    gq, gk = _ops.mrope_bwd(grad_q_out, grad_k_out, cos, sin, sec, section_layout == "hf", None)
    grad_q.copy_(gq)
    grad_k.copy_(gk)
