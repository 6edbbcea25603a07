"""The YOLO recipe in torch: SGD param groups + a scheduler (twin of `recipe_jax`).

``yolo_optimizer(model, steps)`` builds Ultralytics' three param groups in
its order (biases without decay, weights with ``weight_decay``,
normalisation weights without) in one ``torch.optim.SGD(nesterov=True)``,
and `YoloScheduler`, which sets every group's LR and the momentum from
`examples.detection.recipe.Recipe.hyperparameters` at each step. The loop::

    optimizer, scheduler = yolo_optimizer(model, steps)
    guarded = torchref.transforms.stable_optimizer(optimizer, max_grad_norm=10.0)
    ...; loss.backward(); guarded.step()
    if guarded.skip_state.last_finite:
        scheduler.step()  # a skipped step does not advance the schedule

(``torchref.train.TrainStep(..., max_grad_norm=10.0)`` does the same guard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.detection.recipe import GROUPS, Recipe

# Ultralytics: `tuple(v for k, v in nn.__dict__.items() if "Norm" in k)`
_NORMS = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))


def param_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Ultralytics' groups: a parameter named ``bias`` -> "bias"; the weight
    of a normalisation module (any ``nn.*Norm*``) -> "no_decay"; the rest ->
    "decay" (the twin of ``recipe_jax.param_group``).

    Example:
      >>> m = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
      >>> {k: len(v) for k, v in param_groups(m).items()}
      {'bias': 1, 'decay': 1, 'no_decay': 1}
    """
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUPS}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "bias":
                groups["bias"].append(param)
            elif isinstance(module, _NORMS):
                groups["no_decay"].append(param)
            else:
                groups["decay"].append(param)
    return groups


class YoloScheduler(torch.optim.lr_scheduler.LRScheduler):
    """Sets each group's LR and the momentum of step ``last_epoch``.

    Group ``j`` of the optimizer is ``GROUPS[j]``, as `yolo_optimizer` builds
    it. Call ``step()`` after each applied optimizer step.

    Example:
      >>> w = nn.Parameter(torch.zeros(1))
      >>> opt = torch.optim.SGD([{"params": []}, {"params": [w]},
      ...                        {"params": []}], lr=0.01, momentum=0.9)
      >>> sched = YoloScheduler(opt, Recipe(steps=300, warmup_steps=100))
      >>> [round(g["lr"], 4) for g in opt.param_groups], opt.param_groups[0]["momentum"]
      ([0.1, 0.0, 0.0], 0.800000011920929)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, recipe: Recipe):
        if len(optimizer.param_groups) != len(GROUPS):
            raise ValueError(
                f"the optimizer needs {len(GROUPS)} param groups {GROUPS}, got "
                f"{len(optimizer.param_groups)}"
            )
        self.recipe = recipe
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return list(self.recipe.hyperparameters(self.last_epoch)[:3])

    def step(self, epoch: Any = None) -> None:
        super().step(epoch)
        momentum = self.recipe.hyperparameters(self.last_epoch)[3]
        for group in self.optimizer.param_groups:
            group["momentum"] = momentum


def yolo_optimizer(
    model: nn.Module, steps: int, **settings: Any
) -> tuple[torch.optim.SGD, YoloScheduler]:
    """SGD(nesterov=True) over Ultralytics' three groups and its scheduler.

    Args:
      model: the module whose parameters are trained.
      steps: optimizer steps of the run (`Recipe.steps`).
      **settings: the other `Recipe` fields (``warmup_steps``, ``lr``,
        ``final_lr_fraction``, ``momentum``, ``warmup_momentum``,
        ``warmup_bias_lr``, ``weight_decay``, ``decay``).

    Returns:
      ``(optimizer, scheduler)``; the scheduler has already set step 0's
      hyperparameters. Guard with ``torchref.transforms.stable_optimizer(
      optimizer, max_grad_norm=10.0)`` and call ``scheduler.step()`` after
      each applied step.

    Example:
      >>> m = nn.Linear(2, 1)
      >>> opt, sched = yolo_optimizer(m, 300, warmup_steps=100)
      >>> [round(g["lr"], 4) for g in opt.param_groups]
      [0.1, 0.0, 0.0]
    """
    recipe = Recipe(steps=steps, **settings)
    groups = param_groups(model)
    optimizer = torch.optim.SGD(
        [
            {
                "params": groups[name],
                "weight_decay": recipe.weight_decay * (name == "decay"),
            }
            for name in GROUPS
        ],
        lr=recipe.lr,
        momentum=recipe.momentum,
        nesterov=True,
    )
    return optimizer, YoloScheduler(optimizer, recipe)
