"""SphereFormer's published YAML (``DATA`` / ``TRAIN`` / ``Distributed`` sections) as a SphereFormerUNetConfig.

``python -m sptr.models.sphereformer.published_config semantic_kitti_unet32_spherical_transformer.yaml -o C.yaml``
writes our config and lists what it did not take: every network key is mapped (or checked where our network
has one fixed value), the training keys are returned for a training script, the rest is named as ignored.
"""
from __future__ import annotations

import argparse
import dataclasses

import yaml

from .config import SphereFormerUNetConfig

# published name -> our field
RENAMED = {"input_c": "in_channels", "classes": "num_classes", "layers": "channels"}
SAME = ("block_reps", "block_residual", "voxel_size", "window_size", "quant_size_scale", "window_size_sphere",
        "window_size_scale", "sphere_layers", "grad_checkpoint_layers", "drop_path_rate", "a", "pc_range",
        "transformer_lr_scale", "ignore_label")
# keys whose one value our network implements (anything else is an error naming the key)
FIXED = {"arch": "unet_spherical_transformer", "use_xyz": True, "rel_query": True, "rel_key": True, "rel_value": True,
         "xyz_norm": False}
# what a training or evaluation script reads (returned to the caller)
TRAINING = ("data_root", "voxel_max", "class_weight", "loss_name", "aug", "scheduler_update", "scheduler", "power",
            "use_amp", "batch_size", "batch_size_val", "base_lr", "epochs", "start_epoch", "momentum",
            "weight_decay", "manual_seed", "max_batch_points", "use_tta", "vote_num", "sync_bn", "eval_freq",
            "save_freq", "print_freq", "save_path", "weight", "resume", "evaluate", "val", "loss_gamma", "step_epoch",
            "multiplier", "split", "max_grad_norm")
# read by nothing here: the data and label files, the process layout, and keys SphereFormer's segmentation code
# does not read either (drop_rate, fea_dim, mix_transformer, meanvoxel, val_meanvoxel)
IGNORED = ("data_name", "label_mapping", "fea_dim", "drop_rate", "train_gpu", "workers", "dist_url",
           "dist_backend", "multiprocessing_distributed", "world_size", "rank", "mix_transformer", "meanvoxel",
           "val_meanvoxel")


@dataclasses.dataclass
class PublishedConfig:
    config: SphereFormerUNetConfig
    training: dict   # the training keys present, by their published names
    ignored: list    # present keys that nothing here reads


def from_sphereformer_yaml(path: str) -> PublishedConfig:
    """Convert a SphereFormer YAML; a key of no known kind, or a fixed key with another value, raises."""
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or "TRAIN" not in data:
        raise ValueError(f"{path!r} is not a SphereFormer YAML (no TRAIN section)")
    flat = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path!r}: section {section!r} is not a mapping")
        for key, value in values.items():
            if key in flat and flat[key] != value:
                raise ValueError(f"{path!r}: {key!r} appears twice with different values")
            flat[key] = value
    fields, training, ignored, unknown = {}, {}, [], []
    for key, value in flat.items():
        if key in RENAMED:
            fields[RENAMED[key]] = tuple(value) if isinstance(value, list) else value
        elif key in SAME:
            fields[key] = value
        elif key in FIXED:
            if value != FIXED[key]:
                raise ValueError(f"{path!r}: {key} = {value!r}, but this network implements {key} = {FIXED[key]!r}")
        elif key in ("m", "patch_size"):
            pass  # the first level's width (checked against layers below); the window's unit (folded in below)
        elif key in TRAINING:
            training[key] = value
        elif key in IGNORED:
            ignored.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{path!r}: unknown keys {sorted(unknown)}")
    if "m" in flat and "channels" in fields and fields["channels"][0] != flat["m"]:
        raise ValueError(f"{path!r}: m = {flat['m']} must equal layers[0] = {fields['channels'][0]}")
    if "window_size" in fields:  # train.py: cubic window = voxel_size * patch_size * window_size
        fields["window_size"] = fields["window_size"] * flat.get("patch_size", 1)
    fields.setdefault("pc_range", None)  # train.py: args.get("pc_range", None)
    for key in ("voxel_size", "window_size_sphere", "window_size_scale", "sphere_layers", "grad_checkpoint_layers"):
        if isinstance(fields.get(key), list):
            fields[key] = tuple(fields[key])
    return PublishedConfig(SphereFormerUNetConfig.from_dict(fields), training, sorted(ignored))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sptr.models.sphereformer.published_config",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("published", help="SphereFormer's YAML (config/<dataset>/*.yaml)")
    parser.add_argument("-o", "--output", required=True, help="where to write the SphereFormerUNetConfig YAML")
    args = parser.parse_args(argv)
    try:
        converted = from_sphereformer_yaml(args.published)
    except (ValueError, TypeError, OSError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    values = {k: list(map(list, v)) if k == "pc_range" and v is not None else list(v) if isinstance(v, tuple) else v
              for k, v in converted.config.to_dict().items()}
    with open(args.output, "w") as f:
        f.write(f"# SphereFormerUNetConfig converted from {args.published}\n")
        yaml.safe_dump(values, f, sort_keys=False)
    print(f"wrote {args.output}")
    print("training keys (for a training script):", ", ".join(f"{k}={v!r}" for k, v in converted.training.items()))
    print("ignored:", ", ".join(converted.ignored) or "nothing")


if __name__ == "__main__":
    main()
