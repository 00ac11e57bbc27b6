"""Semantic segmentation scores from a confusion matrix: per-class IoU, mIoU and accuracy."""
from __future__ import annotations

import csv
import json

import torch


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_label: int = 255):
    """int64 ``[C, C]`` counts, rows the target class, columns the predicted one; targets equal to
    ``ignore_label`` are left out. Predictions must lie in [0, C)."""
    pred, target = pred.reshape(-1).long(), target.reshape(-1).long()
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must hold the same number of labels, got {pred.numel()} and "
                         f"{target.numel()}")
    keep = target != ignore_label
    pred, target = pred[keep], target[keep]
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_classes):
        raise ValueError(f"target holds classes outside [0, {num_classes}) besides ignore_label {ignore_label}")
    if pred.numel() and (int(pred.min()) < 0 or int(pred.max()) >= num_classes):
        raise ValueError(f"pred holds classes outside [0, {num_classes})")
    return torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes).cpu()


class SegmentationMetrics:
    """Accumulates a confusion matrix over scans. ``iou()``: TP / (TP + FP + FN) per class, NaN for a class
    neither present nor predicted; ``miou()`` the mean over the other classes (as Pointcept and mmseg report
    it); ``accuracy()``: correct / labelled points."""

    def __init__(self, num_classes: int, ignore_label: int = 255, names=None):
        self.num_classes, self.ignore_label = num_classes, ignore_label
        self.names = tuple(names) if names is not None else tuple(str(c) for c in range(num_classes))
        if len(self.names) != num_classes:
            raise ValueError(f"names must hold {num_classes} entries, got {len(self.names)}")
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        self.confusion += confusion_matrix(pred, target, self.num_classes, self.ignore_label)

    def iou(self) -> torch.Tensor:
        c = self.confusion.double()
        tp = c.diag()
        union = c.sum(0) + c.sum(1) - tp
        return torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))

    def miou(self) -> float:
        return float(self.iou().nanmean())

    def accuracy(self) -> float:
        total = int(self.confusion.sum())
        return float(self.confusion.diag().sum()) / total if total else float("nan")

    def table(self) -> str:
        rows = [f"{name:>16s}  {100 * v:6.2f}" for name, v in zip(self.names, self.iou().tolist())]
        rows += [f"{'mIoU':>16s}  {100 * self.miou():6.2f}", f"{'accuracy':>16s}  {100 * self.accuracy():6.2f}"]
        return "\n".join([f"{'class':>16s}  {'IoU %':>6s}"] + rows)

    def as_dict(self) -> dict:
        return {"iou": dict(zip(self.names, self.iou().tolist())), "miou": self.miou(), "accuracy": self.accuracy(),
                "confusion": self.confusion.tolist()}

    def write(self, path: str) -> None:
        """The scores as JSON (``.json``) or a per-class CSV (anything else)."""
        if path.endswith(".json"):
            with open(path, "w") as f:
                json.dump(self.as_dict(), f, indent=1)
            return
        with open(path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["class", "iou"])
            out.writerows(zip(self.names, self.iou().tolist()))
            out.writerows([["mIoU", self.miou()], ["accuracy", self.accuracy()]])
