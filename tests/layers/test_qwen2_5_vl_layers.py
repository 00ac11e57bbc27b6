"""MultimodalRotaryEmbedding and VisionIndices against transformers 4.49's modules; the 5.x-form adapter."""
import pytest
import torch

from sptr.layers import MultimodalRotaryEmbedding, MultimodalRotaryEmbeddingConfig, VisionIndices, VisionIndicesConfig
from sptr.ops import vision_index as vi

hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found


def test_rotary_embedding_matches_hf():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(hidden_size=256, num_attention_heads=2, rope_theta=1e6,
                           rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    theirs = hf.hf.Qwen2_5_VLRotaryEmbedding(cfg)
    ours = MultimodalRotaryEmbedding(MultimodalRotaryEmbeddingConfig(head_dim=128))
    pos = torch.randint(0, 3000, (3, 2, 50))
    x = torch.randn(2, 4, 50, 128, dtype=torch.bfloat16)
    c1, s1 = theirs(x, pos)
    c2, s2 = ours(x, pos)
    assert torch.equal(c1, c2) and torch.equal(s1, s2)
    q, k = torch.randn(2, 4, 50, 128, dtype=torch.bfloat16), torch.randn(2, 2, 50, 128, dtype=torch.bfloat16)
    want = hf.apply_multimodal_rotary_pos_emb(q, k, c1, s1, [16, 24, 24])
    got = ours.rotate(q, k, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="mrope_section"):
        MultimodalRotaryEmbeddingConfig(head_dim=128, mrope_section=(16, 24, 25))


def test_vision_indices_match_the_tower():
    grids = torch.tensor([[1, 18, 18], [2, 8, 12], [1, 2, 34]])
    out = VisionIndices(VisionIndicesConfig())(grids)
    assert torch.equal(out.rotary_pos_emb, hf.rot_pos_emb(grids))
    idx, cu = hf.window_index(grids)
    assert torch.equal(out.window_index, idx) and torch.equal(out.cu_window_seqlens, cu)
    assert torch.equal(out.reverse_index, torch.argsort(idx))
    n = out.rotary_pos_emb.shape[0]
    emb = hf.rot_pos_emb(grids).reshape(n // 4, 4, -1)[idx].reshape(n, -1)
    emb = torch.cat([emb, emb], -1)
    assert torch.equal(out.position_embeddings[0], emb.cos()) and torch.equal(out.position_embeddings[1], emb.sin())
    assert out.cu_seqlens.tolist() == [0, 324, 420, 516, 584]


def test_hf5_form_agrees_with_hf449_form_on_well_formed_rows():
    IMG, VS = hf.IMG, hf.VS
    row = [5, VS] + [IMG] * 6 + [7, 8, VS] + [IMG] * 4 + [9]
    ids = torch.tensor([row, [1] * 4 + row[:9] + [7, 8, 9]])  # the second row: one image block, left padding
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    grids = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 4, 6]])
    types = (ids == IMG).long()
    old, old_delta = vi.get_rope_index(ids, grids, None, None, mask, 2, IMG, hf.VID, VS, 2)
    new, new_delta = vi.get_rope_index_hf5(ids, types, grids, None, None, mask)
    valid = mask.bool()
    assert torch.equal(old[:, valid], new[:, valid])
    assert torch.all(new[:, ~valid] == 0) and torch.all(old[:, ~valid] == 1)
    assert torch.equal(new_delta, old_delta + (mask.shape[1] - mask.sum(-1, keepdim=True)))
