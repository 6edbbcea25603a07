"""`torchref.distributed.global_mean` under DDP equals one process (issue 26
item 6): cross-entropy with ``ignore_index`` over unevenly labelled rows
(one step where rank 1 has no label, one with no label at all), 2 gloo
processes on 127.0.0.1 (`test_distributed.launch`: bounded, cleaned up).
The same problem as `jaxstable/tests/test_shard_map_scale.py`'s masked runs.
"""

from __future__ import annotations

import numpy as np
import torch

from conftest import tolerance
from torchref import distributed, losses, train
from torchref.tests.test_distributed import launch

ROWS = 8
KEPT = [range(8), range(4), (), (6,), (0, 1, 2, 5), (7,)]  # labelled rows per step


def problem():
    rng = np.random.default_rng(1)
    batches = []
    for rows in KEPT:
        x = rng.normal(0, 2, (ROWS, 4)).astype(np.float32)
        labels = np.full(ROWS, -1, np.int64)
        labels[list(rows)] = rng.integers(0, 3, len(rows))
        batches.append((x, labels))
    return rng.normal(0, 0.5, (4, 3)).astype(np.float32), batches


def _loss(naive):
    def loss(model, batch):
        x, labels = batch
        if naive:  # each rank's own mean: what DDP gave before
            return losses.softmax_cross_entropy(
                model(x), labels, dim=1, ignore_index=-1
            )
        per = losses.softmax_cross_entropy(
            model(x), labels, dim=1, ignore_index=-1, reduction="none"
        )
        return distributed.global_mean(per, labels != -1)

    return loss


def _train(w, batches, naive=False):
    model = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(w.T))
    mesh = None
    if torch.distributed.is_initialized():
        mesh = distributed.make_mesh()
        model = distributed.shard_state(model, mesh)
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        _loss(naive),
        max_grad_norm=1.0,
    )
    got = []
    for x, labels in batches:
        batch = (torch.tensor(x), torch.tensor(labels))
        if mesh is not None:
            batch = distributed.shard_batch(batch, mesh)
        got.append(float(step(batch)["loss"]))
    plain = model.module if mesh is not None else model
    return np.array(got), plain.weight.detach().numpy().copy()


def _both(w, batches):
    return _train(w, batches), _train(w, batches, naive=True)


def test_global_mean_under_ddp_equals_one_process():
    w, batches = problem()
    one_loss, one_w = _train(w, batches)
    assert one_loss[2] == 0.0  # no label at all: 0, not NaN
    # launch: bounded (timeout=60 s), its processes killed on every path.
    ranks = launch(_both, 2, w, batches, timeout=60)
    for (loss, weight), (naive_loss, naive_w) in ranks:
        np.testing.assert_allclose(loss, one_loss, **tolerance("float32"))
        np.testing.assert_allclose(weight, one_w, **tolerance("float32_trajectory"))
        # Not vacuous: each rank's own mean is far off.
        assert np.abs(naive_loss - one_loss).max() > 0.1
        assert np.abs(naive_w - one_w).max() > 0.05
