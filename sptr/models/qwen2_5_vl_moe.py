"""A Wall-X-style dual-expert Qwen2.5-VL (transformers 4.49 or 5.x): each decoder layer's MLP becomes a
DualExpertFFN, expert 0 the VLM MLP's width, expert 1 the narrower action expert, routed by ``moe_token_types
[B, S]`` (1 for the ``<|action|>`` tokens). Checkpoints use Wall-X's (4.49) keys,
``model.layers.N.moe.experts.{0,1}.*``, also on transformers 5.x, whose modules nest them under
``model.language_model``; sptr's mRoPE and Qwen2.5-VL index ops are swapped in
(``sptr.integrations.qwen2_5_vl.apply_to``). Wall-X's bidirectional action attention needs 4.49's masks.

``from_qwen2_5_vl(model)`` makes one from a plain Qwen2.5-VL (its MLPs become expert 0 bit for bit, expert 1
is initialised as transformers initialises a fresh MLP); ``load_wallx(model, directory)`` reads a Wall-X-format
safetensors directory strictly and returns the keys the backbone does not own (``action_preprocessor.*``,
LoRA, ...); ``save_pretrained`` writes the same format. With every token routed to expert 0 the model's
logits, loss and gradients equal the plain model's bit for bit (``gemm="cublas"``, the default here: the same
matrix products on the same rows).
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..integrations import qwen2_5_vl
from ..layers.config import LayerConfig, check_positive
from ..layers.moe import GEMM_BACKENDS, DualExpertFFN, DualExpertFFNConfig, vlm_mlp_to_expert0


@dataclasses.dataclass(frozen=True)
class DualExpertQwenConfig(LayerConfig):
    """The dual-expert part of the model. ``action_intermediate``: expert 1's width; ``action_token_id``: where
    ``moe_token_types`` is not given, tokens equal to it go to expert 1 (None: all tokens to expert 0);
    ``gemm``: DualExpertFFN's GEMM path ("cublas": the same products as the plain MLP; "grouped": sync-free);
    ``bidirectional_actions``: the action tokens (``moe_token_types == 1``) attend to each other in both directions
    (Wall-X's attention for its flow-matching action chunk), everything else stays causal (eager and sdpa
    attention, without a KV cache)."""
    action_intermediate: int = 2048
    action_token_id: int | None = None
    gemm: str = "cublas"
    bidirectional_actions: bool = False  # Wall-X's sdpa path: action tokens see every action token of their row

    def __post_init__(self):
        super().__post_init__()
        check_positive(type(self).__name__, action_intermediate=self.action_intermediate)
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"{type(self).__name__}.gemm must be one of {GEMM_BACKENDS}, got {self.gemm!r}")

    @classmethod
    def from_wallx_config(cls, config, **overrides) -> "DualExpertQwenConfig":
        """From a Wall-X ``config.json`` (dict or object): ``experts[1].intermediate_size``; ``mlp_moe`` must be
        on."""
        get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))
        if get("mlp_moe") is False:
            raise ValueError("the Wall-X config has mlp_moe = false: its decoder MLPs are not dual-expert")
        expert = DualExpertFFNConfig.from_wallx_config(config)
        return cls(action_intermediate=expert.intermediate[1], **overrides)


class _TokenTypes:
    """The routing of the current forward, read by every layer's MLP (and again by gradient checkpointing's
    recomputation, so it is kept until the next forward)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


class RoutedMLP:
    """What a decoder layer calls as its ``mlp``: its ``moe`` block on the current token types. Not a module, so
    the weights stay under ``moe`` (Wall-X's keys); pickles with the model."""

    __slots__ = ("moe", "types")

    def __init__(self, moe: DualExpertFFN, types: _TokenTypes):
        self.moe, self.types = moe, types

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        types = self.types.value
        if types is None:  # no routing given: every token on expert 0 (text / vision)
            types = torch.zeros(hidden_states.shape[:-1], dtype=torch.long, device=hidden_states.device)
        elif types.shape != hidden_states.shape[:-1]:
            raise ValueError(f"moe_token_types must be [B, S] = {tuple(hidden_states.shape[:-1])} (the tokens of this "
                             f"forward), got {tuple(types.shape)}; in generation set action_token_id instead")
        return self.moe(hidden_states, types).to(hidden_states.dtype)


_CLASS_NAME = "Qwen2_5_VLDualExpertForConditionalGeneration"


def decoder_layers(model):
    """The decoder layers: ``model.layers`` in transformers 4.49, ``model.language_model.layers`` in 5.x."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def _text_config(config):
    return getattr(config, "text_config", None) or config


# transformers 5.x nests the text model and the vision tower under ``model``; Wall-X's checkpoints (4.49) do not
_V5_TO_WALLX = (("model.language_model.", "model."), ("model.visual.", "visual."))


def to_wallx_keys(state: dict, model) -> dict:
    """A state dict of ``model`` with Wall-X's (transformers 4.49) key layout."""
    if not hasattr(model.model, "language_model"):
        return dict(state)
    out = {}
    for key, value in state.items():
        for new, old in _V5_TO_WALLX:
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = value
    return out


def from_wallx_keys(state: dict, model) -> dict:
    """Wall-X's (4.49) keys in ``model``'s layout (the same for 4.49; nested under ``model.`` for 5.x)."""
    if not hasattr(model.model, "language_model"):
        return dict(state)
    out = {}
    for key, value in state.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model.") and not key.startswith(("model.visual.", "model.language_model.")):
            key = "model.language_model." + key[len("model."):]
        out[key] = value
    return out


class BidirectionalActionMask:
    """The decoder's ``_update_causal_mask`` with the action tokens unmasked among themselves: the causal 4-D mask
    (built here when transformers would pass none to sdpa), then ``0`` wherever both the query and the key are
    action tokens of one row that the padding mask keeps. Without action tokens, or with a KV cache (decoding),
    transformers' own mask is used."""

    __slots__ = ("decoder", "types")

    def __init__(self, decoder, types: _TokenTypes):
        self.decoder, self.types = decoder, types

    def __call__(self, attention_mask, input_tensor, cache_position, past_key_values, output_attentions):
        own = type(self.decoder)._update_causal_mask(self.decoder, attention_mask, input_tensor, cache_position,
                                                      past_key_values, output_attentions)
        types = self.types.value
        cached = past_key_values is not None and past_key_values.get_seq_length() > 0
        if types is None or cached or not bool((types == 1).any()):
            return own
        if self.decoder.config._attn_implementation == "flash_attention_2":
            raise ValueError("bidirectional_actions needs eager or sdpa attention (flash-attention masks are causal)")
        B, S = types.shape
        dtype, device = input_tensor.dtype, input_tensor.device
        min_value = torch.finfo(dtype).min
        if own is None:  # sdpa's is_causal shortcut: the same causal mask, explicitly
            keep = torch.ones(S, S, dtype=torch.bool, device=device).tril()
            if attention_mask is not None:
                keep = keep[None] & attention_mask[:, None, :].bool()
            own = torch.zeros(B, 1, S, S, dtype=dtype, device=device).masked_fill(~keep.reshape(-1, 1, S, S), min_value)
        action = types == 1
        if attention_mask is not None:
            action = action & attention_mask.bool()
        both = action[:, None, :, None] & action[:, None, None, :]
        return own.masked_fill(both, 0.0)


def _model_class():
    """transformers' Qwen2.5-VL with dual-expert decoder MLPs, defined at first use (transformers is imported
    then) and kept as this module's attribute, so that pickle finds it."""
    cls = globals().get(_CLASS_NAME)
    if cls is not None:
        return cls
    hf = qwen2_5_vl._modeling()

    class Qwen2_5_VLDualExpertForConditionalGeneration(hf.Qwen2_5_VLForConditionalGeneration):
        """transformers' Qwen2.5-VL with dual-expert decoder MLPs; ``forward(..., moe_token_types=[B, S])``."""

        def __init__(self, config, moe_config: DualExpertQwenConfig):
            super().__init__(config)
            self.moe_config = moe_config
            self._token_types = _TokenTypes()
            text = _text_config(config)
            ffn = DualExpertFFNConfig(hidden=text.hidden_size,
                                      intermediate=(text.intermediate_size, moe_config.action_intermediate),
                                      activation=text.hidden_act, gemm=moe_config.gemm)
            for layer in decoder_layers(self):
                del layer.mlp
                layer.moe = DualExpertFFN(ffn)
                layer.moe.apply(self._init_weights)
                layer.mlp = RoutedMLP(layer.moe, self._token_types)
            if moe_config.bidirectional_actions:
                if not hasattr(self.model, "_update_causal_mask"):
                    raise ValueError("bidirectional_actions needs transformers 4.49's attention masks (Wall-X's "
                                     "version); this transformers builds its masks otherwise")
                self.model._update_causal_mask = BidirectionalActionMask(self.model, self._token_types)
            qwen2_5_vl.apply_to(self)

        def forward(self, input_ids=None, *args, moe_token_types=None, **kwargs):
            if moe_token_types is None and input_ids is not None and self.moe_config.action_token_id is not None:
                moe_token_types = (input_ids == self.moe_config.action_token_id).long()
            self._token_types.value = moe_token_types
            return super().forward(input_ids, *args, **kwargs)

    Qwen2_5_VLDualExpertForConditionalGeneration.__module__ = __name__
    Qwen2_5_VLDualExpertForConditionalGeneration.__qualname__ = _CLASS_NAME
    globals()[_CLASS_NAME] = Qwen2_5_VLDualExpertForConditionalGeneration
    return Qwen2_5_VLDualExpertForConditionalGeneration


def __getattr__(name):  # the model class, on first access (also when pickle looks it up)
    if name == _CLASS_NAME:
        return _model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dual_expert_qwen2_5_vl(config, moe: DualExpertQwenConfig):
    """A new dual-expert Qwen2.5-VL of a ``Qwen2_5_VLConfig`` (random weights, transformers' initialisation)."""
    return _model_class()(config, moe)


def from_qwen2_5_vl(model_or_path, moe: DualExpertQwenConfig):
    """The dual-expert model of a plain Qwen2.5-VL (a model or a ``from_pretrained`` directory): its MLPs become
    expert 0 (the same tensors' values), expert 1 is new."""
    hf = qwen2_5_vl._modeling()
    plain = (hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_or_path)
             if isinstance(model_or_path, (str, os.PathLike)) else model_or_path)
    model = dual_expert_qwen2_5_vl(plain.config, moe)
    param = next(plain.parameters())
    model.to(device=param.device, dtype=param.dtype)
    missing, unexpected = model.load_state_dict(vlm_mlp_to_expert0(plain.state_dict()), strict=False)
    new = [k for k in missing if ".moe.experts.1." not in k]
    if new or unexpected:
        raise ValueError(f"the plain model's keys do not match: missing {new[:5]}, unexpected {unexpected[:5]}")
    model.train(plain.training)
    return model


def _read_safetensors_dir(directory: str) -> dict:
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory!r} holds no .safetensors file")
    state = {}
    for name in files:
        part = load_file(os.path.join(directory, name))
        twice = sorted(set(part) & set(state))
        if twice:
            raise ValueError(f"{name} repeats keys of another shard: {twice[:5]}")
        state.update(part)
    return state


def _tied_keys(model) -> set:
    """Keys a checkpoint stores once because the model ties them to another: ``lm_head.weight`` when the output
    head is the input embedding (``tie_word_embeddings``, as in Qwen2.5-VL-3B), as transformers saves it."""
    return {"lm_head.weight"} if model.lm_head.weight is model.get_input_embeddings().weight else set()


def load_wallx(model, directory: str, strict: bool = True) -> dict:
    """Load a Wall-X-format safetensors directory (``model.safetensors`` or shards with their index) into the
    dual-expert model. Keys the backbone does not own (``action_preprocessor.*``, LoRA adapters, ...) are
    returned, never dropped; with ``strict`` every missing or mis-shaped backbone key raises, named (Wall-X
    loads with ``strict=False`` and hides them)."""
    state = from_wallx_keys(_read_safetensors_dir(directory), model)
    own = model.state_dict()
    theirs = {k: v for k, v in state.items() if k in own}
    others = {k: v for k, v in state.items() if k not in own}
    shapes = [f"{k}: file {tuple(v.shape)}, model {tuple(own[k].shape)}" for k, v in theirs.items()
              if v.shape != own[k].shape]
    if shapes:
        raise ValueError("checkpoint shapes do not match the model:\n  " + "\n  ".join(shapes))
    missing = sorted(set(own) - set(theirs) - _tied_keys(model))  # a tied key is loaded with its twin
    if strict and missing:
        raise ValueError(f"{directory!r} lacks {len(missing)} keys of the model: {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}")
    model.load_state_dict(theirs, strict=False)
    return others


def save_pretrained(model, directory: str, extra: dict | None = None) -> str:
    """Write ``model.safetensors`` (Wall-X's keys; ``extra`` tensors such as an action preprocessor's beside
    them) and ``config.json`` (transformers' config plus Wall-X's ``mlp_moe`` / ``experts``)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = to_wallx_keys({k: v.detach().contiguous() for k, v in model.state_dict().items()}, model)
    for key in _tied_keys(model):
        state.pop(key, None)
    clash = sorted(set(state) & set(extra or {}))
    if clash:
        raise ValueError(f"extra repeats model keys: {clash[:5]}")
    path = os.path.join(directory, "model.safetensors")
    save_file({**state, **(extra or {})}, path)
    config = model.config.to_dict()
    ffn = decoder_layers(model)[0].moe.cfg
    config.update(mlp_moe=True, num_experts=2, experts=[
        {"hidden_size": ffn.hidden, "intermediate_size": w, "hidden_act": ffn.activation} for w in ffn.intermediate],
        sptr_moe=dataclasses.asdict(model.moe_config))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
    return path
