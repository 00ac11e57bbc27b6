"""Process bodies of the multi-process tests (run by torch.multiprocessing.spawn from tests/distributed): each
rank trains on its share of a global batch and rank 0 writes what the test compares to a single process."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from sptr.data import collate_scans, lidar_scan, voxelize_scan
from sptr.integrations.distributed import convert_sync_batchnorm, end_process_group, global_mean

POINTS = (1300, 2100)  # rank r's scan: different amounts of work per rank


def run(rank: int, step, world: int, port: int, out: str) -> None:
    """The body of every spawned rank: join the gloo group, run `step(rank)` (rank 0 saves what it returns to
    `out`), then end the group on all ranks together once the step's modules are gone (end_process_group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = step(rank)
    if rank == 0:
        torch.save(result, out)
    del result
    end_process_group()


# As published, a scan's result depends on the other scans of its batch: SphereFormer's windows (torch_cluster's
# grid) start at the batch's minimum coordinates, cubic and spherical, and the sparse tensor's spatial shape is
# the batch's maximum voxel + 1 (a stride-2 conv drops the last voxel of an odd-sized axis). Four points give
# every scan the same extremes: corners outside pc_range (clipped to its minimum and maximum), the sensor
# origin (r = 0, beta = 0) and a point at azimuth theta ~ 0; then per-rank batches equal the global batch.
ANCHORS = torch.tensor([[-60.0, -60.0, -5.0, 0.0], [60.0, 60.0, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                        [-1.0, -1e-6, 0.0, 0.0]])


def scan_inputs(cfg, scan_ids, dtype=torch.float32):
    """Deterministic training inputs of the given scans: one random point per voxel, seeded per scan."""
    from sptr.models.sphereformer import sparse_input

    voxels = []
    for i in scan_ids:
        points, labels = lidar_scan(POINTS[i], seed=i)
        points = torch.cat([points, ANCHORS])
        labels = torch.cat([labels, torch.full((len(ANCHORS),), cfg.ignore_label, dtype=labels.dtype)])
        voxels.append(voxelize_scan(points, cfg.voxel_size, cfg.pc_range, mode="random", labels=labels,
                                    generator=torch.Generator().manual_seed(i)))
    feats, coords, xyz, batch, labels = collate_scans(voxels)
    return sparse_input(feats.to(dtype), coords, batch, len(scan_ids)), xyz, batch, labels


def small_unet(dtype=torch.float32):
    """The test U-Net; in float64 (attention too) reduction-order differences are ~1e-13 relative, so DDP and
    one process can be compared with a bound that holds on any CPU."""
    from sptr.models.sphereformer import SphereFormerUNet, SphereFormerUNetConfig

    torch.manual_seed(0)
    # no drop path: its random masks would differ between the ranks and the single process
    cfg = SphereFormerUNetConfig(channels=(32, 64), sphere_layers=(1, 2), drop_path_rate=0.0,
                                 attention_dtype="float64" if dtype == torch.float64 else "float32")
    return SphereFormerUNet(cfg).to(dtype).train()


def unet_loss(model, cfg, scan_ids):
    x, xyz, batch, labels = scan_inputs(cfg, scan_ids, next(model.parameters()).dtype)
    total = F.cross_entropy(model(x, xyz, batch), labels, ignore_index=cfg.ignore_label, reduction="sum")
    return global_mean(total, (labels != cfg.ignore_label).sum())


def ddp_unet_step(rank: int) -> dict | None:
    """One DDP step with SyncBatchNorm (rank r holds scan r); rank 0 returns the gradients, the BN running
    statistics, the checkpoint (module. keys) and its eval logits on scan 0."""
    model = small_unet(torch.float64)
    cfg = model.cfg
    model = DistributedDataParallel(convert_sync_batchnorm(model), static_graph=True)
    unet_loss(model, cfg, [rank]).backward()
    if rank == 0:
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        buffers = {n: b.clone() for n, b in model.module.named_buffers()}
        net = model.module.eval()  # not through DDP: its forward would broadcast buffers to the other rank
        with torch.no_grad():
            x, xyz, batch, _ = scan_inputs(cfg, [0], torch.float64)
            logits = net(x, xyz, batch)
        return {"grads": grads, "buffers": buffers, "state_dict": model.state_dict(), "logits": logits}
    return None


def compiled_ddp_block_step(rank: int) -> dict:
    """A SphereFormer block under DDP and torch.compile (aot_eager: DDP's graph splitting, our fake kernels and
    autograd), against the same block under DDP in eager mode."""
    from sptr.layers import SphereFormer, SphereFormerConfig

    results = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        block = DistributedDataParallel(SphereFormer(SphereFormerConfig(window_size=(0.6, 0.6, 0.6),
                                                                        quant_size=(0.05, 0.05, 0.05))))
        run = torch.compile(block, backend="aot_eager") if mode == "compiled" else block
        gen = torch.Generator().manual_seed(rank)
        n = 90 + 40 * rank
        xyz = torch.rand(n, 3, generator=gen) * 2
        feats = torch.randn(n, 32, generator=gen)
        run(feats, xyz, torch.zeros(n, dtype=torch.long)).square().mean().backward()
        results[mode] = {n: p.grad.clone() for n, p in block.module.named_parameters()}
    return results


def fsdp2_moe_step(rank: int) -> dict:
    """DualExpertFFN and RoutedExpertFFN sharded with FSDP2 (fully_shard); each rank holds half the tokens.
    Returns the unsharded gradients and the rank's outputs."""
    from sptr.layers import DualExpertFFN, DualExpertFFNConfig, RoutedExpertFFN, RoutedExpertFFNConfig

    results = {}
    for name, make in (("dual", lambda: DualExpertFFN(DualExpertFFNConfig(hidden=16, intermediate=(24, 8)))),
                       ("routed", lambda: RoutedExpertFFN(RoutedExpertFFNConfig(hidden=16, intermediate=12,
                                                                                num_experts=4, top_k=2)))):
        torch.manual_seed(0)
        layer = shard(make())
        x, index = moe_tokens(rank)
        y = layer(x, index) if name == "dual" else layer(x).hidden_states
        (y.square().sum() / (2 * x.shape[0])).backward()
        grads = {n: p.grad.full_tensor() for n, p in layer.named_parameters()}
        results[name] = {"grads": grads, "out": y.detach()}
    return results


def shard(module):
    """FSDP2 on a CPU mesh (the default mesh takes the GPU when one is present, whatever the module's device)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def moe_tokens(part: int):
    """Tokens of rank `part` (0, 1) of a 2-rank batch, with their expert index for the dual FFN."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 20, 16, generator=gen)
    index = torch.randint(0, 2, (2, 20), generator=gen)
    return x[part], index[part]


def fsdp2_qwen_step(rank: int) -> dict:
    """A tiny Qwen2.5-VL sharded with FSDP2 (each decoder layer and the root), with and without apply_to: rank
    0 returns both losses and unsharded gradients (each rank holds the same batch)."""
    from sptr.integrations import qwen2_5_vl
    from tests.integrations.test_qwen2_5_vl import inputs, tiny_model

    results = {}
    for name in ("transformers", "sptr"):
        model = tiny_model().train()
        if name == "sptr":
            qwen2_5_vl.apply_to(model)
        for layer in model.model.layers:
            shard(layer)
        shard(model)
        batch = inputs()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        results[name] = {"loss": loss.detach(), "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()
                                                         if p.grad is not None}}
    return results


def fsdp2_dual_expert_qwen_step(rank: int) -> dict:
    """The dual-expert Qwen2.5-VL sharded with FSDP2 as Wall-X shards it (each decoder layer, then the root), every
    rank on the same batch with action tokens: rank 0 returns the loss and the unsharded gradients."""
    model = dual_expert_model()  # seeded: the same weights on every rank and in the test's single process
    for layer in model.model.layers:
        shard(layer)
    shard(model)
    loss = dual_expert_loss(model)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()
                                             if p.grad is not None}}


def dual_expert_model():
    from sptr.models import qwen2_5_vl_moe as wx
    from tests.integrations.test_qwen2_5_vl import tiny_model

    return wx.from_qwen2_5_vl(tiny_model(), wx.DualExpertQwenConfig(action_intermediate=24)).train()


def dual_expert_loss(model):
    from tests.integrations.test_qwen2_5_vl import inputs

    batch = inputs()
    types = torch.zeros_like(batch["input_ids"])
    types[0, -3:] = 1
    return model(**batch, labels=batch["input_ids"], moe_token_types=types).loss
