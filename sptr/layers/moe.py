"""MoE feed-forward layers on the fused routing and grouped-GEMM ops: the Wall-X dual-expert SwiGLU FFN and a
routed top-k FFN. Both keep the parameter names of the plain modules they replace (``experts.{e}.gate_proj``,
``up_proj``, ``down_proj``; the router is ``gate``), so their state dicts load either way. Expert offsets stay
on the device: the grouped GEMM path never waits for the host (one graph under
``torch.compile(fullgraph=True)``, capturable in a CUDA graph); see GEMM_BACKENDS for the eager default."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _C
from ..ops._checks import autocast_dtype, check_tensor
from ..ops.moe import ROUTING_IDS, grouped_linear, permute, swiglu, unpermute
from ..reference.moe import SwiGLUExpert, capacity_keep
from .config import LayerConfig, check_positive

ACTIVATIONS = ("silu",)
# "grouped": the sync-free grouped GEMM kernels; "cublas": one host read of the expert offsets, then cuBLAS on
# each expert's rows; "auto": grouped where its GEMMs run the CUTLASS Hopper kernels (as fast as cuBLAS per
# expert, and no host read), on CPU, under torch.compile and in CUDA-graph capture; cublas in other eager CUDA
# code (cuBLAS is faster than the grouped mma.sync kernel that runs there). See benchmarks/RESULTS.md.
GEMM_BACKENDS = ("auto", "grouped", "cublas")
GATINGS = ("softmax", "sigmoid")
# Every expert's rows start at a multiple of 8: 16-byte aligned reduction ranges for the weight gradients.
ROW_ALIGN = 8


def _check_ffn_fields(cls_name: str, hidden, intermediate, activation, gemm) -> None:
    for name, v in (("hidden", hidden), *((f"intermediate[{i}]", w) for i, w in enumerate(intermediate))):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{cls_name}.{name} must be a positive int, got {v!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{cls_name}.activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"{cls_name}.gemm must be one of {GEMM_BACKENDS}, got {gemm!r}")


@dataclasses.dataclass(frozen=True)
class DualExpertFFNConfig(LayerConfig):
    """Defaults: the Wall-X MoE block on the Qwen2.5-VL-3B backbone (expert 0 = the VLM MLP, expert 1 = the
    narrower action expert)."""
    hidden: int = 2048
    intermediate: tuple = (11008, 2048)
    activation: str = "silu"
    bias: bool = False
    gemm: str = "auto"

    # Wall-X's names of the fields (its SparseMoeBlock arguments and config.json), accepted by from_dict
    WALLX_NAMES = {"hidden_size": "hidden", "intermediate_sizes": "intermediate", "hidden_act": "activation"}

    @classmethod
    def from_dict(cls, values):
        values = dict(values)
        for wallx, ours in cls.WALLX_NAMES.items():
            if wallx in values:
                if ours in values:
                    raise ValueError(f"{cls.__name__}: both {wallx!r} and its name here {ours!r} are given")
                values[ours] = values.pop(wallx)
        return super().from_dict(values)

    @classmethod
    def from_wallx_config(cls, config, **overrides) -> "DualExpertFFNConfig":
        """From a Wall-X model config (its ``config.json`` as a dict, or the config object): ``experts[e] =
        {hidden_size, intermediate_size, hidden_act}`` for experts 0 (the VLM MLP) and 1 (the action expert);
        Wall-X's ``num_experts`` may be larger (4 by default), but only ids 0 and 1 are routed."""
        experts = config.get("experts") if isinstance(config, dict) else getattr(config, "experts", None)
        if not isinstance(experts, (list, tuple)) or len(experts) < 2:
            raise ValueError(f"the Wall-X config must hold experts[0] and experts[1], got {experts!r}")
        read = lambda e, k: e.get(k) if isinstance(e, dict) else getattr(e, k, None)  # noqa: E731
        hidden = {read(e, "hidden_size") for e in experts[:2]}
        if len(hidden) != 1 or None in hidden:
            raise ValueError(f"experts[0] and experts[1] must share one hidden_size, got {sorted(map(str, hidden))}")
        acts = {read(e, "hidden_act") or "silu" for e in experts[:2]}
        if len(acts) != 1:
            raise ValueError(f"experts[0] and experts[1] must share one hidden_act, got {sorted(acts)}")
        return cls(hidden=hidden.pop(), intermediate=tuple(read(e, "intermediate_size") for e in experts[:2]),
                   activation=acts.pop(), **overrides)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.intermediate, (tuple, list)) or len(self.intermediate) != 2:
            raise ValueError(f"{type(self).__name__}.intermediate must be two widths (i0, i1), got "
                             f"{self.intermediate!r}")
        _check_ffn_fields(type(self).__name__, self.hidden, self.intermediate, self.activation, self.gemm)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return autocast_dtype(x.device) or x.dtype


def _add_group_bias(y: Tensor, biases, offsets: Tensor) -> Tensor:
    """y plus the bias of each row's group, added in fp32 or fp64 (so the bias gradient, a sum over the group's rows,
    accumulates in fp32); padding rows past the last group take group G-1's and are never read."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    width = max(b.shape[0] for b in biases)
    table = torch.stack([F.pad(b.to(acc), (0, width - b.shape[0])) for b in biases])
    group = torch.searchsorted(offsets[1:], torch.arange(y.shape[0], device=offsets.device), right=True)
    return (y.to(acc) + table[group.clamp_max(len(biases) - 1)]).to(y.dtype)


def _use_cublas(gemm: str, experts: nn.ModuleList, x: Tensor) -> bool:
    if gemm != "auto":
        return gemm == "cublas"
    if not x.is_cuda or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return not _grouped_runs_cutlass(experts, x)


def _grouped_runs_cutlass(experts: nn.ModuleList, x: Tensor) -> bool:
    """Whether every grouped GEMM of the FFN takes the CUTLASS Hopper kernel: a build with it, a compute
    capability 9.0 device, 16-bit GEMMs and rows of whole 16-byte vectors (the kernel's TMA alignment)."""
    if not _C.sm90_grouped_gemm_runs(x.device) or _compute_dtype(x) not in (torch.float16, torch.bfloat16):
        return False
    widths = [x.shape[-1]] + [e.gate_proj.weight.shape[0] for e in experts]
    return all(w % 8 == 0 for w in widths)


def sliced_swiglu_ffn(experts: nn.ModuleList, x_perm: Tensor, offsets: Tensor) -> Tensor:
    """The same as :func:`grouped_swiglu_ffn` through cuBLAS on each expert's rows, after one host read of
    the offsets; rows of no expert are zero."""
    bounds = offsets.tolist()
    y = x_perm.new_zeros(x_perm.shape)
    for e, expert in enumerate(experts):  # empty experts too: every weight gets a (zero) gradient, as DDP needs
        y[bounds[e]:bounds[e + 1]] = expert(x_perm[bounds[e]:bounds[e + 1]])
    return y


def swiglu_ffn(experts: nn.ModuleList, x_perm: Tensor, offsets: Tensor, gemm: str) -> Tensor:
    use_cublas = _use_cublas(gemm, experts, x_perm)
    return (sliced_swiglu_ffn if use_cublas else grouped_swiglu_ffn)(experts, x_perm, offsets)


def grouped_swiglu_ffn(experts: nn.ModuleList, x_perm: Tensor, offsets: Tensor) -> Tensor:
    """``down_e(silu(gate_e x) · up_e x)`` of the rows of every expert e (rows ``[off[e], off[e+1])``): one
    grouped GEMM for gate‖up of all experts, the SwiGLU kernel, one grouped GEMM for down."""
    gate_up = [w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight)]
    h = grouped_linear(x_perm, gate_up, offsets)
    widths = [e.gate_proj.weight.shape[0] for e in experts]
    if experts[0].gate_proj.bias is not None:
        h = _add_group_bias(h, [torch.cat((e.gate_proj.bias, e.up_proj.bias)) for e in experts], offsets)
    a = swiglu(h, offsets, widths)
    y = grouped_linear(a, [e.down_proj.weight for e in experts], offsets)
    if experts[0].down_proj.bias is not None:
        y = _add_group_bias(y, [e.down_proj.bias for e in experts], offsets)
    return y


class DualExpertFFN(nn.Module):
    """Two SwiGLU experts of different widths; ``forward(x [T, H] or [B, S, H], expert_index)`` with
    ``expert_index`` (same leading shape) bool (True: expert 1) or int (0 / 1; other ids give zero rows)
    returns ``y[t] = expert_{id(t)}(x[t])`` in x's shape: permute -> one grouped GEMM for gate‖up of both
    experts -> SwiGLU (fp32, one rounding) -> one grouped GEMM for down -> unpermute, with no host sync
    (``cfg.gemm="auto"`` takes cuBLAS per expert in eager CUDA code where the CUTLASS Hopper kernels do not run,
    see GEMM_BACKENDS). Under autocast the GEMMs run in the autocast dtype (as nn.Linear); bitwise reproducible
    run to run."""

    def __init__(self, cfg: DualExpertFFNConfig):
        super().__init__()
        self.cfg = cfg
        self.experts = nn.ModuleList(SwiGLUExpert(cfg.hidden, i, cfg.bias, cfg.activation) for i in cfg.intermediate)

    @classmethod
    def from_plain(cls, module: nn.Module, gemm: str = "auto") -> "DualExpertFFN":
        """The layer with the weights of a plain module holding ``experts.{0,1}.{gate,up,down}_proj``."""
        e0, e1 = module.experts[0], module.experts[1]
        cfg = DualExpertFFNConfig(hidden=e0.gate_proj.in_features,
                                  intermediate=(e0.gate_proj.out_features, e1.gate_proj.out_features),
                                  bias=e0.gate_proj.bias is not None, gemm=gemm)
        layer = cls(cfg).to(device=e0.gate_proj.weight.device, dtype=e0.gate_proj.weight.dtype)
        layer.load_state_dict(module.state_dict())
        return layer

    @classmethod
    def from_wallx_config(cls, config, **overrides) -> "DualExpertFFN":
        return cls(DualExpertFFNConfig.from_wallx_config(config, **overrides))

    def forward(self, x: Tensor, expert_index: Tensor, start_indices=None, end_indices=None, *,
                validate: bool = False) -> Tensor:
        # start/end_indices: accepted for Wall-X call compatibility, unused (as there). Ids outside {0, 1}
        # give zero rows; validate=True raises on them instead (one host sync on CUDA).
        H = self.cfg.hidden
        if not isinstance(x, Tensor) or x.shape[-1] != H:
            raise ValueError(f"x must be [..., {H}], got {tuple(x.shape) if isinstance(x, Tensor) else type(x)}")
        if not isinstance(expert_index, Tensor) or expert_index.shape != x.shape[:-1]:
            raise ValueError(f"expert_index must have x's leading shape {tuple(x.shape[:-1])}, got "
                             f"{tuple(expert_index.shape) if isinstance(expert_index, Tensor) else type(expert_index)}")
        check_tensor("expert_index", expert_index, dtypes=ROUTING_IDS, device=x.device)
        flat = x.reshape(-1, H).to(_compute_dtype(x))
        perm = permute(flat, expert_index.reshape(-1), 2, align=ROW_ALIGN, validate=validate)
        y = swiglu_ffn(self.experts, perm.x_perm, perm.expert_offsets, self.cfg.gemm)
        return unpermute(y, perm.row_id_map, None, flat.shape[0]).reshape(*x.shape[:-1], H)


_VLM_MLP_KEY = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+\.)mlp\.(?P<rest>(?:gate|up|down)_proj\..+)$")


def vlm_mlp_to_expert0(state_dict: dict) -> dict:
    """A Qwen2.5-VL state dict with each decoder layer's MLP renamed to the dual-expert block's expert 0
    (``...layers.N.mlp.{gate,up,down}_proj.*`` -> ``...layers.N.moe.experts.0.*``), as Wall-X initialises it
    from a plain Qwen2.5-VL; the tensors are the same objects, every other key is kept."""
    out = {}
    for key, value in state_dict.items():
        m = _VLM_MLP_KEY.match(key)
        new = f"{m['layer']}moe.experts.0.{m['rest']}" if m else key
        if new in out:
            raise ValueError(f"{key!r} renames to {new!r}, which the state dict holds already")
        out[new] = value
    return out


@dataclasses.dataclass(frozen=True)
class RoutedExpertFFNConfig(LayerConfig):
    """A top-k routed SwiGLU MoE (Qwen2-MoE / Mixtral style). ``normalize_topk`` renormalises the kept top-k
    gate weights to sum to 1 (Mixtral: True; Qwen2-MoE: ``norm_topk_prob``). ``capacity_factor`` > 0 caps
    every expert at ``ceil(capacity_factor · T · top_k / num_experts)`` copies (later copies in (t, k) order
    are dropped); 0 keeps every copy."""
    hidden: int = 2048
    intermediate: int = 1408
    num_experts: int = 8
    top_k: int = 2
    gating: str = "softmax"
    normalize_topk: bool = True
    capacity_factor: float = 0.0
    activation: str = "silu"
    bias: bool = False
    gemm: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        _check_ffn_fields(name, self.hidden, (self.intermediate,), self.activation, self.gemm)
        check_positive(name, num_experts=self.num_experts, top_k=self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"{name}.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.gating not in GATINGS:
            raise ValueError(f"{name}.gating must be one of {GATINGS}, got {self.gating!r}")
        if not self.capacity_factor >= 0:
            raise ValueError(f"{name}.capacity_factor must be a finite number >= 0, got {self.capacity_factor!r}")


class RoutedOutput(NamedTuple):
    hidden_states: Tensor   # [..., H]
    aux_loss: Tensor        # scalar load-balancing loss (fp32)
    router_logits: Tensor   # [T, E], the gate's output (the autocast dtype under autocast, as transformers')


def route(logits: Tensor, cfg: RoutedExpertFFNConfig):
    """``(probs [T, E], topk_index [T, K], topk_weight [T, K])`` in fp32 from router logits."""
    probs = logits.float().softmax(-1) if cfg.gating == "softmax" else logits.float().sigmoid()
    weight, index = probs.topk(cfg.top_k, dim=-1)
    if cfg.normalize_topk:
        weight = weight / weight.sum(-1, keepdim=True)
    return probs, index, weight


def load_balancing_loss(probs: Tensor, topk_index: Tensor, num_experts: int,
                        attention_mask: Tensor | None = None) -> Tensor:
    """The Switch / Mixtral auxiliary loss as transformers' ``load_balancing_loss_func`` computes it:
    ``E · Σ_k Σ_e f_{k,e} · P_e`` with ``f_{k,e}`` the share of tokens whose k-th choice is e and ``P_e`` the
    mean router probability of e, both over the tokens where ``attention_mask`` ([B, S] or [T], 1 = kept) is
    1 (all tokens without it)."""
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    chosen = F.one_hot(topk_index, num_experts).float()  # [T, K, E]
    if attention_mask is None:
        return (chosen.mean(0) * probs.mean(0)[None]).sum() * num_experts
    mask = attention_mask.reshape(-1).to(probs.dtype)
    if mask.shape[0] != probs.shape[0]:
        raise ValueError(f"attention_mask must hold one entry per token ({probs.shape[0]}), got "
                         f"{tuple(attention_mask.shape)}")
    kept = mask.sum()
    f = (chosen * mask[:, None, None]).sum(0) / kept
    p = (probs * mask[:, None]).sum(0) / kept
    return (f * p[None]).sum() * num_experts


class RoutedExpertFFN(nn.Module):
    """``forward(x [T, H] or [B, S, H]) -> RoutedOutput``: a linear router (``gate``), top-k softmax or
    sigmoid gating, then ``y[t] = Σ_k w[t,k] · expert_{idx[t,k]}(x[t])`` over kept copies via permute ->
    grouped SwiGLU (all experts in one grouped GEMM per projection) -> probability-weighted unpermute (fp32
    combine). Gradients reach x, every weight and the router through the gate weights (and the aux loss).
    ``forward_routed(x, topk_index, topk_weight)`` takes a given routing."""

    def __init__(self, cfg: RoutedExpertFFNConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLUExpert(cfg.hidden, cfg.intermediate, cfg.bias, cfg.activation) for _ in range(cfg.num_experts))

    @classmethod
    def from_plain(cls, module: nn.Module, **routing) -> "RoutedExpertFFN":
        """The layer with the weights of a plain MoE block: a router ``gate`` (``gate.weight`` [E, H]) and experts
        as a list of ``gate_proj/up_proj/down_proj`` (or Mixtral's ``w1/w3/w2``) modules, as in transformers 4.x,
        or as transformers 5.x's stacked ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
        ``experts.down_proj`` [E, H, I]. ``routing`` sets the config's routing fields (top_k, gating, ...)."""
        if getattr(module, "shared_expert", None) is not None:
            raise ValueError(f"{type(module).__name__} has a shared expert, which RoutedExpertFFN does not hold")
        experts = module.experts
        weight = module.gate.weight
        if isinstance(getattr(experts, "gate_up_proj", None), Tensor):
            state = _stacked_expert_state(experts)
            state["gate.weight"] = weight.detach()
            bias, inter = False, experts.down_proj.shape[2]
        else:
            e0 = experts[0]
            state = module.state_dict()
            if not hasattr(e0, "gate_proj") and hasattr(e0, "w1"):  # Mixtral's experts: w1 gate, w3 up, w2 down
                names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
                renamed = {}
                for key, value in state.items():
                    for old, new in names.items():
                        if key.startswith("experts.") and old in key:
                            key = key.replace(old, new)
                    renamed[key] = value
                state = renamed
            gate = e0.gate_proj if hasattr(e0, "gate_proj") else e0.w1
            bias, inter = gate.bias is not None, gate.out_features
        cfg = RoutedExpertFFNConfig(hidden=weight.shape[1], intermediate=inter, num_experts=weight.shape[0],
                                    bias=bias, **routing)
        layer = cls(cfg).to(device=weight.device, dtype=weight.dtype)
        layer.load_state_dict(state)
        return layer

    def capacity(self, num_tokens: int) -> int | None:
        cf = self.cfg.capacity_factor
        return None if cf == 0 else math.ceil(cf * num_tokens * self.cfg.top_k / self.cfg.num_experts)

    def forward_routed(self, x: Tensor, topk_index: Tensor, topk_weight: Tensor) -> Tensor:
        H = self.cfg.hidden
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"x must be [T, {H}], got {tuple(x.shape) if isinstance(x, Tensor) else type(x)}")
        K = self.cfg.top_k
        for name, t in (("topk_index", topk_index), ("topk_weight", topk_weight)):
            if not isinstance(t, Tensor) or tuple(t.shape) != (x.shape[0], K):
                raise ValueError(f"{name} must be [T, top_k] = [{x.shape[0]}, {K}], got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t)}")
        flat = x.to(_compute_dtype(x))
        index = topk_index
        cap = self.capacity(x.shape[0])
        if cap is not None:
            index = torch.where(capacity_keep(topk_index, self.cfg.num_experts, cap), topk_index, -1)
        perm = permute(flat, index, self.cfg.num_experts, align=ROW_ALIGN)
        y = swiglu_ffn(self.experts, perm.x_perm, perm.expert_offsets, self.cfg.gemm)
        return unpermute(y, perm.row_id_map, topk_weight, x.shape[0])

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> RoutedOutput:
        """``attention_mask`` ([B, S], 1 = kept) leaves padding out of the load-balancing loss, as transformers'
        ``load_balancing_loss_func``. As transformers' MoE blocks, the output has x's dtype (also under
        autocast, where the experts compute in the autocast dtype) and the router logits the gate's."""
        H = self.cfg.hidden
        if not isinstance(x, Tensor) or x.shape[-1] != H:
            raise ValueError(f"x must be [..., {H}], got {tuple(x.shape) if isinstance(x, Tensor) else type(x)}")
        if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                           or attention_mask.numel() != x.numel() // H):
            raise ValueError(f"attention_mask must have x's leading shape {tuple(x.shape[:-1])}, got "
                             f"{getattr(attention_mask, 'shape', type(attention_mask))}")
        flat = x.reshape(-1, H)
        logits = self.gate(flat)
        probs, index, weight = route(logits, self.cfg)
        y = self.forward_routed(flat, index, weight)
        aux = load_balancing_loss(probs, index, self.cfg.num_experts, attention_mask)
        return RoutedOutput(y.reshape(*x.shape[:-1], H).to(x.dtype), aux, logits)


def _stacked_expert_state(experts: nn.Module) -> dict[str, Tensor]:
    """transformers 5.x's stacked experts as the per-expert keys of RoutedExpertFFN's state dict."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) or \
            getattr(experts, "has_gate", True) is False:
        raise ValueError(f"{type(experts).__name__}: only the [E, 2I, H] / [E, H, I] layout without biases "
                         "(Mixtral, OLMoE, Qwen3-MoE) converts to RoutedExpertFFN")
    E, two_i, H = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (E, H, two_i // 2):
        raise ValueError(f"{type(experts).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
    inter = two_i // 2
    state = {}
    for e in range(E):
        state[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter].detach()
        state[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:].detach()
        state[f"experts.{e}.down_proj.weight"] = down[e].detach()
    return state
