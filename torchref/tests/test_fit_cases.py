"""`torchref.train.fit`'s cases of issue 34 that only torch has: a
`DataLoader` that shuffles (with workers) resumes on the very batches of
the uninterrupted run, and learning-rate schedulers go with the steps."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchref import train
from torchref.transforms import skip_spikes


class _Noisy(Dataset):
    """24 samples ``(x + noise, y, index)``: the noise is drawn from the
    loader's (or its worker's) RNG, as a random augmentation is."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(24, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i], i


def _step(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return train.TrainStep(model, opt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())


def _run(loader, seen, **kw):
    step = _step()
    train.fit(
        step, loader, progress=False,
        batch_transform=lambda b: seen.extend(b[2].tolist()) or b, **kw,
    )  # fmt: skip
    return step


@pytest.mark.parametrize(
    "shuffle, workers", [(True, 0), (True, 2), (False, 0)], ids=str
)
def test_a_dataloader_resumes_on_the_batches_of_the_uninterrupted_run(
    shuffle, workers, tmp_path
):
    # The old fit restored the global RNG, then iter(loader) drew the
    # sampler's permutation and the workers' base seed from it: the resumed
    # epoch saw other samples (some twice), other noise and, even without
    # shuffling, other dropout masks (the base seed draw moved the RNG).
    def loader():
        return DataLoader(_Noisy(), batch_size=4, shuffle=shuffle, num_workers=workers)

    seen_full: list[int] = []
    full = _run(loader(), seen_full)
    seen: list[int] = []
    _run(loader(), seen, steps=3, checkpoint_dir=tmp_path)
    torch.manual_seed(99)  # a new process: its RNG is not the run's
    resumed = _run(loader(), seen, checkpoint_dir=tmp_path, resume=True)
    assert seen == seen_full and sorted(seen) == list(range(24))
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def _linear_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train.TrainStep(model, opt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())


def _linear_data(n=10, nan_at=()):
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        if i in nan_at:
            x[0, 0] = float("nan")
        out.append((x, x.sum(1, keepdim=True)))
    return out


def _one_cycle(step):
    return torch.optim.lr_scheduler.OneCycleLR(
        step.optimizer, max_lr=0.1, total_steps=10
    )


def test_a_one_cycle_run_resumed_uses_the_learning_rates_of_the_uninterrupted_one(
    tmp_path,
):
    # The scheduler's state is in every checkpoint: the old way (stepped in
    # on_step, not saved) resumed OneCycle at its first learning rate.
    lrs = []

    def record(rec, step):
        lrs.append(step.optimizer.param_groups[0]["lr"])

    full = _linear_step()
    train.fit(full, _linear_data(), schedulers=_one_cycle(full), log=None)
    first = _linear_step()
    ckpt = train.Checkpointing(tmp_path, resume=True)
    train.fit(
        first, _linear_data(), steps=4, checkpoint=ckpt, log=None,
        schedulers=_one_cycle(first), on_step=record,
    )  # fmt: skip
    resumed = _linear_step()
    train.fit(
        resumed, _linear_data(), checkpoint=ckpt, log=None,
        schedulers=_one_cycle(resumed), on_step=record,
    )  # fmt: skip
    ref = _linear_step()
    ref_lrs = []
    train.fit(
        ref, _linear_data(), schedulers=_one_cycle(ref), log=None,
        on_step=lambda r, s: ref_lrs.append(s.optimizer.param_groups[0]["lr"]),
    )  # fmt: skip
    assert lrs == ref_lrs
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_schedulers_step_on_applied_steps_unless_told_every_step():
    step = _linear_step()
    applied = torch.optim.lr_scheduler.StepLR(step.optimizer, 1, gamma=0.5)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    every = torch.optim.lr_scheduler.StepLR(other, 1, gamma=0.5)
    train.fit(
        step, _linear_data(5, nan_at={1, 2}), log=None,
        schedulers=[applied, (every, "every")],
    )  # fmt: skip
    assert applied.last_epoch == 3 and every.last_epoch == 5


def test_a_rollback_restores_the_schedulers_with_the_state():
    step = _linear_step()
    sched = torch.optim.lr_scheduler.StepLR(step.optimizer, 1, gamma=0.5)
    policy = train.NanPolicy.rollback(max_consecutive=1, every=2, max=5)
    hist = train.fit(
        step,
        _linear_data(6, nan_at={3}),
        nan_policy=policy,
        log=None,
        schedulers=[(sched, "every")],
    )
    # every step: 6 steps, but the rollback at step 3 went back to step 2
    assert [h.get("rolled_back", False) for h in hist][3]
    assert sched.last_epoch == 4
    assert step.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**4


@pytest.mark.parametrize(
    "bad, match",
    [
        (object(), "schedulers: each must have step"),
        ([("x", "every")], "schedulers: each must have step"),
    ],
)
def test_bad_schedulers_are_named(bad, match):
    with pytest.raises(TypeError, match=match):
        train.fit(_linear_step(), _linear_data(1), schedulers=bad, log=None)


def test_a_scheduler_over_a_wrapper_is_stepped_and_checkpointed(tmp_path):
    # Needs the wrappers accepted by torch.optim.lr_scheduler (issue 34
    # item 9, the torch-ckpt-sched branch): StepLR(skip_spikes(SGD)) raised
    # "SkipSpikes is not an Optimizer" before it.
    def parts():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = skip_spikes(torch.optim.SGD(model.parameters(), lr=0.1))
        step = train.TrainStep(model, opt, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        return step, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    data = _linear_data(6, nan_at={2})
    full, sched = parts()
    train.fit(full, data, schedulers=sched, log=None)
    assert sched.last_epoch == 5  # the NaN step was skipped: not stepped
    ckpt = train.Checkpointing(tmp_path, resume=True)
    first, sched = parts()
    train.fit(first, data, steps=3, checkpoint=ckpt, schedulers=sched, log=None)
    resumed, sched = parts()
    train.fit(resumed, data, checkpoint=ckpt, schedulers=sched, log=None)
    assert sched.last_epoch == 5
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
