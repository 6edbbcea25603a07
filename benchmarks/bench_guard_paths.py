"""TrainStep's two guard paths against the torch.amp recipe (issue 33).

Times one training step of `torchref.train.TrainStep` (default settings:
clip 1.0, a GradScaler, the update check on) on each `decide_on` path
against the recipe it replaces (GradScaler + `clip_grad_norm_` + the same
AdamW), bf16 autocast on the CPU, interleaved in one process, medians and
their ratio. Two models: a ResNet-18-shaped conv net (11.0M parameters)
and a small MLP whose optimizer also holds an unused Linear(2048, 2048)
(4.2M parameters without a gradient). Usage::

    python benchmarks/bench_guard_paths.py [reps]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from torchref.train import TrainStep


def _block(cin: int, cout: int, stride: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


def resnet18_shaped() -> tuple[nn.Module, torch.Tensor]:
    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)], 64
    widths = [64, 64, 128, 128, 256, 256, 512, 512]
    for i, cout in enumerate(widths):
        stride = 2 if i and cout != widths[i - 1] else 1
        layers.append(_block(cin, cout, stride))
        cin = cout
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers, *head), torch.randn(8, 3, 32, 32)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.unused = nn.Linear(2048, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def _runner(build, kind: str):
    torch.manual_seed(0)
    model, x = build()
    batch = (x, torch.randint(0, 10, (x.shape[0],)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    if kind != "recipe":
        step = TrainStep(
            model,
            opt,
            _loss,
            max_grad_norm=1.0,
            scaler=scaler,
            autocast_dtype=torch.bfloat16,
            decide_on=kind,
        )
        return lambda: step(batch)

    def recipe() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return recipe


def main(reps: int) -> None:
    torch.set_num_threads(1)
    models = {
        "resnet18-shaped": resnet18_shaped,
        "mlp+unused": lambda: (_WithUnused(), torch.randn(16, 32)),
    }
    print("| model | recipe ms | device / recipe | host / recipe |")
    print("|---|---:|---:|---:|")
    for name, build in models.items():
        runs = {k: _runner(build, k) for k in ("recipe", "device", "host")}
        for run in runs.values():
            for _ in range(3):
                run()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(reps):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = {k: med[k] / med["recipe"] for k in ("device", "host")}
        print(
            f"| {name} | {med['recipe'] * 1e3:.2f} | "
            f"{ratio['device']:.2f} | {ratio['host']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
