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

import copy
from typing import Any

import torch
from torch import nn

from examples.detection.recipe import GROUPS, Recipe, ema_decays

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
    seen: set[int] = set()  # a shared parameter goes in once (SGD refuses twice)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
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


class WeightEma:
    """Ultralytics' ``ModelEMA`` of a model's parameters (twin of
    `recipe_jax.with_ema`): call `update` after each applied optimizer step.

    ``ema = d * ema + (1 - d) * param`` with ``d`` from
    `examples.detection.recipe.ema_decays` (float32, the numbers the JAX
    side uses); `averaged` gives a copy of the model holding the EMA.

    Example:
      >>> m = nn.Linear(1, 1, bias=False)
      >>> _ = nn.init.zeros_(m.weight)
      >>> ema = WeightEma(m, 10, decay=0.5, tau=1e-9)
      >>> _ = nn.init.ones_(m.weight)  # the optimizer's step, say
      >>> ema.update(m); ema.averaged(m).weight.item()  # from 0 halfway to 1
      0.5
    """

    def __init__(self, model: nn.Module, steps: int, *, decay: float, tau: float):
        self.decays = ema_decays(steps, decay, tau).tolist()
        self.updates = 0
        self.ema = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decays[min(self.updates, len(self.decays) - 1)]
        for name, p in model.named_parameters():
            self.ema[name].mul_(d).add_(p.detach(), alpha=1.0 - d)

    def averaged(self, model: nn.Module) -> nn.Module:
        """A deep copy of `model` (its buffers, its mode) with the EMA weights."""
        out = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in out.named_parameters():
                p.copy_(self.ema[name])
        return out


class StepHooks:
    """What to run after each applied step, as one ``step()`` (the harness's
    scheduler slot): the recipe's scheduler, then the weight EMA.

    Example:
      >>> m = nn.Linear(1, 1)
      >>> opt, sched = yolo_optimizer(m, 10, warmup_steps=2)
      >>> hooks = StepHooks(sched, WeightEma(m, 10, decay=0.9, tau=1.0), m)
      >>> opt.step(); hooks.step(); hooks.ema.updates, sched.last_epoch
      (1, 1)
    """

    def __init__(self, scheduler: Any, ema: WeightEma, model: nn.Module):
        self.scheduler, self.ema, self.model = scheduler, ema, model

    def step(self) -> None:
        self.scheduler.step()
        self.ema.update(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state and the EMA (fit checkpoints it)."""
        ema = {n: t.clone() for n, t in self.ema.ema.items()}
        return {"scheduler": self.scheduler.state_dict(), "ema": ema,
                "updates": self.ema.updates}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.ema.updates = state["updates"]
        for name, t in state["ema"].items():
            self.ema.ema[name].copy_(t)
