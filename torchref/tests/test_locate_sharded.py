"""`diagnostics.locate` of a DDP or FSDP2 step without gathering (issue 36,
item 4), the twin of jaxstable's ``test_locate_sharded``.

Two gloo processes on 127.0.0.1 (`test_distributed.launch`: bounded
timeout, the processes never outlive the call) hold one MLP, wrapped by
DDP or split by FSDP2 ``fully_shard`` (every weight a `DTensor` holding
half the rows on each rank), and each its own rows of the batch
(`distributed.shard_batch`). Each rank calls `locate`; every answer must
name the layer, the op and the rank whose rows made the first non-finite
value, the same on both ranks, while only small records (a few hundred
bytes a rank, counted) cross ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchref.tests.test_distributed import launch

pytestmark = pytest.mark.slow

ROWS = 8  # global batch: rank 1 holds rows 4..7


def _batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = np.zeros((ROWS, 3), np.float32)
    overflow = x.copy()
    overflow[6] = 40.0  # rank 1: exp overflows in "act"
    nan_in = x.copy()
    nan_in[1, 2] = np.nan  # rank 0
    zero = x.copy()
    zero[5] = 0.0  # rank 1: sqrt(0) in the backward of "norm"
    return {
        "overflow": (overflow, y),
        "input": (nan_in, y),
        "backward": (zero, y),
        "finite": (x, y),
    }


class Exp(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x)


class Norm(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt((x * x).sum(-1, keepdim=True))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        torch.nn.init.zeros_(self.l1.bias)
        self.act = Exp()
        self.l2 = torch.nn.Linear(8, 8)
        self.norm = Norm()
        self.head = torch.nn.Linear(9, 3)

    def forward(self, x):
        z = self.l1(x)
        h = self.l2(self.act(z * 3.0))
        return self.head(torch.cat([h, self.norm(z)], -1))


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _locate_all(strategy: str) -> dict:
    from torchref import diagnostics, distributed, train
    from torchref._src import locate_shards

    torch.manual_seed(0)
    mesh = distributed.make_mesh()
    model = distributed.shard_state(MLP(), mesh, strategy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = train.TrainStep(model, opt, mse, check_update=strategy != "fsdp")
    result = {
        "split": all(hasattr(p, "to_local") for p in model.parameters()),
        "sizes": [
            tuple(getattr(p, "to_local", lambda p=p: p)().shape)
            for p in model.parameters()
        ],
    }
    for name, (x, y) in _batches().items():
        batch = distributed.shard_batch((torch.tensor(x), torch.tensor(y)), mesh)
        loc = diagnostics.locate(step, batch)
        result[name] = None if loc is None else loc._asdict()
        result[name + "_bytes"] = locate_shards.stats["exchanged_bytes"]
        grads = [p.grad for p in model.parameters()]
        result[name + "_grads_untouched"] = all(g is None for g in grads)
    result["fit"] = _fit_location(step, mesh)
    return result


def _fit_location(step, mesh) -> dict | None:
    """The location `fit` records for the overflow batch, with the one
    change `fit` needs (its `_locate_step` gives the step itself under DDP
    and FSDP2, so `locate` takes the distributed path on every rank)."""
    from torchref import distributed, train
    from torchref._src import fit as fit_module

    fit_module._locate_step = lambda s: s if isinstance(s, train.TrainStep) else None
    b = _batches()
    data = [b["finite"], b["overflow"], b["finite"]]
    hist = train.fit(
        step,
        [(torch.tensor(x), torch.tensor(y)) for x, y in data],
        log=train.Log(None, progress=False),
        batch_transform=lambda batch: distributed.shard_batch(batch, mesh),
    )
    return hist[1].get("location")


@pytest.fixture(scope="module", params=["fsdp", "data_parallel"])
def located(request):
    return request.param, launch(_locate_all, 2, request.param)


def test_fsdp_weights_are_split(located):
    strategy, ranks = located
    if strategy == "fsdp":
        assert all(r["split"] for r in ranks)
        assert ranks[0]["sizes"][0] == (4, 4)  # l1.weight: 8 rows, 4 a rank


def test_forward_overflow_names_layer_op_and_rank(located):
    _, ranks = located
    a, b = (r["overflow"] for r in ranks)
    assert a == b
    assert a["phase"] == "forward" and a["path"] == "act" and a["op"] == "exp"
    assert a["detail"].endswith("[rank 1]"), a["detail"]


def test_bad_input_names_its_rank(located):
    _, ranks = located
    a, b = (r["input"] for r in ranks)
    assert a == b
    assert a["phase"] == "input" and a["nan_count"] == 1
    assert "[rank 0]" in a["detail"], a["detail"]


def test_backward_names_layer_and_rank(located):
    _, ranks = located
    a, b = (r["backward"] for r in ranks)
    assert a == b
    assert a["phase"] == "backward" and a["path"].startswith("l1."), a
    assert "in norm" in a["detail"] and a["detail"].endswith("[rank 1]"), a


def test_finite_step_is_none_and_state_untouched(located):
    _, ranks = located
    for r in ranks:
        assert r["finite"] is None
        assert all(r[k + "_grads_untouched"] for k in ("overflow", "backward"))


def test_fit_records_the_location(located):
    _, ranks = located
    a, b = (r["fit"] for r in ranks)
    assert a == b and a is not None
    assert (a["phase"], a["path"], a["op"]) == ("forward", "act", "exp"), a
    assert a["detail"].endswith("[rank 1]"), a


def test_only_small_records_cross_ranks(located):
    _, ranks = located
    for r in ranks:
        for name in ("overflow", "input", "backward", "finite"):
            assert r[name + "_bytes"] < 4096, (name, r[name + "_bytes"])
