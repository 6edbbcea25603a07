"""torch.optim.lr_scheduler over the torchref wrappers (issue 34 item 9).

Every scheduler class of ``torch.optim.lr_scheduler`` (and SWALR) must
behave with a wrapper in place of the optimizer exactly as with the bare
optimizer: the same learning rates and momenta step by step, the same
warnings, and a state_dict round trip that resumes the sequence. The
warning cases follow PyTorch's own ``test/optim/test_lrscheduler.py``.
"""

import copy
import gc
import inspect
import pickle
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as sched
from torch.optim.swa_utils import SWALR

from torchref import transforms

WRAPPERS = {
    "skip_non_finite": transforms.skip_non_finite,
    "stable_optimizer": lambda o: transforms.stable_optimizer(o, max_grad_norm=1.0),
    "skip_spikes": lambda o: transforms.skip_spikes(o, window=4, min_history=2),
    "accumulate_gradients": lambda o: transforms.accumulate_gradients(o, 1),
}

# One small configuration per class; `step_arg` is ReduceLROnPlateau's metric.
SCHEDULERS = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda e: 0.8),
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.5),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=3),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.25, total_iters=4),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.ConstantLR(o, factor=0.5, total_iters=2), sched.ExponentialLR(o, 0.9)],
        milestones=[3],
    ),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=6, power=2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=5),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=3), sched.ExponentialLR(o, 0.9)],
        optimizer=o,
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=1, factor=0.5),
    # Both read optimizer.defaults (momentum) and cycle the groups' momentum.
    "CyclicLR": lambda o: sched.CyclicLR(o, 0.01, 0.1, step_size_up=2),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(
        o, T_0=3
    ),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=20),
    "SWALR": lambda o: SWALR(o, swa_lr=0.05, anneal_epochs=3),
}


def _optimizer() -> torch.optim.SGD:
    # Two groups, the second with its own lr, as PyTorch's tests build theirs.
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.05)


def _run(scheduler, steps: int, *, nan_at=()) -> list:
    """(lrs, momenta) of each group after each of `steps` steps, the
    optimizer stepped before the scheduler (its gradients NaN at `nan_at`)."""
    out = []
    for i in range(steps):
        for group in scheduler.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.full_like(p, float("nan") if i in nan_at else 1.0)
        scheduler.optimizer.step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(1.0)  # no improvement: the lr falls
        else:
            scheduler.step()
        groups = scheduler.optimizer.param_groups
        out.append([(float(g["lr"]), g.get("momentum")) for g in groups])
    return out


def _lr_classes() -> set[str]:
    return {
        name
        for name, c in vars(sched).items()
        if inspect.isclass(c)
        and issubclass(c, sched.LRScheduler)
        and not name.startswith("_")
        and c is not sched.LRScheduler
    }


def test_every_scheduler_class_is_covered():
    assert _lr_classes() <= set(SCHEDULERS)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_wrapper_gives_the_bare_optimizers_schedule(name, wrapper):
    with warnings.catch_warnings(record=True) as bare_warnings:
        warnings.simplefilter("always")
        bare = _run(SCHEDULERS[name](_optimizer()), 8)
    with warnings.catch_warnings(record=True) as wrapped_warnings:
        warnings.simplefilter("always")
        scheduler = SCHEDULERS[name](WRAPPERS[wrapper](_optimizer()))
        wrapped = _run(scheduler, 8)
    assert wrapped == bare
    assert [str(w.message) for w in wrapped_warnings] == [
        str(w.message) for w in bare_warnings
    ]
    # The state_dict round trip: a new wrapper and scheduler, loaded after 4
    # steps, go on as the uninterrupted pair.
    first = SCHEDULERS[name](WRAPPERS[wrapper](_optimizer()))
    _run(first, 4)
    saved = copy.deepcopy((first.optimizer.state_dict(), first.state_dict()))
    again = SCHEDULERS[name](WRAPPERS[wrapper](_optimizer()))
    again.optimizer.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    assert again.get_last_lr() == first.get_last_lr()
    assert _run(again, 4) == bare[4:]


def test_the_step_order_warning_is_pytorchs_with_a_wrapper():
    order = r"lr_scheduler\.step\(\)` before `optimizer\.step\(\)"
    # The old pattern (scheduler first) warns, as with a bare optimizer.
    opt = transforms.skip_non_finite(_optimizer())
    scheduler = sched.StepLR(opt, step_size=3)
    with pytest.warns(UserWarning, match=order):
        scheduler.step()
        opt.step()
    # The new pattern does not; a SKIPPED wrapper step counts as the
    # optimizer's step (it was called, in the right order), unlike
    # GradScaler's skip, which never calls optimizer.step().
    opt = transforms.skip_non_finite(_optimizer())
    scheduler = sched.StepLR(opt, step_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrs = _run(scheduler, 4, nan_at=(0, 1))
    assert opt.skip_state.skipped_total == 2
    # The schedule advances on every scheduler.step(), skipped steps included.
    assert [lr[0][0] for lr in lrs] == pytest.approx([0.05, 0.05, 0.005, 0.005])


def test_an_optimizer_step_replaced_after_the_scheduler_is_warned_of():
    opt = transforms.stable_optimizer(_optimizer())
    scheduler = sched.StepLR(opt, step_size=3)
    old = opt.step
    opt.step = lambda *a, **k: old(*a, **k)
    opt.step()
    with pytest.warns(UserWarning, match="has been overridden"):
        scheduler.step()


def test_a_wrapper_under_a_scheduler_is_collected_and_copied():
    # No reference cycle through the scheduler's patched step (PyTorch's
    # test_no_cyclic_references), and a copy or pickle of the wrapper does
    # not carry that patch (it would step the original).
    opt = transforms.skip_non_finite(_optimizer())
    scheduler = sched.LambdaLR(opt, lambda e: 1.0)
    clone = copy.deepcopy(opt)
    assert "step" not in vars(clone) and "step" not in vars(
        pickle.loads(pickle.dumps(opt))
    )
    del scheduler
    assert gc.get_referrers(opt) == []
    params = [p for g in opt.param_groups for p in g["params"]]
    before = [p.clone() for p in params]
    for g in clone.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    clone.step()
    assert all(map(torch.equal, params, before))


def test_schedulers_still_refuse_what_is_no_optimizer_and_wrappers_nest_as_before():
    with pytest.raises(TypeError, match="is not an Optimizer"):
        sched.StepLR(object(), step_size=1)
    with pytest.raises(TypeError, match="got the torchref wrapper SkipNonFinite"):
        transforms.skip_non_finite(transforms.skip_non_finite(_optimizer()))
