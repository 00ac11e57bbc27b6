"""rope_index / rot_pos_emb / window index: bit-exact against transformers 4.49 (spec §5-§7, issue 4)."""
import random

import pytest
import torch

from sptr.ops import vision_index as vi
from tests.helpers import device_params
hf = pytest.importorskip("tests.ops.hf_oracle", exc_type=ImportError)  # skips with the version found

IMG, VID, VS, TEXT, VE = hf.IMG, hf.VID, hf.VS, 1000, 151653


def ours(ids, img=None, vid=None, sec=None, mask=None, device="cpu", tps=2):
    to = lambda t: None if t is None else (t.to(device) if isinstance(t, torch.Tensor) else t)  # noqa: E731
    pos, delta = vi.get_rope_index(to(ids), to(img), to(vid), to(sec), to(mask), 2, IMG, VID, VS, tps)
    return pos.cpu(), delta.cpu()


def assert_same(got, want):
    pos, delta = got
    assert torch.equal(pos, want[0].long()), (pos, want[0])
    assert torch.equal(delta, want[1].long().reshape(-1, 1)), (delta, want[1])


def random_sample(rng, images, videos, sec_choices=(0.5, 0.7, 1.3, 1.0)):
    """One row: text, vision blocks (VS, tokens, VE) in random order; returns tokens and the grids used."""
    blocks = ["img"] * images + ["vid"] * videos
    rng.shuffle(blocks)
    tokens, img_grids, vid_grids, secs = [TEXT] * rng.randint(0, 3), [], [], []
    for kind in blocks:
        t = 1 if kind == "img" else rng.choice([2, 3, 8])
        h, w = 2 * rng.randint(1, 7), 2 * rng.randint(1, 9)
        (img_grids if kind == "img" else vid_grids).append([t, h, w])
        if kind == "vid":
            secs.append(rng.choice(sec_choices))
        tokens += [VS] + [IMG if kind == "img" else VID] * (t * h * w // 4) + [VE] + [TEXT] * rng.randint(0, 4)
    return tokens, img_grids, vid_grids, secs


def batch(rows, pad_side, rng):
    S = max(len(r[0]) for r in rows) + rng.randint(0, 3)
    ids = torch.full((len(rows), S), 0, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for b, (tok, *_rest) in enumerate(rows):
        sl = slice(S - len(tok), S) if pad_side == "left" else slice(0, len(tok))
        ids[b, sl] = torch.tensor(tok)
        mask[b, sl] = 1
    grid = lambda k: [g for r in rows for g in r[k]]  # noqa: E731
    img, vid, sec = grid(1), grid(2), grid(3)
    return (ids, torch.tensor(img) if img else None, torch.tensor(vid) if vid else None,
            torch.tensor(sec) if sec else None, mask)


def test_spec_examples():
    ids = torch.tensor([[TEXT, VS] + [IMG] * 4 + [VE, TEXT]])
    pos, delta = ours(ids, img=torch.tensor([[1, 4, 4]]))
    assert pos[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    assert delta.tolist() == [[-2]]
    ids = torch.tensor([[VS] + [VID] * 8 + [TEXT]])
    pos, delta = ours(ids, vid=torch.tensor([[2, 4, 4]]), sec=torch.tensor([0.5]))
    assert pos[0, 0].tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3] and delta.tolist() == [[-6]]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad_side", ["left", "right"])
def test_random_batches_match_hf(device, seed, pad_side):
    rng = random.Random(seed)
    rows = [random_sample(rng, rng.randint(0, 3), rng.randint(0, 2)) for _ in range(rng.randint(1, 4))]
    ids, img, vid, sec, mask = batch(rows, pad_side, rng)
    if img is None and vid is None:
        img = torch.zeros(0, 3, dtype=torch.long)
    want = hf.rope_index(ids, img, vid, sec, mask)
    assert_same(ours(ids, img, vid, sec, mask, device), want)
    # the same batch with an int32 and a bool mask, and int32 grids
    assert_same(ours(ids, img.int() if img is not None else None, vid, sec, mask.int(), device), want)
    assert_same(ours(ids, img, vid, sec, mask.bool(), device), want)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("length", [2500, 5000])
def test_long_rows_match_hf(device, length):
    """Rows longer than a CTA's 1024 threads (the CUDA scans loop over chunks) and, at 5000 tokens, longer than
    a row that fits in shared memory (the CUDA kernel keeps it in global scratch), vision blocks on both sides
    of the chunk boundaries."""
    rng = random.Random(length)
    rows = []
    for _ in range(3):
        tok, img, vid, sec = random_sample(rng, 3, 1)
        lead = rng.randint(0, length - len(tok))
        rows.append(([TEXT] * lead + tok + [TEXT] * (length - lead - len(tok)), img, vid, sec))
    ids, img, vid, sec, mask = batch(rows, "left", rng)
    assert_same(ours(ids, img, vid, sec, mask, device), hf.rope_index(ids, img, vid, sec, mask))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("rows", [5, 40])
def test_masks_with_holes_match_hf(device, rows):
    """Masked tokens anywhere in a row, between a vision-start token and its block too: only the valid tokens
    form the row (the CUDA kernel compacts it first), so a block starts where the next valid token after a
    vision-start token is an image or video token."""
    rng = random.Random(rows)
    samples = [random_sample(rng, rng.randint(0, 3), rng.randint(0, 2)) for _ in range(rows)]
    width = max(len(tok) for tok, *_ in samples) * 2 + 8
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b, (tok, *_rest) in enumerate(samples):
        row, valid = [], []
        for t in [TEXT] + tok:  # no row all padding (transformers cannot position one)
            while rng.random() < (0.5 if row and row[-1] == VS and valid[-1] else 0.1):
                row.append(rng.choice([TEXT, IMG, VID, VS]))
                valid.append(0)
            row.append(t)
            valid.append(1)
        ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), torch.tensor(valid)
    grid = lambda k: [g for r in samples for g in r[k]]  # noqa: E731
    img, vid, sec = (torch.tensor(grid(k)) if grid(k) else None for k in (1, 2, 3))
    assert_same(ours(ids, img, vid, sec, mask, device), hf.rope_index(ids, img, vid, sec, mask))


@pytest.mark.parametrize("device", device_params())
def test_more_rows_than_sms_match_hf(device):
    """More rows than a GPU has SMs: the CUDA kernel then takes rows by ticket and looks back over zeroed flags
    instead of a cooperative launch with a grid barrier (up to one row per SM, which the other tests cover)."""
    rng = random.Random(300)
    rows = [random_sample(rng, rng.randint(1, 2), rng.randint(0, 1)) for _ in range(300)]
    ids, img, vid, sec, mask = batch(rows, "right", rng)
    assert_same(ours(ids, img, vid, sec, mask, device), hf.rope_index(ids, img, vid, sec, mask))


@pytest.mark.parametrize("device", device_params())
def test_video_without_seconds_and_fp32_time_rule(device):
    ids = torch.tensor([[VS] + [VID] * 44 + [TEXT]])
    vid = torch.tensor([[11, 2, 8]])
    assert_same(ours(ids, vid=vid, device=device), hf.rope_index(ids, None, vid))
    sec = torch.tensor([0.7])  # fl32 order matters: tau(5) = 7, not 6
    assert_same(ours(ids, vid=vid, sec=sec, device=device), hf.rope_index(ids, None, vid, sec))
    assert_same(ours(ids, vid=vid, sec=sec.double(), device=device), hf.rope_index(ids, None, vid, sec.double()))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("wm", [41, 47, 55, 61, 82, 123])
def test_merged_widths_the_published_kernel_gets_wrong(device, wm):
    ids = torch.tensor([[TEXT, VS] + [IMG] * (3 * wm) + [VE, TEXT]])
    img = torch.tensor([[1, 6, 2 * wm]])
    assert_same(ours(ids, img=img, device=device), hf.rope_index(ids, img))


@pytest.mark.parametrize("device", device_params())
def test_many_blocks_in_a_row_and_text_only(device):
    tokens, grids = [], []
    for _ in range(70):  # > 64 vision blocks in one row
        tokens += [TEXT, VS, IMG, VE]
        grids.append([1, 2, 2])
    ids, img = torch.tensor([tokens]), torch.tensor(grids)
    assert_same(ours(ids, img=img, device=device), hf.rope_index(ids, img))
    ids = torch.randint(0, 100, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, 6:] = 0
    assert_same(ours(ids, mask=mask, device=device), hf.rope_index(ids, attention_mask=mask))
    assert_same(ours(ids, device=device), hf.rope_index(ids))


GRIDS = [[[1, 2, 2]], [[1, 4, 82]], [[1, 18, 18]] * 24, [[1, 16, 16]], [[3, 8, 16]], [[1, 64, 64]] * 24,
         [[1, 2, 2], [2, 10, 6], [1, 36, 20]], [[1, 34, 2]]]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{len(g)}x{g[0]}")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rot_pos_emb_and_window_index_match_hf(device, grid, dtype):
    g = torch.tensor(grid, dtype=dtype)
    want = hf.rot_pos_emb(g)
    inv_freq = hf.vision_tower().rotary_pos_emb.inv_freq
    got = vi.rot_pos_emb(inv_freq.to(device), g.to(device), 2)
    assert got.device.type == device and torch.equal(got.cpu(), want)
    idx, cu = hf.window_index(g)
    got_idx, got_cu = vi.get_window_index(g.to(device), 2, 112 // 2 // 14, 14, 4)
    assert torch.equal(got_idx.cpu().long(), idx) and torch.equal(got_cu.cpu(), cu)
    _, cu1 = vi.get_window_index(g.to(device), 2, 4, 14, 1)
    assert torch.equal(cu1.cpu() * 4, cu)


def test_vision_index_errors_and_empty():
    with pytest.raises(ValueError, match="divisible"):
        vi.rot_pos_emb(torch.rand(20), torch.tensor([[1, 3, 4]]), 2)
    with pytest.raises(TypeError, match="grid_thw"):
        vi.rot_pos_emb(torch.rand(20), torch.tensor([[1.0, 4, 4]]), 2)
    empty = torch.zeros(0, 3, dtype=torch.long)  # transformers fails on both (a cat of no tensors)
    with pytest.raises(ValueError, match="grid_thw has no rows"):
        vi.rot_pos_emb(torch.rand(20), empty, 2)
    with pytest.raises(ValueError, match="grid_thw has no rows"):
        vi.get_window_index(empty, 2, 4, 14, 4)


def test_opcheck_vision_ops():
    ids = torch.tensor([[TEXT, VS] + [IMG] * 4 + [VE, TEXT]])
    torch.library.opcheck(torch.ops.sptr.rope_index.default,
                          (ids, torch.tensor([[1, 4, 4]]), None, None, None, 2, IMG, VID, VS, 2.0))
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.sptr.vision_rot_pos_emb.default, (torch.rand(4), torch.tensor([[1, 4, 4]]), 2),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.sptr.vision_window_index.default, (torch.tensor([[1, 4, 8]]), 2, 4, 4),
                          test_utils=tests)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("tps", [2, 25])
def test_video_time_index_in_the_seconds_dtype(device, dtype, tps):
    """transformers computes arange(t) * seconds * tokens_per_second in the seconds tensor's dtype (a model
    cast to bf16 feeds bf16 seconds): each product rounds to that dtype before the truncation."""
    seconds = [0.7, 1 / 3, 0.29, 1.9, 0.51]
    tokens, grids = [TEXT], []
    for _ in seconds:
        tokens += [VS] + [VID] * (40 * 4) + [VE, TEXT]
        grids.append([40, 2, 8])
    ids, vid = torch.tensor([tokens]), torch.tensor(grids)
    sec = torch.tensor(seconds, dtype=dtype)
    assert_same(ours(ids, vid=vid, sec=sec, device=device, tps=tps), hf.rope_index(ids, None, vid, sec, tps=tps))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rot_pos_emb_in_the_dtype_of_inv_freq(device, dtype):
    """model.to(torch.bfloat16) casts the tower's inv_freq buffer; transformers then makes the positions and
    their products in bf16, and so must the kernel (positions past 256 round in bf16)."""
    g = torch.tensor([[1, 18, 18], [2, 6, 300]])
    tower = hf.vision_tower()
    tower.rotary_pos_emb = tower.rotary_pos_emb.to(dtype)
    want = hf.hf.Qwen2_5_VisionTransformerPretrainedModel.rot_pos_emb(tower, g)
    got = vi.rot_pos_emb(tower.rotary_pos_emb.inv_freq.to(device), g.to(device), 2)
    assert got.dtype == want.dtype == dtype and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", device_params())
def test_rope_index_raises_where_transformers_raises(device):
    body = [TEXT, VS] + [IMG] * 4 + [VE, TEXT]
    ids, img = torch.tensor([body]), torch.tensor([[1, 4, 4]])
    cases = [
        (dict(img=torch.tensor([[1, 0, 4]])), "image_grid_thw must hold positive sizes"),
        (dict(img=torch.tensor([[-1, 4, 4]])), "image_grid_thw must hold positive sizes"),
        (dict(ids=torch.tensor([body * 2]), img=img), r"more image blocks .* than image_grid_thw has rows \(1"),
        (dict(ids=torch.tensor([[TEXT, VS] + [VID] * 4 + [VE]]), img=img),
         r"more video blocks .* video_grid_thw has rows \(0, it is None"),
        (dict(ids=torch.tensor([body + [VS]]), img=img), "ends with vision_start_token_id"),
        (dict(img=img, mask=torch.tensor([[1, 1, 1, 1, 1, 1, 2, 1]])), "attention_mask must hold only 0 and 1"),
        (dict(img=img, mask=torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 0.5]])), "attention_mask must hold only 0"),
        (dict(ids=torch.tensor([body, [TEXT] * 8]), img=img, mask=torch.tensor([[1] * 8, [0] * 8])),
         "all padding"),
    ]
    for case, match in cases:
        args = dict(ids=ids) | case
        with pytest.raises(ValueError, match=match):
            ours(args["ids"], args.get("img"), args.get("vid"), mask=args.get("mask"), device=device)
        if "mask" in case and "all padding" not in match:
            continue  # transformers silently drops the tokens whose mask is not == 1; sptr says so instead
        with pytest.raises(Exception):  # transformers fails on each of the others too
            hf.rope_index(args["ids"], args.get("img"), args.get("vid"), None, args.get("mask"))
    # the right-padded row ending with vision start inside its padding is fine (transformers reads the kept tokens)
    mask = torch.tensor([[1] * 8 + [0]])
    padded = torch.tensor([body + [VS]])
    assert_same(ours(padded, img, mask=mask, device=device), hf.rope_index(padded, img, attention_mask=mask))


@pytest.mark.parametrize("device", device_params())
def test_rope_index_int32_ids_give_the_int64_result(device):
    ids = torch.tensor([[TEXT, VS] + [IMG] * 4 + [VE, TEXT]])
    img = torch.tensor([[1, 4, 4]])
    with pytest.raises(RuntimeError):  # transformers cannot write int64 positions into its int32 buffer
        hf.rope_index(ids.int(), img)
    assert_same(ours(ids.int(), img, device=device), hf.rope_index(ids, img))


def test_rope_index_checks_are_skipped_without_data_checks():
    from sptr.ops import data_checks

    ids = torch.tensor([[TEXT, VS] + [IMG] * 4 + [VE, TEXT, VS]])
    with data_checks(False):
        pos, delta = ours(ids, torch.tensor([[1, 4, 4]]))
    assert pos.shape == (3, 1, 9) and delta.shape == (1, 1)
