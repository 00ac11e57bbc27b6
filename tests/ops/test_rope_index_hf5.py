"""The transformers 5.x call form against transformers 5.x itself (runs where transformers 5 is installed)."""
import functools
import random
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5."):
    pytest.skip(f"needs transformers 5.x, found {transformers.__version__}", allow_module_level=True)

from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf5  # noqa: E402

from sptr.ops import vision_index as vi  # noqa: E402
from tests.helpers import device_params  # noqa: E402

IMG, VID, VS, VE = 151655, 151656, 151652, 151653


def hf5_rope_index(ids, types, img, vid, sec, mask):
    cfg = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=2))
    stub = SimpleNamespace(config=cfg, get_vision_position_ids=functools.partial(
        hf5.Qwen2_5_VLModel.get_vision_position_ids, None))
    return hf5.Qwen2_5_VLModel.get_rope_index(stub, ids, types, img, vid, sec, mask)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("seed", range(4))
def test_matches_transformers5_on_images(device, seed):
    rng = random.Random(seed)
    rows, grids = [], []
    for _ in range(rng.randint(1, 3)):
        row = [3] * rng.randint(1, 3)
        for _ in range(rng.randint(1, 3)):
            h, w = 2 * rng.randint(1, 6), 2 * rng.randint(1, 6)
            grids.append([1, h, w])
            row += [VS] + [IMG] * (h * w // 4) + [VE] + [4] * rng.randint(0, 2)
        rows.append(row)
    S = max(map(len, rows)) + 2
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, S - len(r):] = torch.tensor(r)
        mask[b, S - len(r):] = 1
    types = (ids == IMG).long()
    img = torch.tensor(grids)
    want = hf5_rope_index(ids, types, img, None, None, mask)
    got = vi.get_rope_index_hf5(ids.to(device), types.to(device), img.to(device), None, None, mask.to(device))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1].reshape(-1, 1))
