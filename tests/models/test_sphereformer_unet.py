"""The SphereFormer U-Net: configs, the released checkpoints' keys, loading, spconv on CPU, training, inference."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("spconv", reason="the SphereFormer U-Net needs spconv (pip install spconv)")

from sptr.data import collate_scans, lidar_scan, read_kitti_bin, voxelize_scan, write_kitti_label  # noqa: E402
from sptr.data.labels import LabelMap  # noqa: E402
from sptr.integrations.spconv_backend import import_spconv  # noqa: E402
from sptr.models.sphereformer import (  # noqa: E402
    SphereFormerUNet, SphereFormerUNetConfig, load_pretrained, pool_coordinates, predict_scans, save_pretrained,
    sparse_input)
from tests.helpers import requires_cuda  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {name: os.path.join(ROOT, "configs", f"sphereformer_{name}.yaml")
           for name in ("semantickitti", "nuscenes", "waymo")}
KEYS_FILE = os.path.join(os.path.dirname(__file__), "sphereformer_semantickitti_keys.txt")
spconv = import_spconv()


def small_config(**overrides):
    """Two levels (C 32 / 64): the whole structure at a fraction of the CPU time."""
    return SphereFormerUNetConfig(**{"channels": (32, 64), "sphere_layers": (1, 2), **overrides})


def scan_batch(cfg, points=1500, scans=1, device="cpu", seed=0):
    voxels = [voxelize_scan(lidar_scan(points, seed=seed + i)[0].to(device), cfg.voxel_size, cfg.pc_range)
              for i in range(scans)]
    feats, coords, xyz, batch, _ = collate_scans(voxels)
    return sparse_input(feats, coords, batch, scans), xyz, batch


def released_keys():
    keys = {}
    for line in open(KEYS_FILE):
        if line.startswith("#") or not line.strip():
            continue
        name, *shape = line.split()
        keys[name] = tuple(int(s) for s in shape[0].split(",")) if shape else ()
    return keys


# ---------------------------------------------------------------- configs

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_yaml_round_trips(name, tmp_path):
    cfg = SphereFormerUNetConfig.from_yaml(CONFIGS[name])
    assert SphereFormerUNetConfig.from_dict(cfg.to_dict()) == cfg
    model = SphereFormerUNet(cfg)
    _, path = save_pretrained(model, str(tmp_path))
    assert SphereFormerUNetConfig.from_yaml(path) == cfg


def test_config_rejects_unknown_and_bad_values():
    with pytest.raises(ValueError, match="unknown keys \\['layers'\\]"):
        SphereFormerUNetConfig.from_dict({"layers": [32, 64]})
    with pytest.raises(ValueError, match="channels"):
        SphereFormerUNetConfig(channels=(32, 40))
    with pytest.raises(ValueError, match="sphere_layers"):
        SphereFormerUNetConfig(sphere_layers=(1, 6))
    with pytest.raises(ValueError, match="attention_dtype"):
        SphereFormerUNetConfig(attention_dtype="half")
    with pytest.raises(ValueError, match="pc_range"):
        SphereFormerUNetConfig(pc_range=((0, 0), (1, 1)))


def test_levels_follow_the_published_table():
    """Spec §7: cubic 0.3 m·2^(k-1) / 24, angular 2°·1.5^(k-1), radial 80 m, heads C/16, drop path 0.05(k-1)."""
    levels = SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"]).levels()
    assert [(s.channels, s.num_heads) for s in levels] == [(32, 2), (64, 4), (128, 8), (256, 16), (256, 16)]
    for k, s in enumerate(levels):
        np.testing.assert_array_equal(s.window_size, np.float32(0.3) * np.float32(2 ** k) * np.ones(3, np.float32))
        np.testing.assert_array_equal(s.quant_size, s.window_size / 24)
        assert s.window_size.dtype == np.float32
        np.testing.assert_allclose(s.window_size_sphere, [2 * 1.5 ** k, 2 * 1.5 ** k, 80], rtol=0)
        np.testing.assert_allclose(s.quant_size_sphere, [2 * 1.5 ** k / 24, 2 * 1.5 ** k / 24, 80 / 24], rtol=1e-15)
        assert s.drop_path == pytest.approx(0.05 * k, abs=1e-7)
    nuscenes = SphereFormerUNetConfig.from_yaml(CONFIGS["nuscenes"]).levels()
    assert nuscenes[1].window_size[0] == np.float32(1.2) and nuscenes[1].window_size_sphere[0] == 4.0


# ---------------------------------------------------------------- released checkpoints

def test_model_has_the_released_keys_and_shapes():
    keys = released_keys()
    assert len(keys) == 366
    model = SphereFormerUNet(SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"]))
    assert {f"module.{k}": tuple(v.shape) for k, v in model.state_dict().items()} == keys
    assert sum(p.numel() for p in model.parameters()) == 32_311_715
    # the spec's explicit per-level transformer keys
    prefixes = ["module.unet." + "u." * k for k in range(5)]
    for p, (c, h) in zip(prefixes, [(32, 2), (64, 4), (128, 8), (256, 16), (256, 16)]):
        t = p + "transformer_block."
        assert keys[t + "attn.relative_pos_query_table"] == (47, 3, h // 2, 16)
        assert keys[t + "attn.relative_pos_value_table_sphere"] == (48, 3, h // 2, 16)
        assert keys[t + "attn.qkv.weight"] == (3 * c, c) and keys[t + "mlp.fc2.weight"] == (c, 4 * c)
        assert sum(k.startswith(t) for k in keys) == 18
    assert keys["module.input_conv.0.weight"] == (32, 3, 3, 3, 4)


def released_state_dict(layout="2.2", seed=0):
    """A state dict with the released names and shapes and random values (BN statistics included)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in released_keys().items():
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(7)
        elif name.endswith("running_var"):
            state[name] = torch.rand(shape, generator=gen) + 0.5
        else:
            state[name] = torch.randn(shape, generator=gen) * 0.05
        if layout == "2.1" and len(shape) == 5:  # spconv 2.1 stored (k, k, k, out, in)
            state[name] = state[name].permute(1, 2, 3, 0, 4).contiguous()
    return state


@pytest.fixture(scope="module")
def full_model():
    return SphereFormerUNet(SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"])).eval()


def test_released_checkpoint_loads_strictly_and_round_trips(full_model, tmp_path):
    state = released_state_dict()
    path = tmp_path / "model_best.pth"
    torch.save({"epoch": 50, "state_dict": state, "best_iou": 0.7}, path)
    load_pretrained(full_model, str(path))
    got = full_model.state_dict()
    assert all(torch.equal(got[k[len("module."):]], v) for k, v in state.items())
    x, xyz, batch = scan_batch(full_model.cfg, points=1200)
    with torch.no_grad():
        before = full_model(x, xyz, batch)
    weights, _ = save_pretrained(full_model, str(tmp_path / "saved"))
    fresh = SphereFormerUNet(full_model.cfg).eval()
    load_pretrained(fresh, weights)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), full_model.state_dict().values()))
    with torch.no_grad():
        after = fresh(x, xyz, batch)
    assert torch.equal(before, after)


def test_checkpoint_as_sphereformer_train_py_writes_it_loads(full_model, tmp_path):
    """train.py's save after a validation: the model plus optimizer and scheduler states, best_iou a numpy float64
    and is_best a numpy bool (weights_only refused their globals); the training entries are ignored."""
    state = released_state_dict()
    opt = torch.optim.SGD(full_model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: (1 - epoch / 50) ** 0.9)
    path = tmp_path / "model_last.pth"
    torch.save({"epoch": 12, "state_dict": state, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "best_iou": np.float64(0.6532), "is_best": np.bool_(True)}, path)
    load_pretrained(full_model, str(path))
    got = full_model.state_dict()
    assert all(torch.equal(got[k[len("module."):]], v) for k, v in state.items())
    torch.save({"state_dict": state, "hook": eval}, tmp_path / "hook.pth")  # a global that runs code: refused
    with pytest.raises(Exception, match="Unsupported global|weights_only"):
        load_pretrained(full_model, str(tmp_path / "hook.pth"))


def test_spconv_21_layout_is_converted(full_model):
    state = released_state_dict(layout="2.1", seed=1)
    assert state["module.input_conv.0.weight"].shape == (3, 3, 3, 32, 4)
    load_pretrained(full_model, state)
    want = released_state_dict(seed=1)
    assert torch.equal(full_model.state_dict()["input_conv.0.weight"], want["module.input_conv.0.weight"])
    assert torch.equal(full_model.state_dict()["unet.conv.2.weight"], want["module.unet.conv.2.weight"])


def test_bad_checkpoints_name_the_key(full_model, tmp_path):
    state = released_state_dict()
    state["module.linear.weight"] = torch.zeros(20, 32)
    with pytest.raises(ValueError, match=r"linear.weight: checkpoint \(20, 32\), model \(19, 32\)"):
        load_pretrained(full_model, state)
    state = released_state_dict()
    del state["module.unet.u.transformer_block.norm1.bias"]
    with pytest.raises(ValueError, match="missing \\['unet.u.transformer_block.norm1.bias'\\]"):
        load_pretrained(full_model, state)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(full_model, str(tmp_path / "nope.pth"))
    with pytest.raises(ValueError, match="spconv_layout"):
        load_pretrained(full_model, released_state_dict(), spconv_layout="2.0")


# ---------------------------------------------------------------- spconv on CPU

def dense_conv(feats, indices, shape, weight, stride=1, padding=1):
    """A dense conv3d over the voxel grid, read back at the given output voxels: (out, k, k, k, in) weights."""
    grid = torch.zeros(1, feats.shape[1], *shape, dtype=feats.dtype)
    i = indices[:, 1:].long()
    grid[0, :, i[:, 0], i[:, 1], i[:, 2]] = feats.T
    return F.conv3d(grid, weight.permute(0, 4, 1, 2, 3), stride=stride, padding=padding)


def test_spconv_cpu_convolutions_are_exact_and_deterministic():
    """Submanifold, strided and inverse convolution against dense conv3d, three runs, two torch threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        cells = torch.unique(torch.randint(0, 24, (2500, 3), generator=gen), dim=0)
        indices = torch.cat([torch.zeros(len(cells), 1, dtype=torch.long), cells], 1).int()
        feats = torch.randn(len(cells), 4, generator=gen, requires_grad=True)
        torch.manual_seed(0)
        subm = spconv.SubMConv3d(4, 16, 3, padding=1, bias=False, indice_key="s")
        down = spconv.SparseConv3d(16, 8, 2, stride=2, bias=False, indice_key="d", algo=spconv.ConvAlgo.Native)
        up = spconv.SparseInverseConv3d(8, 16, 2, bias=False, indice_key="d", algo=spconv.ConvAlgo.Native)
        runs = []
        for _ in range(3):
            feats.grad = None
            for m in (subm, down, up):
                m.weight.grad = None
            y = subm(spconv.SparseConvTensor(feats, indices, [24] * 3, 1))
            z = down(y)
            w = up(z)
            w.features.square().sum().backward()
            runs.append([t.detach().clone() for t in (y.features, z.features, w.features, feats.grad,
                                                      subm.weight.grad, down.weight.grad)])
        for run in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
        ref_y = dense_conv(feats.detach(), indices, [24] * 3, subm.weight.detach())
        i = indices[:, 1:].long()
        torch.testing.assert_close(runs[0][0], ref_y[0, :, i[:, 0], i[:, 1], i[:, 2]].T, rtol=0, atol=1e-5)
        ref_z = dense_conv(runs[0][0], indices, [24] * 3, down.weight.detach(), stride=2, padding=0)
        j = z.indices[:, 1:].long()
        torch.testing.assert_close(runs[0][1], ref_z[0, :, j[:, 0], j[:, 1], j[:, 2]].T, rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_pool_coordinates_is_the_mean_of_merged_voxels():
    cells = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 0, 0], [3, 1, 0], [0, 2, 2]])
    indices = torch.cat([torch.tensor([0, 0, 0, 0, 1])[:, None], cells], 1).int()
    xyz = torch.randn(5, 3)
    batch = indices[:, 0].long()
    down = spconv.SparseConv3d(1, 1, 2, stride=2, bias=False, indice_key="d", algo=spconv.ConvAlgo.Native)
    out = down(spconv.SparseConvTensor(torch.ones(5, 1), indices, [4, 4, 4], 2))
    xyz_next, batch_next = pool_coordinates(xyz, batch, out.indice_dict["d"].indice_pairs, out.features.shape[0])
    for row, idx in enumerate(out.indices.tolist()):
        members = [n for n in range(5) if indices[n, 0] == idx[0] and (cells[n] // 2).tolist() == idx[1:]]
        torch.testing.assert_close(xyz_next[row], xyz[members].mean(0))
        assert batch_next[row] == idx[0]


# ---------------------------------------------------------------- the network

def test_fused_and_step_attention_agree():
    torch.manual_seed(0)
    fused = SphereFormerUNet(small_config()).eval()
    step = SphereFormerUNet(small_config(attention="step")).eval()
    step.load_state_dict(fused.state_dict())
    x, xyz, batch = scan_batch(fused.cfg, scans=2)
    with torch.no_grad():
        a, b = fused(x, xyz, batch), step(x, xyz, batch)
    # fp32 through 2 levels of convs and attention: the two attention paths sum in other orders
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * a.abs().max().item())


def test_training_lowers_the_loss_and_checkpointing_changes_nothing():
    torch.manual_seed(0)
    model = SphereFormerUNet(small_config(drop_path_rate=0.0))
    checkpointed = SphereFormerUNet(small_config(drop_path_rate=0.0, grad_checkpoint_layers=(1, 2)))
    checkpointed.load_state_dict(model.state_dict())
    points, labels = lidar_scan(2000, seed=3)
    scan = voxelize_scan(points, model.cfg.voxel_size, model.cfg.pc_range, mode="random", labels=labels,
                         generator=torch.Generator().manual_seed(0))
    feats, coords, xyz, batch, target = collate_scans([scan])
    grads = []
    for m in (model, checkpointed):
        F.cross_entropy(m(sparse_input(feats, coords, batch), xyz, batch), target).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    optimizer = torch.optim.AdamW(model.param_groups(0.006, 0.02))
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.0006)
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(model(sparse_input(feats, coords, batch), xyz, batch), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("attention_dtype", ["float32", "bfloat16"])
def test_autocast_outputs_are_finite_and_close_to_fp32(attention_dtype):
    torch.manual_seed(0)
    model = SphereFormerUNet(small_config(attention_dtype=attention_dtype)).eval()
    reference = SphereFormerUNet(small_config()).eval()
    reference.load_state_dict(model.state_dict())
    x, xyz, batch = scan_batch(model.cfg)
    with torch.no_grad():
        want = reference(x, xyz, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x, xyz, batch)
    assert torch.isfinite(got).all()
    # bf16 (8-bit mantissa) rounding of every Linear through two levels: a few bf16 ulps of the logits' scale
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() < 0.05 * scale


def test_attention_sees_fp32_under_autocast_unless_asked():
    """SphereFormer's AMP rule: the attention op gets fp32 q/k/v under autocast by default."""
    from sptr.ops import sparse_attention

    seen, saved = [], sparse_attention.window_attention

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return saved(q, *args, **kwargs)

    sparse_attention.window_attention = spy
    try:
        for dtype, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            seen.clear()
            model = SphereFormerUNet(small_config(attention_dtype=dtype)).eval()
            x, xyz, batch = scan_batch(model.cfg, points=600)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(x, xyz, batch)
            assert seen and set(seen) == {want}
    finally:
        sparse_attention.window_attention = saved


# ---------------------------------------------------------------- data and inference

def test_mean_voxelisation_follows_sphereformer():
    points, _ = lidar_scan(3000, seed=5)
    points[0, :3] = torch.tensor([80.0, 0.0, -9.0])  # outside pc_range: clipped, features keep the raw xyz
    cfg = SphereFormerUNetConfig()
    scan = voxelize_scan(points, cfg.voxel_size, cfg.pc_range)
    low, high = torch.tensor(cfg.pc_range[0]), torch.tensor(cfg.pc_range[1])
    xyz = torch.minimum(torch.maximum(points[:, :3], low), high)
    norm = xyz - xyz.min(0).values
    cells = torch.floor(norm / 0.05).long()
    assert torch.equal(cells, scan.coords[scan.point_to_voxel])
    for v in (0, 17, scan.coords.shape[0] - 1):
        members = scan.point_to_voxel == v
        torch.testing.assert_close(scan.xyz[v], xyz[members].mean(0))
        torch.testing.assert_close(scan.feats[v], points[members].mean(0))
    assert scan.xyz[:, 0].max() <= 51.2 and (scan.feats[:, 0] > 51.2).any()


def test_random_voxelisation_keeps_one_point_per_voxel():
    points, labels = lidar_scan(3000, seed=6)
    scan = voxelize_scan(points, (0.05,) * 3, mode="random", labels=labels, voxel_max=1000,
                         generator=torch.Generator().manual_seed(1))
    assert scan.coords.shape[0] == 1000 and torch.unique(scan.coords, dim=0).shape[0] == 1000
    rows = [(points[:, :3] == p).all(1).nonzero()[0, 0].item() for p in scan.xyz[:20]]
    assert torch.equal(labels[rows], scan.labels[:20])
    with pytest.raises(ValueError, match="mode"):
        voxelize_scan(points, mode="train")


def test_kitti_files_round_trip(tmp_path):
    points, labels = lidar_scan(500)
    points.numpy().tofile(tmp_path / "000000.bin")
    assert torch.equal(read_kitti_bin(str(tmp_path / "000000.bin")), points)
    write_kitti_label(str(tmp_path / "000000.label"), labels)
    assert np.array_equal(np.fromfile(tmp_path / "000000.label", dtype=np.uint32), labels.numpy())
    (tmp_path / "bad.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="multiple of 4"):
        read_kitti_bin(str(tmp_path / "bad.bin"))


def test_predict_scans_labels_every_point():
    torch.manual_seed(0)
    model = SphereFormerUNet(small_config()).eval()
    scans = [lidar_scan(800, seed=s)[0] for s in range(2)]
    labels = predict_scans(model, scans)
    assert [label.shape for label in labels] == [(800,), (800,)]
    voxels = [voxelize_scan(p, model.cfg.voxel_size, model.cfg.pc_range) for p in scans]
    feats, coords, xyz, batch, _ = collate_scans(voxels)
    with torch.no_grad():
        logits = model(sparse_input(feats, coords, batch, 2), xyz, batch)
    second = logits[voxels[0].coords.shape[0]:].argmax(1)
    assert torch.equal(labels[1], second[voxels[1].point_to_voxel])


def test_inference_cli_writes_labels(tmp_path):
    model = SphereFormerUNet(SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"]))
    weights, _ = save_pretrained(model, str(tmp_path / "ckpt"))
    points, _ = lidar_scan(1500, seed=2)
    points.numpy().tofile(tmp_path / "scan.bin")
    run = subprocess.run([sys.executable, "-m", "sptr.models.sphereformer", "--config", CONFIGS["semantickitti"],
                          "--checkpoint", weights, "--points", str(tmp_path / "scan.bin"), "--output-dir",
                          str(tmp_path), "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "points/s" in run.stdout and "is_fx_tracing" not in run.stderr
    labels = np.fromfile(tmp_path / "scan.label", dtype=np.uint32)  # raw SemanticKITTI ids (car = 10, ...)
    assert labels.shape == (1500,) and set(labels.tolist()) <= set(LabelMap.named("semantickitti").learning_map_inv.values())


def test_inference_cli_mirrors_the_kitti_layout_and_keeps_existing_files(tmp_path):
    """Two sequences with the same scan names: sequences/XX/predictions/N.label each; a directory argument;
    an existing prediction is kept unless --overwrite; errors are one line, not a traceback."""
    model = SphereFormerUNet(SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"]))
    weights, _ = save_pretrained(model, str(tmp_path / "ckpt"))
    root = tmp_path / "kitti"
    for seq in ("08", "11"):
        (root / "sequences" / seq / "velodyne").mkdir(parents=True)
        lidar_scan(800, seed=int(seq))[0].numpy().tofile(root / "sequences" / seq / "velodyne" / "000000.bin")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "sptr.models.sphereformer", "--config", CONFIGS["semantickitti"], "--checkpoint",
           weights, "--points", str(root), "--output-dir", str(out), "--device", "cpu"]
    run = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    for seq in ("08", "11"):
        assert np.fromfile(out / "sequences" / seq / "predictions" / "000000.label", dtype=np.uint32).shape == (800,)
    again = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    one = subprocess.run(cli + ["--sequences", "8", "--overwrite"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert one.returncode == 0 and one.stdout.count(" points, ") == 1, one.stderr
    flat = [str(root / "sequences" / s / "velodyne" / "000000.bin") for s in ("08", "11")]
    clash = subprocess.run(cli[:7] + ["--points", *flat, "--output-dir", str(tmp_path / "o2"), "--device", "cpu"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert clash.returncode == 0, clash.stderr  # the layout keeps them apart
    missing = subprocess.run(cli[:7] + ["--points", str(tmp_path / "nothing.bin")], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


def test_semantickitti_label_map():
    table = LabelMap.named("semantickitti")
    raw = torch.tensor([10, 40, 252, 0, 1, 52, 81 | (7 << 16)])  # the upper 16 bits: the instance id
    assert table.to_classes(raw).tolist() == [0, 8, 0, 255, 255, 255, 18]
    assert table.to_raw(torch.tensor([0, 8, 18])).tolist() == [10, 40, 81]
    classes = torch.arange(19)
    assert torch.equal(table.to_classes(torch.from_numpy(table.to_raw(classes).astype(np.int64))), classes)
    with pytest.raises(ValueError, match="does not list"):
        table.to_classes(torch.tensor([10, 7]))
    with pytest.raises(ValueError, match="classes must lie in"):
        table.to_raw(torch.tensor([19]))


# ---------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.parametrize("attention_dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(attention_dtype):
    torch.manual_seed(0)
    cpu = SphereFormerUNet(small_config(attention_dtype=attention_dtype)).eval()
    gpu = SphereFormerUNet(small_config(attention_dtype=attention_dtype)).cuda().eval()
    gpu.load_state_dict(cpu.state_dict())
    x, xyz, batch = scan_batch(cpu.cfg, scans=2)
    xg, xyzg, batchg = scan_batch(cpu.cfg, scans=2, device="cuda")
    with torch.no_grad():
        want, got = cpu(x, xyz, batch), gpu(xg, xyzg, batchg).cpu()
    # spconv's CUDA GEMMs may use TF32 and other sum orders; bf16 attention rounds q/k/v
    tol = 2e-2 if attention_dtype == "bfloat16" else 5e-3
    assert (got - want).abs().max().item() < tol * want.abs().max().item()


@requires_cuda
def test_cuda_training_step_under_fp16_autocast():
    torch.manual_seed(0)
    model = SphereFormerUNet(small_config(attention_dtype="bfloat16")).cuda()
    optimizer = torch.optim.AdamW(model.param_groups(0.006))
    scaler = torch.amp.GradScaler("cuda")
    points, labels = lidar_scan(4000, seed=1)
    scan = voxelize_scan(points.cuda(), model.cfg.voxel_size, model.cfg.pc_range, mode="random",
                         labels=labels.cuda(), generator=torch.Generator("cuda").manual_seed(0))
    feats, coords, xyz, batch, target = collate_scans([scan])
    losses = []
    for _ in range(4):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(sparse_input(feats, coords, batch), xyz, batch), target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_finetune_example_trains_saves_and_resumes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune", os.path.join(ROOT, "examples", "finetune_sphereformer.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run = tmp_path / "run"
    common = ["--points", "1200", "--batch-size", "1", "--experiment", str(run), "--device", "cpu", "--amp", "bf16"]
    losses = example.main(common + ["--steps", "4", "--val-every", "2"])
    assert losses[-1] < losses[0]
    last = torch.load(run / "last.pth", weights_only=True)
    assert last["step"] == 4 and "scheduler" in last and (run / "best.pth").exists()
    assert "val mIoU" in (run / "train.log").read_text()
    with pytest.raises(FileExistsError, match="previous run"):  # nothing saved is overwritten without asking
        example.main(common + ["--steps", "1"])
    example.main(common + ["--steps", "1", "--resume"])
    assert torch.load(run / "last.pth", weights_only=True)["step"] == 5
    assert torch.load(run / "last.pth", weights_only=True)["scheduler"]["last_epoch"] == 5


def test_finetune_example_on_semantickitti(tmp_path):
    """The fine-tune example on a tiny SemanticKITTI in the real layout: class weights, validation on sequence 08."""
    import importlib.util

    from tests.data.test_semantic_kitti import write_dataset

    write_dataset(tmp_path / "kitti", (("00", 2), ("08", 1)), points=900)
    spec = importlib.util.spec_from_file_location("finetune", os.path.join(ROOT, "examples", "finetune_sphereformer.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--data-root", str(tmp_path / "kitti"), "--experiment", str(tmp_path / "run"), "--steps",
                           "2", "--batch-size", "2", "--device", "cpu", "--amp", "none"])
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert "class weights on" in (tmp_path / "run" / "train.log").read_text()


def test_cpu_autocast_default_follows_native_bf16(monkeypatch):
    """bf16 autocast only where the CPU computes bf16 natively; emulated bf16 was 8x slower than fp32."""
    from sptr.models.sphereformer import training

    for avx512_bf16, amx, want in ((False, False, "none"), (True, False, "bf16"), (False, True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        amp, dtype, scaler = training.mixed_precision(None, "cpu")
        assert amp == want and dtype == training.AMP_DTYPES[want] and not scaler.is_enabled()
    assert training.mixed_precision("bf16", "cpu")[0] == "bf16"  # --amp overrides
    assert training.mixed_precision(None, "cuda")[0] == "fp16"


def published_yaml(cfg, **extra_train):
    """A config in SphereFormer's published layout (DATA / TRAIN / Distributed, its key names and training keys)."""
    data = {"data_name": "semantic_kitti", "data_root": "/data/SemanticKITTI/dataset",
            "label_mapping": "util/semantic-kitti.yaml", "classes": cfg.num_classes, "fea_dim": 6,
            "voxel_size": list(cfg.voxel_size), "voxel_max": 120000}
    train = {"arch": "unet_spherical_transformer", "input_c": cfg.in_channels, "m": cfg.channels[0],
             "block_reps": cfg.block_reps, "block_residual": cfg.block_residual, "layers": list(cfg.channels),
             "quant_size_scale": cfg.quant_size_scale, "patch_size": 1, "window_size": cfg.window_size,
             "use_xyz": True, "sync_bn": True, "rel_query": True, "rel_key": True, "rel_value": True,
             "drop_path_rate": cfg.drop_path_rate, "class_weight": [1.0] * cfg.num_classes, "xyz_norm": False,
             "pc_range": [list(r) for r in cfg.pc_range], "window_size_sphere": list(cfg.window_size_sphere),
             "window_size_scale": list(cfg.window_size_scale), "sphere_layers": list(cfg.sphere_layers),
             "grad_checkpoint_layers": [], "a": cfg.a, "loss_name": "ce_loss", "transformer_lr_scale": 0.1,
             "scheduler": "Poly", "power": 0.9, "base_lr": 0.006, "epochs": 50, "ignore_label": 255,
             **extra_train}
    return {"DATA": data, "TRAIN": train, "Distributed": {"dist_backend": "nccl", "world_size": 1, "rank": 0}}


def test_published_sphereformer_yaml_converts(tmp_path):
    import yaml

    from sptr.models.sphereformer.published_config import from_sphereformer_yaml, main

    ours = SphereFormerUNetConfig.from_yaml(CONFIGS["semantickitti"])
    path = tmp_path / "semantic_kitti_unet32_spherical_transformer.yaml"
    path.write_text(yaml.safe_dump(published_yaml(ours)))
    converted = from_sphereformer_yaml(str(path))
    assert converted.config == ours
    assert converted.training["base_lr"] == 0.006 and "class_weight" in converted.training
    assert "label_mapping" in converted.ignored and "dist_backend" in converted.ignored
    assert SphereFormerUNetConfig.from_yaml(str(path)) == ours  # the published file loads as it is
    main([str(path), "-o", str(tmp_path / "ours.yaml")])
    assert SphereFormerUNetConfig.from_yaml(str(tmp_path / "ours.yaml")) == ours
    doubled = published_yaml(ours, patch_size=2, window_size=3)  # train.py: window = voxel * patch_size * window
    path.write_text(yaml.safe_dump(doubled))
    assert from_sphereformer_yaml(str(path)).config.window_size == 6
    for bad, match in (({"mystery": 1}, "unknown keys"), ({"rel_value": False}, "rel_value"), ({"m": 64}, "m = 64")):
        path.write_text(yaml.safe_dump(published_yaml(ours, **bad)))
        with pytest.raises(ValueError, match=match):
            from_sphereformer_yaml(str(path))


def test_checkpoint_of_another_config_names_the_difference(tmp_path):
    weights, _ = save_pretrained(SphereFormerUNet(small_config(num_classes=20)), str(tmp_path / "c20"))
    with pytest.raises(ValueError, match=r"differs in num_classes = 20 \(model: 19\)"):
        load_pretrained(SphereFormerUNet(small_config()), weights)


def test_resume_from_weights_only_says_what_to_do(tmp_path):
    from sptr.models.sphereformer import resume_training_state

    model = SphereFormerUNet(small_config())
    weights, _ = save_pretrained(model, str(tmp_path / "w"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(ValueError, match="--checkpoint"):
        resume_training_state(weights, model, opt, scaler)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "plain.pth")
    with pytest.raises(ValueError, match="lacks"):
        resume_training_state(str(tmp_path / "plain.pth"), model, opt, scaler)


def test_ddp_example_reads_semantickitti_in_one_process(tmp_path):
    import importlib.util

    from tests.data.test_semantic_kitti import write_dataset

    write_dataset(tmp_path / "kitti", (("00", 3),), points=900)
    spec = importlib.util.spec_from_file_location("ddp", os.path.join(ROOT, "examples", "train_sphereformer_ddp.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--data-root", str(tmp_path / "kitti"), "--steps", "2", "--output",
                           str(tmp_path / "ddp.pth"), "--amp", "none", "--small"])  # on a GPU too
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert load_pretrained(SphereFormerUNet(small_config()), str(tmp_path / "ddp.pth")) is not None


def test_empty_scan_is_a_clear_error(tmp_path):
    model = SphereFormerUNet(small_config()).eval()
    with pytest.raises(ValueError, match=r"scans\[1\] holds no point"):
        predict_scans(model, [lidar_scan(300)[0], torch.zeros(0, 4)])
    (tmp_path / "empty.bin").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "sptr.models.sphereformer", "--config", CONFIGS["semantickitti"],
                          "--points", str(tmp_path / "empty.bin"), "--output-dir", str(tmp_path), "--device", "cpu"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "holds no point" in run.stderr and "Traceback" not in run.stderr
