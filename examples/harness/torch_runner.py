"""The torch runs: the naive and the stable step, and one run on `torchref.train.fit`.

:func:`run_torch` trains one run of a task in this process and returns a
`RunResult`; the naive step is a plain zero_grad / backward / step with no
guard (:func:`naive_step`), the stable one `torchref.train.TrainStep` with
autocast, the real ``GradScaler`` for float16, ``clip_grad_norm_`` and the
skip of non-finite steps (:func:`stable_step`). Several DDP processes
(``--devices N``) are `examples.harness.ddp`'s, which calls this per rank.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from examples.harness.config import BaseConfig, torch_dtype
from examples.harness.results import (
    RunResult,
    Watch,
    adam_underflow_note,
    make_result,
    report_text,
)


def torch_optimizer(config: BaseConfig, params: Any):
    """The plain torch optimizer of the config (twin of `jax_optimizer`).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 1)
        >>> opt = torch_optimizer(BaseConfig(optimizer="sgd"), m.parameters())
        >>> type(opt).__name__, opt.defaults["momentum"]
        ('SGD', 0.9)
    """
    import torch

    c = config
    betas = (c.b1, c.b2)
    if c.optimizer == "adam":
        return torch.optim.Adam(params, lr=c.learning_rate, betas=betas, eps=c.eps)
    if c.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=c.learning_rate,
            betas=betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
        )
    return torch.optim.SGD(params, lr=c.learning_rate, momentum=0.9)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """`tree` (tensors in dicts, lists, tuples) with its floating tensors cast.

    Example:
        >>> import torch
        >>> out = cast_floats((torch.ones(2), torch.arange(2)), torch.float16)
        >>> out[0].dtype, out[1].dtype
        (torch.float16, torch.int64)
    """
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: cast_floats(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(cast_floats(v, dtype) for v in tree)
    return tree


def _report(tree) -> str:
    from torchref import diagnostics

    return report_text(
        tree,
        diagnostics,
        lambda sub: sum(t.numel() for t in sub.values()),
    )


def _optimizer(config, parts, model) -> tuple[Any, Any]:
    """(optimizer, scheduler or None): the task's own, else the config's."""
    if parts.optimizer is not None:
        return parts.optimizer(model)
    return torch_optimizer(config, model.parameters()), None


def naive_step(config, parts):
    """The naive step ``step(batch) -> metrics``: zero_grad, backward, step.

    Returns ``(step, report, locate)``: ``report()`` is the diagnostics text
    of the last step, ``locate()`` `torchref.diagnostics.locate` of it
    re-run from the model and optimizer state before it. For those, each
    step keeps a copy of that state (parameters, buffers, Adam's moments:
    3-4x the parameters' memory, a copy per step next to a whole forward
    and backward).
    """
    import torch

    from torchref.loss_scale import all_finite
    from torchref.transforms import global_norm

    dtype = torch_dtype(config.precision)
    model = parts.model
    optimizer, scheduler = _optimizer(config, parts, model)
    named = dict(model.named_parameters())
    last: dict[str, Any] = {}

    def step(batch):
        batch = cast_floats(parts.to_torch(batch), dtype)
        last["batch"] = batch
        last["model_before"] = {
            k: v.detach().clone() for k, v in model.state_dict().items()
        }
        last["opt_before"] = copy.deepcopy(optimizer.state_dict())
        old = {n: last["model_before"][n] for n in named}
        optimizer.zero_grad(set_to_none=True)
        out = parts.loss_fn(model, batch)
        loss, aux = out if isinstance(out, tuple) else (out, None)
        loss.backward()
        grads = {
            n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in named.items()
        }
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        new = {n: p.detach() for n, p in named.items()}
        last.update(grads=grads, old=old, new=new)
        loss_value = float(loss.detach().float())
        finite = all_finite(list(grads.values()) + list(new.values()))
        metrics = {
            "loss": loss_value,
            "grad_norm": float(global_norm(list(grads.values()))),
            "loss_scale": 1.0,
            "finite": bool(finite) and math.isfinite(loss_value),
            "skipped_total": 0,
        }
        if aux is not None:
            metrics["aux"] = aux
        return metrics

    def report() -> str:
        grads, old, new = last["grads"], last["old"], last["new"]
        updates = {n: new[n].float() - old[n].float() for n in new}
        text = _report({"grads": grads, "updates": updates, "params": new})
        if config.optimizer in ("adam", "adamw"):
            nus = [
                optimizer.state[p]["exp_avg_sq"].float().numpy() for p in named.values()
            ]
            g = [grads[n].float().numpy() for n in named]
            dtype = str(next(iter(named.values())).dtype).replace("torch.", "")
            note = adam_underflow_note(g, nus, dtype, config.eps)
            text += "\n" + note if note else ""
        if parts.probe is not None:
            text += "\n" + parts.probe(model_before(), last["batch"])
        return text

    def model_before():
        before = copy.deepcopy(model)
        before.load_state_dict(last["model_before"])
        return before

    def locate() -> dict[str, Any] | None:
        # The naive step is a plain function, which `locate` does not take:
        # the same step as an unguarded TrainStep (the task's naive loss, no
        # scaler, no autocast of its own) on copies of the state before it.
        from torchref import diagnostics, train

        before = model_before()
        opt, _ = _optimizer(config, parts, before)
        opt.load_state_dict(last["opt_before"])
        step = train.TrainStep(
            before, opt, parts.loss_fn, scaler=None, check_update=False
        )
        loc = diagnostics.locate(step, last["batch"])
        return None if loc is None else loc._asdict()

    return step, report, locate


def stable_step(config, parts):
    """The stable step (a `torchref.train.TrainStep`) and the scheduler or None.

    Autocast to ``config.precision`` for a low-precision run, the real
    ``GradScaler`` (`DynamicLossScale`) for float16, ``clip_grad_norm_`` at
    ``config.max_grad_norm`` and a skipped update on non-finite gradients;
    the task's ``spike_guard`` (a spike is skipped the same way) if it has one.
    On a DDP rank it drives ``parts.ddp`` (the library's data-parallel
    step: global loss, loss / N summed, one device's float16 headroom).
    """
    from torchref import train
    from torchref.loss_scale import DynamicLossScale

    low = config.precision != "float32"
    model = parts.model
    optimizer, scheduler = _optimizer(config, parts, model)
    if parts.spike_guard is not None:
        optimizer = parts.spike_guard(optimizer)
    step = train.TrainStep(
        model if parts.ddp is None else parts.ddp,
        optimizer,
        lambda m, batch: parts.loss_fn(m, batch),
        max_grad_norm=config.max_grad_norm,
        # float16 only: bfloat16 has float32's exponent range, nothing
        # underflows that scaling would save (torch.amp does not scale it)
        scaler=DynamicLossScale() if config.precision == "float16" else None,
        autocast_dtype=torch_dtype(config.precision) if low else None,
    )
    return step, scheduler


def _finite_model(model) -> bool:
    from torchref.loss_scale import all_finite

    tensors = list(model.parameters()) + list(model.buffers())
    return all_finite([t for t in tensors if t.is_floating_point()])


def evaluate(config, parts, heldout) -> dict[str, float]:
    """``parts.evaluate`` in eval mode, under no_grad and, for a low-precision
    run, autocast; the model is back in train mode afterwards."""
    import contextlib

    import torch

    model = parts.model
    model.eval()
    ctx = contextlib.nullcontext()
    if config.precision != "float32":  # a .half() model is float16 anyway
        ctx = torch.autocast("cpu", dtype=torch_dtype(config.precision))
    try:
        with torch.no_grad(), ctx:
            return parts.evaluate(model, heldout)
    finally:
        model.train()


def run_torch(
    task, config, weights, batches, heldout, *, progress=True, log=None, wrap=None
) -> RunResult:
    """One torch run of `task` as `config` says, in this process, on
    `torchref.train.fit`.

    ``log(record)``, if given, is called with each step's `fit` record.
    ``wrap(parts) -> parts`` rewires the task's parts first: a DDP rank of
    `examples.harness.ddp.torch_multiprocess` (``config.devices > 1``) runs
    this with its wrap; `examples.harness.run.train_and_evaluate` spawns the
    ranks.

    Returns:
      A :class:`RunResult` (``framework="torch"``).

    Raises:
      ValueError: ``config.devices > 1`` without ``wrap`` (one process is
        one device).
    """
    import torch

    if config.devices > 1 and wrap is None:
        raise ValueError(
            f"run_torch trains in this process; config.devices={config.devices} "
            "needs DDP processes: use examples.harness.run.train_and_evaluate, "
            "which spawns them (examples.harness.ddp.torch_multiprocess)"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)
    try:
        return _run(task, config, weights, batches, heldout, progress, log, wrap)
    finally:
        torch.set_num_threads(threads)  # leave no global state behind


def _run(task, config, weights, batches, heldout, progress, log, wrap) -> RunResult:
    from torchref import train

    parts = task.torch_parts(config, weights)
    if wrap is not None:
        parts = wrap(parts)
    batches = batches[: config.steps]
    fit_args = dict(log=train.Log(progress=progress, time_steps=True))
    if config.eval_every is not None:
        fit_args.update(
            evaluate=(lambda _step: evaluate(config, parts, heldout), config.eval_every)
        )
    if config.mode == "naive":
        step, report, locate = naive_step(config, parts)
        box = {"first": None, "text": "", "location": None}

        def on_step(record, _step):
            if log is not None:
                log(record)
            if box["first"] is None and not record["finite"]:
                box["first"], box["text"] = record["step"], report()
                box["location"] = locate()

        history = train.fit(
            step,
            batches,
            on_step=on_step,
            nan_policy=train.NanPolicy.skip(stop_after=config.stop_after_nonfinite),
            **fit_args,
        )
        first_bad, text = box["first"], box["text"]
        located = (first_bad, box["location"])
    else:
        step, scheduler = stable_step(config, parts)
        model = parts.model

        def stable_report(record, _step):
            grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            params = dict(model.named_parameters())
            return _report({"grads": grads, "params": params})

        watch = Watch(config, lambda s: not _finite_model(s.model), stable_report, log)

        # fit steps the scheduler after applied steps only: a skipped step
        # keeps the schedule (as optax's count does), and checkpoints it.
        to_torch = parts.to_torch
        history = train.fit(
            step, [to_torch(b) for b in batches], on_step=watch,
            schedulers=scheduler, **fit_args,
        )  # fmt: skip
        first_bad, text = watch.first_bad, watch.text
        located = None  # fit located the first skipped step (its record)
    scores = evaluate(config, parts, heldout)
    return make_result("torch", config, history, first_bad, text, scores, located)
