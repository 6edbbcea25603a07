"""`torchref.train.fit`'s cases of issue 34 that only torch has: a
`DataLoader` that shuffles (with workers) resumes on the very batches of
the uninterrupted run, and learning-rate schedulers go with the steps."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchref import train


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
