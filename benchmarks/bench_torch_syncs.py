"""Host syncs and op counts of one torch train step, from `torch.profiler`.

The CPU proxy of issue 24's GPU goal (torchref's guarded step within 5% of
the torch.amp recipe): on a GPU every ``.item()`` / ``bool(tensor)`` in the
step is a device->host copy that stalls the launch queue, and every aten op
is at least one kernel launch. On a CPU both can be counted exactly:

  syncs   events named ``aten::_local_scalar_dense`` (what ``.item()``,
          ``bool(t)``, ``float(t)`` and ``int(t)`` call; ``aten::item``
          wraps it and is not counted twice); ``outside optimizer``: those
          not inside ``Optimizer.step`` (Adam's own reads of its ``step``
          counter, CPU tensors even on a GPU with ``capturable=False``, and
          the fused CPU kernel's scalar reads are no device->host syncs on a
          GPU; every other one is).
  ops     top-level ``aten::`` ops (not called by another aten op) minus
          pure metadata/view ops (view, reshape, detach, split, empty, ...):
          the kernel-launch proxy (a composite op launches its inner ops,
          counted once here); and every ``aten::`` event, nested included.

Model: an MLP of 8 Linear(64, 64) layers (16 parameter leaves), batch 32,
MSE loss, Adam(1e-3); scaler = GradScaler (torchref's `DynamicLossScale`,
enabled on the CPU), clip at 1.0. Counted on the 3rd step (state exists).

Variants:
  amp_recipe            the torch.amp docs' recipe by hand: scale, backward,
                        unscale_, clip_grad_norm_, scaler.step, update.
  amp_recipe_fused      the same with Adam(fused=True) (GradScaler passes
                        found_inf to the optimizer: no sync in scaler.step).
  trainstep             torchref TrainStep (check_update=True), metrics
                        returned as python numbers (one batched transfer).
  trainstep_grads_only  the same with check_update=False.
  *_tensors             TrainStep.step(batch, sync=False): metrics as 0-d
                        tensors, nothing read back (what a loop that logs
                        every N steps does).
  *_fused               with Adam(fused=True) (found_inf handed to Adam).
  trainstep_spikes      TrainStep with skip_spikes(Adam) (its window of
                        applied steps is read on the host: not sync-free).
  stable_optimizer      a plain loop (zero_grad, backward, step) with
                        transforms.stable_optimizer(Adam, max_grad_norm=1.0)
                        (no scaler), the skip counters read every step
                        (``skip_state``: one transfer), and ``*_lazy``
                        without reading them.
  skip_non_finite       the same with transforms.skip_non_finite(Adam).

Run: ``PYTHONPATH=. python benchmarks/bench_torch_syncs.py`` (writes
results/bench_torch_syncs_cpu.md and .json). Deterministic counts; no timing.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from torchref import transforms
from torchref.loss_scale import DynamicLossScale
from torchref.train import TrainStep

_VIEW_OPS = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::as_strided",
    "aten::select",
    "aten::slice",
    "aten::split",
    "aten::split_with_sizes",
    "aten::expand",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::unbind",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::lift_fresh",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::result_type",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::to",
    "aten::_has_compatible_shallow_copy_type",
    "aten::is_nonzero",
    "aten::flatten",
    "aten::view_as",
    "aten::contiguous",
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def _recipe(fused: bool):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    scaler = DynamicLossScale().make_scaler("cpu")

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = _mse(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return step


def _trainstep(check_update: bool, fused: bool, sync: bool):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    ts = TrainStep(
        model,
        opt,
        _mse,
        max_grad_norm=1.0,
        scaler=DynamicLossScale(),
        check_update=check_update,
    )
    if sync:
        return ts
    return lambda batch: ts.step(batch, sync=False)


def _spikes():
    model = _model()
    opt = transforms.skip_spikes(torch.optim.Adam(model.parameters(), lr=1e-3))
    return TrainStep(model, opt, _mse, max_grad_norm=1.0, scaler=DynamicLossScale())


def _wrapper(kind: str, read: bool):
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    if kind == "stable_optimizer":
        opt = transforms.stable_optimizer(adam, max_grad_norm=1.0)
    else:
        opt = transforms.skip_non_finite(adam)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        _mse(model, batch).backward()
        opt.step()
        if read:
            opt.skip_state  # noqa: B018 (brings the counters up to date)

    return step


def _variants():
    out = {
        "amp_recipe": _recipe(False),
        "amp_recipe_fused": _recipe(True),
    }
    for fused in (False, True):
        for check in (True, False):
            for sync in (True, False):
                name = "trainstep" + ("" if check else "_grads_only")
                name += "" if sync else "_tensors"
                name += "_fused" if fused else ""
                out[name] = _trainstep(check, fused, sync)
    out["trainstep_spikes"] = _spikes()
    for kind in ("stable_optimizer", "skip_non_finite"):
        out[kind] = _wrapper(kind, True)
        out[kind + "_lazy"] = _wrapper(kind, False)
    return out


def _inside(event, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def count(step, batch) -> dict[str, int]:
    """Syncs and ops of the 3rd call of ``step(batch)``."""
    for _ in range(2):
        step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch)
    events = list(prof.events())
    syncs = [e for e in events if e.name == "aten::_local_scalar_dense"]
    top = [
        e.name
        for e in events
        if e.name.startswith("aten::")
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
    ]
    return {
        "syncs": len(syncs),
        "syncs_outside_optimizer": sum(not _inside(e, "Optimizer.step") for e in syncs),
        "top_level_ops": sum(n not in _VIEW_OPS for n in top),
        "all_aten_ops": sum(e.name.startswith("aten::") for e in events),
    }


_NOTES = [
    "Syncs outside the optimizer per guarded step: 0 in every torchref row",
    "(the recipe itself has 1: GradScaler.step reads found_inf before a",
    "non-fused step). The `_local_scalar_dense` left are inside",
    "`Optimizer.step` (Adam reads its CPU `step` counter: no device sync on a",
    "GPU). Launch proxy: +25 top-level ops over the old TrainStep (0-d ops:",
    "loss check, flag combine, the float64 finiteness/rescue norm, counters);",
    "`grads_only` with a non-fused optimizer now copies and selects back (one",
    "cat + where + foreach_copy per dtype), as it cannot skip on the device by",
    "itself; the spike guard's window (sort, median, select) adds ~100 small",
    "ops in place of its host reads. GPU time not measured (no GPU lent).",
]


def _table(rows: dict[str, dict[str, int]]) -> list[str]:
    lines = [
        "| variant | host syncs outside the optimizer | all `_local_scalar_dense` "
        "| top-level ops (launch proxy) | all aten events |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['syncs_outside_optimizer']} | {r['syncs']} "
            f"| {r['top_level_ops']} | {r['all_aten_ops']} |"
        )
    return lines


def main() -> None:
    """Counts every variant; ``--before`` writes the rows of the code on the
    path (an older checkout) to ``*_before.json``, shown under the table."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g))
    rows = {}
    for name, step in _variants().items():
        try:
            rows[name] = count(step, batch)
        except TypeError:  # an older TrainStep without step(sync=False)
            continue
    out = pathlib.Path(__file__).parent / "results"
    if "--before" in sys.argv:
        (out / "bench_torch_syncs_cpu_before.json").write_text(
            json.dumps(rows, indent=1)
        )
        print("\n".join(_table(rows)))
        return
    lines = [
        "# torch step: host syncs and ops per step (CPU, torch.profiler)",
        "",
        f"torch {torch.__version__} on the CPU ({os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}: counts, not times, so the load does not",
        "change them); MLP 8 x Linear(64, 64) (16 leaves), Adam, GradScaler",
        "(DynamicLossScale), clip 1.0; 3rd step. Command:",
        "`PYTHONPATH=. python benchmarks/bench_torch_syncs.py`",
        "",
        *_table(rows),
    ]
    before = out / "bench_torch_syncs_cpu_before.json"
    if before.exists():
        lines += [
            "",
            "Before issue 24's change (the same script on the code before it,",
            "`PYTHONPATH=OLD python benchmarks/bench_torch_syncs.py --before`;",
            "no `sync=False` rows there):",
            "",
            *_table(json.loads(before.read_text())),
        ]
    lines += ["", *_NOTES]
    text = "\n".join(lines) + "\n"
    print(text)
    if "--no-write" not in sys.argv:
        (out / "bench_torch_syncs_cpu.md").write_text(text)
        (out / "bench_torch_syncs_cpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
