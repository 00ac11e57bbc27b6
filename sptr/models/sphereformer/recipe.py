"""SphereFormer's training recipe around the network: the poly learning-rate schedule, the class-weighted
cross-entropy, and an experiment directory (log file, last and best checkpoints)."""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ...data.labels import label_map_data
from .training import save_training_state


def poly_schedule(optimizer: torch.optim.Optimizer, total_steps: int, power: float = 0.9):
    """SphereFormer's "Poly" schedule, stepped every iteration: lr · (1 − step / (total_steps + 1))^power."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (1 - step / (total_steps + 1)) ** power)


def class_weights(dataset: str = "semantickitti") -> torch.Tensor:
    """SphereFormer's per-class cross-entropy weights of a dataset (configs/labels/<dataset>.yaml)."""
    weights = label_map_data(dataset).get("class_weight")
    if weights is None:
        raise ValueError(f"configs/labels/{dataset}.yaml has no class_weight")
    return torch.tensor(weights, dtype=torch.float32)


def segmentation_loss(num_classes: int, ignore_label: int = 255, weight: torch.Tensor | None = None) -> nn.Module:
    """Cross-entropy with SphereFormer's ignore index and optional class weights."""
    if weight is not None and weight.shape != (num_classes,):
        raise ValueError(f"weight must hold one value per class ({num_classes}), got {tuple(weight.shape)}")
    return nn.CrossEntropyLoss(weight=weight, ignore_index=ignore_label)


class Experiment:
    """An experiment directory: ``train.log`` (appended), ``last.pth`` at every save, ``best.pth`` when a
    validation score improves (the best score is kept in the checkpoints, so a resumed run keeps it). A directory
    that holds a previous run's files is refused unless ``resume`` or ``overwrite``: nothing saved is lost."""

    def __init__(self, path: str, resume: bool = False, overwrite: bool = False):
        self.path = path
        self.last, self.best = os.path.join(path, "last.pth"), os.path.join(path, "best.pth")
        previous = [p for p in (self.last, self.best) if os.path.exists(p)]
        if previous and not (resume or overwrite):
            raise FileExistsError(f"{path!r} holds a previous run ({os.path.basename(previous[0])}); resume it or "
                                  "choose another experiment directory (or overwrite)")
        os.makedirs(path, exist_ok=True)
        self.best_score = float("-inf")
        if resume and os.path.exists(self.last):
            state = torch.load(self.last, map_location="cpu", weights_only=True)
            self.best_score = float(state.get("best_score", float("-inf")))
        self.logger = logging.getLogger(f"sptr.experiment.{os.path.abspath(path)}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        if not self.logger.handlers:
            handler = logging.FileHandler(os.path.join(path, "train.log"))
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            self.logger.addHandler(handler)

    def log(self, message: str) -> None:
        self.logger.info(message)

    def save(self, model, optimizer, scaler, step: int, scheduler=None, score: float | None = None) -> bool:
        """Write ``last.pth`` (and ``best.pth`` if ``score`` beats the best so far); True when it was the best."""
        is_best = score is not None and score > self.best_score
        if is_best:
            self.best_score = score
        extra = {"best_score": self.best_score}
        if scheduler is not None:
            extra["scheduler"] = scheduler.state_dict()
        save_training_state(self.last, model, optimizer, scaler, step, extra)
        if is_best:
            save_training_state(self.best, model, optimizer, scaler, step, extra)
        self.log(f"step {step}: saved {self.last}" + (f" and {self.best} (score {score:.4f})" if is_best else ""))
        return is_best

    def close(self) -> None:
        for handler in list(self.logger.handlers):
            handler.close()
            self.logger.removeHandler(handler)
