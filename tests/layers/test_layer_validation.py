"""Bad configurations fail when built and bad inputs at the layer boundary, each error naming the key or input
(issue 16 items 10-12)."""
import math

import numpy as np
import pytest
import torch

import sptr
from sptr.layers import (
    SparseTrTensor,
    SphereFormer,
    SphereFormerConfig,
    VarLengthMultiheadSA,
    VarLengthMultiheadSAConfig,
)
from sptr.ops import RelativePosition, quantised_coords, window_attention, window_partition


@pytest.mark.parametrize("field,value,error,match", [
    ("dim", 32.0, TypeError, "SphereFormerConfig.dim must be an int"),
    ("drop_path", "0", TypeError, "SphereFormerConfig.drop_path must be a finite number"),
    ("qkv_bias", "no", TypeError, "SphereFormerConfig.qkv_bias must be a bool"),
    ("indice_key", 5, TypeError, "SphereFormerConfig.indice_key must be a str"),
    ("mlp_ratio", 1e-6, ValueError, "mlp_ratio 1e-06 gives an MLP of width 0"),
    ("window_size", (0.3, 0.0, 0.3), ValueError, "SphereFormerConfig.window_size must be 3 finite numbers > 0"),
    ("window_size", (0.3, -1.0, 0.3), ValueError, "window_size must be 3 finite"),
    ("quant_size", (math.nan,) * 3, ValueError, "quant_size must be 3 finite"),
    ("window_size_sphere", (2.0, 2.0), ValueError, "window_size_sphere must be 3 finite"),
    ("qk_scale", 0.0, ValueError, "qk_scale must be positive"),
    ("a", -1.0, ValueError, "SphereFormerConfig.a must be positive"),
    ("quant_size", (1.0, 1.0, 1.0), ValueError, "at least one quantisation cell"),
])
def test_sphereformer_config_errors(field, value, error, match):
    with pytest.raises(error, match=match):
        SphereFormerConfig(**{field: value})


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(embed_dim=32.0), TypeError, "embed_dim must be an int"),
    (dict(pe_type="bogus"), ValueError, "pe_type must be one of"),
    (dict(embed_dim=15, num_heads=3, pe_type="sine"), ValueError, "pe_type='sine' needs an even embed_dim"),
    (dict(window_size=(0.0, 0.3, 0.3)), ValueError, "window_size must be 3 finite numbers > 0"),
    (dict(qkv_bias="no"), TypeError, "qkv_bias must be a bool"),
    (dict(indice_key=5), TypeError, "indice_key must be a str"),
    (dict(dropout=1.5), ValueError, "dropout must be in"),
    (dict(pe_type="contextual", quant_size=(0.1, 0.1, -0.1)), ValueError, "quant_size must be 3 finite"),
])
def test_var_length_config_and_constructor_errors(kwargs, error, match):
    values = dict(embed_dim=16, num_heads=2, indice_key="k", window_size=(0.3, 0.3, 0.3)) | kwargs
    with pytest.raises(error, match=match):
        VarLengthMultiheadSAConfig(**values)
    extra = dict(rel_query=True, rel_key=True, rel_value=True) if values.get("pe_type") == "contextual" else {}
    if values.get("quant_size") is not None:
        extra["quant_size"] = values.pop("quant_size")
    with pytest.raises(error, match=match):
        VarLengthMultiheadSA(**values, **extra)


def test_from_yaml_empty_file_and_missing_section(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no mapping of config keys.*an empty file"):
        SphereFormerConfig.from_yaml(str(empty))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("block:\n  dim: 64\n  num_heads: 4\n")
    assert SphereFormerConfig.from_yaml(str(cfg), "block").dim == 64
    with pytest.raises(ValueError, match="has no section 'net'"):
        SphereFormerConfig.from_yaml(str(cfg), "net")
    with pytest.raises(ValueError, match="unknown keys"):
        SphereFormerConfig.from_yaml(str(cfg))


def scene(n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xyz = torch.rand(n, 3, generator=gen) * 2
    batch = torch.zeros(n, dtype=torch.long)
    batch[n // 2:] = 1
    return torch.randn(n, 32, generator=gen), xyz, batch


def test_sphereformer_forward_input_errors():
    block = SphereFormer(SphereFormerConfig())
    feats, xyz, batch = scene()
    with pytest.raises(ValueError, match=r"feats must have shape \(\*, 32\), got \(40, 16\)"):
        block(feats[:, :16], xyz, batch)
    with pytest.raises(ValueError, match=r"xyz must be an \(N, 3\) tensor"):
        block(feats, xyz[:, :2], batch)
    with pytest.raises(ValueError, match=r"batch must be a tensor of shape \(40,\)"):
        block(feats, xyz, batch[:-1])
    with pytest.raises(ValueError, match="xyz must hold the 40 points of feats"):
        block(feats, xyz[:-1], batch[:-1])
    with pytest.raises(TypeError, match="xyz must be a floating tensor"):
        block(feats, xyz.long(), batch)
    nan = xyz.clone()
    nan[3, 1] = math.nan
    with pytest.raises(ValueError, match="xyz must be finite"):
        block(feats, nan, batch)


def test_var_length_forward_input_errors():
    layer = VarLengthMultiheadSA(32, 2, "k", 0.5)
    feats, xyz, batch = scene()
    indices = torch.cat([batch[:, None].float(), xyz], 1)
    with pytest.raises(ValueError, match=r"query_feats must have shape \(\*, 32\)"):
        layer(SparseTrTensor(feats[:, :8], indices, None, 2))
    with pytest.raises(ValueError, match=r"query_indices must have shape \(40, 4\)"):
        layer(SparseTrTensor(feats, indices[:, :3], None, 2))
    with pytest.raises(ValueError, match=r"key_feats must have shape \(40, 32\)"):
        layer(SparseTrTensor(feats, indices, None, 2, key_feats=feats[:30]))
    with pytest.raises(TypeError, match="must be a SparseTrTensor"):
        layer(feats)


def test_fourier_position_embedding_in_float64():
    layer = VarLengthMultiheadSA(32, 2, "k", 0.5, pe_type="fourier").double()
    feats, xyz, batch = scene()
    indices = torch.cat([batch[:, None].double(), xyz.double()], 1)
    out = layer(SparseTrTensor(feats.double(), indices, None, 2)).query_feats
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


@pytest.mark.parametrize("size", [0.0, -0.5, math.nan, (0.3, 0.3, 0.0)])
def test_window_ops_reject_bad_sizes(size):
    _, xyz, batch = scene()
    with pytest.raises(ValueError, match="window_size must be positive and finite"):
        sptr.get_indices_params(xyz, batch, size, False)
    with pytest.raises(ValueError, match="window_size must be positive and finite"):
        window_partition(xyz, batch, size, False)
    with pytest.raises(ValueError, match="quant_size must be positive and finite"):
        quantised_coords(xyz, 0.5, size, False)
    with pytest.raises(ValueError, match="size must be positive and finite"):
        sptr.grid_sample(xyz, batch, size, return_p2v=False)


def test_window_ops_reject_bad_points():
    _, xyz, batch = scene()
    with pytest.raises(ValueError, match=r"xyz must be an \(N, 3\) tensor"):
        sptr.get_indices_params(xyz[:, 0], batch, 0.5, False)
    with pytest.raises(TypeError, match="xyz must be a floating tensor"):
        window_partition(xyz.int(), batch, 0.5, False)
    with pytest.raises(ValueError, match=r"pos must be an \(N, 3\) tensor"):
        sptr.grid_sample(xyz[:, :2], batch, 0.5)


def test_window_attention_argument_errors():
    q = torch.randn(5, 1, 0)
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim >= 1"):
        window_attention(q, q, q, offsets)
    q = torch.randn(5, 1, 4)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        window_attention(q, q, q, offsets, scale=math.nan)
    coords = torch.zeros(5, 3, dtype=torch.int32)
    table = torch.randn(3, 3, 1, 4)
    with pytest.raises(TypeError, match="rel_pos.rel_shift must be an int"):
        window_attention(q, q, q, offsets, rel_pos=RelativePosition(coords, 1.5, table))
    for radius in (torch.ones(5, dtype=torch.complex64), torch.ones(5, dtype=torch.int64)):
        with pytest.raises(TypeError, match="rel_pos.radius must have dtype"):
            window_attention(q, q, q, offsets, rel_pos=RelativePosition(coords, 1, table, radius=radius,
                                                                        radial_a=0.1))
    with pytest.raises(ValueError, match="rel_pos.radial_a must be a finite number > 0"):
        window_attention(q, q, q, offsets, rel_pos=RelativePosition(coords, 1, table, radius=torch.ones(5),
                                                                    radial_a=np.float64(math.inf)))
