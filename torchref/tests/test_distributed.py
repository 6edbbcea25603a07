"""`torchref.train.TrainStep` under DDP and FSDP2 (gloo, CPU, 2 processes).

Two processes are spawned with `torch.multiprocessing` on 127.0.0.1 and a
free port, each trains the same MLP from the same weights on its half of
the same 56 global batches, and sends its per-step results back through a
queue; the parent compares them with a 1-process run of the same batches.
Every launch is bounded (``TIMEOUT_S``) and its processes are joined,
terminated or killed in a ``finally``.

Poisoned INPUTS (no injected gradient): batch 7 all NaN, batches 20 and 45
NaN in one rank's rows only, batch 33 a single +inf in x[0, 5] (rank 0's
rows): tanh saturates, its derivative is exactly 0, so only the gradient of
row 5 of w1 is 0*inf = NaN. Under FSDP row 5 of w1 lives on rank 1: rank 1
sees the NaN in its gradient shard, rank 0 does not, so only a global flag
makes both skip.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tolerance
from torchref import distributed, losses, train
from torchref.loss_scale import DynamicLossScale

WORLD = 2
STEPS = 56
BATCH = 16
IN, HIDDEN, OUT = 8, 16, 3
POISON = {7: (slice(None),), 20: (slice(8, 12),), 33: (0, 5), 45: (slice(4, 8),)}
TIMEOUT_S = 120


def problem(seed: int = 0):
    """Initial weights (``x @ w`` layout) and the global batches, as numpy."""
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(0, 0.4, (IN, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, 0.4, (HIDDEN, OUT)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }
    batches = []
    for i in range(STEPS):
        x = rng.normal(size=(BATCH, IN)).astype(np.float32)
        y = rng.normal(size=(BATCH, OUT)).astype(np.float32)
        if i in POISON:
            x[POISON[i]] = np.inf if i == 33 else np.nan
        batches.append((x, y))
    return params, batches


class MLP(torch.nn.Module):
    """``tanh(x @ w1 + b1) @ w2 + b2`` with JAX's weight layout."""

    def __init__(self, params):
        super().__init__()
        for name, value in params.items():
            setattr(self, name, torch.nn.Parameter(torch.tensor(value)))

    def forward(self, x):
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _full(p: torch.Tensor) -> np.ndarray:
    # A sharded DTensor is gathered (a collective: every rank calls it).
    p = p.full_tensor() if hasattr(p, "full_tensor") else p
    return p.detach().numpy().ravel().copy()


def _local_shards_finite(model) -> bool:
    """Whether this rank's own gradient shards are finite (no collective)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return all(bool(torch.isfinite(g).all()) for g in local)


def run_trajectory(strategy, params, batches):
    """Trains on the global batches; strategy None: one process, no group."""
    model = MLP(params)
    ls = DynamicLossScale(loss_scale=2.0**10, period=8)
    mesh = None
    if strategy is not None:
        mesh = distributed.make_mesh()
        model = distributed.shard_state(model, mesh, strategy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # FSDP: TrainStep's update check (copy, step, check, restore) is local
    # to each rank's shard and uses _foreach_copy_, which DTensor lacks: off
    # (see docs/distributed.md). The gradient flag stays global.
    step = train.TrainStep(
        model,
        opt,
        mse,
        max_grad_norm=1.0,
        scaler=ls,
        check_update=strategy != "fsdp",
    )
    names = ("w1", "b1", "w2", "b2")
    plain = model.module if strategy == "data_parallel" else model
    rec = {k: [] for k in ("params", "loss_scale", "skipped_total", "finite")}
    rec.update(grads_finite=[], replicas_identical=[], local_shards_finite=[])
    for x, y in batches:
        batch = (torch.tensor(x), torch.tensor(y))
        if mesh is not None:
            batch = distributed.shard_batch(batch, mesh)
        m = step(batch)
        rec["params"].append(np.concatenate([_full(getattr(plain, n)) for n in names]))
        rec["loss_scale"].append(step.scaler.get_scale())
        for key in ("skipped_total", "finite", "grads_finite"):
            rec[key].append(m[key])
        rec["local_shards_finite"].append(_local_shards_finite(model))
        rec["replicas_identical"].append(
            distributed.replicas_identical((model, opt, step.scaler))
        )
    return {k: np.asarray(v) for k, v in rec.items()}


# ------------------------------------------------------------------ launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, results, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo"
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2),
        )
        try:
            results.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def launch(fn, world: int, *args, timeout: float = TIMEOUT_S) -> list:
    """Runs ``fn(*args)`` in ``world`` spawned gloo processes; their results.

    Raises RuntimeError with a rank's traceback if one fails, TimeoutError
    after ``timeout`` seconds; the processes never outlive the call.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world, port, results, args), daemon=True
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        out = {}
        while len(out) < world:
            left = deadline - time.monotonic()
            try:
                rank, ok, payload = results.get(timeout=max(left, 0.1))
            except queue.Empty:
                raise TimeoutError(
                    f"{world} processes did not finish in {timeout} s; "
                    f"results from ranks {sorted(out)}"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _fit_ddp(params, batches, folder):
    """`train.fit` under DDP: each rank its rows (``batch_transform``); rank 0
    alone writes the JSONL log and the checkpoints (the usual idiom)."""
    mesh = distributed.make_mesh()
    model = distributed.shard_state(MLP(params), mesh, "data_parallel")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ls = DynamicLossScale(loss_scale=2.0**10, period=8)
    step = train.TrainStep(model, opt, mse, max_grad_norm=1.0, scaler=ls)
    rank0 = dist.get_rank() == 0
    ckpt, log = os.path.join(folder, "ckpt"), os.path.join(folder, "log.jsonl")
    hist = train.fit(
        step,
        [(torch.tensor(x), torch.tensor(y)) for x, y in batches],
        progress=False,
        batch_transform=lambda b: distributed.shard_batch(b, mesh),
        checkpoint_dir=ckpt if rank0 else None,
        checkpoint_every=20 if rank0 else None,
        log_path=log if rank0 else None,
    )
    out = {k: np.array([h[k] for h in hist]) for k in ("loss_scale", "finite")}
    out["skipped_total"] = np.array([h["skipped_total"] for h in hist])
    names = ("w1", "b1", "w2", "b2")
    out["params"] = np.concatenate([_full(getattr(model.module, n)) for n in names])
    if rank0:
        out["checkpoints"] = sorted(os.listdir(ckpt))
        with open(log, encoding="utf-8") as f:
            out["log_lines"] = len(f.readlines())
    return out


def _all_runs(params, batches, folder):
    """What each rank computes for the tests: one launch for all of them."""
    out = {s: run_trajectory(s, params, batches) for s in distributed.STRATEGIES}
    out["fit"] = _fit_ddp(params, batches, folder)
    mesh = distributed.make_mesh()
    differs = torch.tensor([3.0 + dist.get_rank()])
    out["identical_on_differing"] = distributed.replicas_identical(differs)
    out["identical_on_equal"] = distributed.replicas_identical({"t": torch.ones(2)})
    out["batch_slice"] = distributed.shard_batch(torch.arange(4.0), mesh).tolist()
    out["global_mean"] = _masked_runs(*masked_problem())
    return out


# global_mean (issue 26 item 6): cross-entropy with ignore_index over
# unevenly labelled rows (a step where rank 1 has no label, one with no label
# at all); the problem of jaxstable/tests/test_shard_map_scale.py's masked runs.
KEPT = [range(8), range(4), (), (6,), (0, 1, 2, 5), (7,)]  # labelled rows per step


def masked_problem():
    rng = np.random.default_rng(1)
    batches = []
    for rows in KEPT:
        x = rng.normal(0, 2, (8, 4)).astype(np.float32)
        labels = np.full(8, -1, np.int64)
        labels[list(rows)] = rng.integers(0, 3, len(rows))
        batches.append((x, labels))
    return rng.normal(0, 0.5, (4, 3)).astype(np.float32), batches


def _masked_loss(naive):
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


def _masked_train(w, batches, naive=False):
    """(reported losses, final weight); DDP when a process group is up."""
    model = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(w.T))
    mesh = distributed.make_mesh() if dist.is_initialized() else None
    if mesh is not None:
        model = distributed.shard_state(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = train.TrainStep(model, opt, _masked_loss(naive), max_grad_norm=1.0)
    got = []
    for x, labels in batches:
        batch = (torch.tensor(x), torch.tensor(labels))
        if mesh is not None:
            batch = distributed.shard_batch(batch, mesh)
        got.append(float(step(batch)["loss"]))
    plain = model.module if mesh is not None else model
    return np.array(got), plain.weight.detach().numpy().copy()


def _masked_runs(w, batches):
    return _masked_train(w, batches), _masked_train(w, batches, naive=True)


# --------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def single():
    params, batches = problem()
    return run_trajectory(None, params, batches)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    params, batches = problem()
    folder = str(tmp_path_factory.mktemp("ddp_fit"))
    return launch(_all_runs, WORLD, params, batches, folder)


@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_two_processes_equal_one_process(ranks, single, strategy):
    from conftest import tolerance

    assert sorted(np.flatnonzero(~single["finite"])) == sorted(POISON)
    for rank, out in enumerate(ranks):
        got = out[strategy]
        for key in ("loss_scale", "skipped_total", "finite", "grads_finite"):
            np.testing.assert_array_equal(
                got[key], single[key], err_msg=f"{strategy} rank {rank} {key}"
            )
        np.testing.assert_allclose(
            got["params"],
            single["params"],
            **tolerance("float32_trajectory"),
            err_msg=f"{strategy} rank {rank}",
        )


@pytest.mark.parametrize("strategy", distributed.STRATEGIES)
def test_one_poisoned_slice_every_rank_skips(ranks, strategy):
    for out in ranks:
        got = out[strategy]
        for i in (20, 33, 45):  # non-finite in one rank's rows only
            assert not got["finite"][i] and not got["grads_finite"][i]
            assert got["skipped_total"][i] == got["skipped_total"][i - 1] + 1
            assert got["loss_scale"][i] == got["loss_scale"][i - 1] / 2
            np.testing.assert_array_equal(got["params"][i], got["params"][i - 1])
        # Model, optimizer state and scale (their replicated parts) are
        # bitwise equal on both ranks after every step.
        assert got["replicas_identical"].all(), strategy
    # And the two ranks' full parameters are bitwise equal.
    np.testing.assert_array_equal(
        ranks[0][strategy]["params"], ranks[1][strategy]["params"]
    )


def test_fsdp_ranks_see_different_shards_and_take_one_decision(ranks):
    # At batch 33 the NaN gradient row of w1 lies in rank 1's shard only: a
    # check of the local shards disagrees between the ranks, yet both skip
    # (GradScaler reduces found_inf over the mesh). The batch really tests
    # the global flag; under DDP every rank holds the whole gradient.
    r0, r1 = (out["fsdp"] for out in ranks)
    assert (r0["local_shards_finite"][33], r1["local_shards_finite"][33]) == (
        True,
        False,
    )
    assert not r0["grads_finite"][33] and not r1["grads_finite"][33]
    dp0, dp1 = (out["data_parallel"] for out in ranks)
    assert not dp0["local_shards_finite"][33] and not dp1["local_shards_finite"][33]


def test_replicas_identical_and_shard_batch_across_ranks(ranks):
    r0, r1 = ranks
    assert not r0["identical_on_differing"] and not r1["identical_on_differing"]
    assert r0["identical_on_equal"] and r1["identical_on_equal"]
    assert (r0["batch_slice"], r1["batch_slice"]) == ([0.0, 1.0], [2.0, 3.0])


def test_fit_under_ddp_equals_one_process(ranks, single):
    from conftest import tolerance

    for rank, out in enumerate(ranks):
        got = out["fit"]
        np.testing.assert_array_equal(got["finite"], single["finite"])
        np.testing.assert_array_equal(got["skipped_total"], single["skipped_total"])
        # A record's loss_scale is the scale its step used: the one before.
        np.testing.assert_array_equal(got["loss_scale"][1:], single["loss_scale"][:-1])
        np.testing.assert_allclose(
            got["params"],
            single["params"][-1],
            **tolerance("float32_trajectory"),
            err_msg=f"rank {rank}",
        )
    np.testing.assert_array_equal(ranks[0]["fit"]["params"], ranks[1]["fit"]["params"])
    # Rank 0 wrote the log and the checkpoints (the last 3 kept), rank 1
    # nothing (it was given no path).
    assert ranks[0]["fit"]["log_lines"] == STEPS
    assert ranks[0]["fit"]["checkpoints"] == [
        f"step_{n:08d}.pt" for n in (20, 40, STEPS)
    ]
    assert "checkpoints" not in ranks[1]["fit"]


def test_fit_batch_transform_runs_after_the_resume_skip(tmp_path):
    # Same test as jaxstable's: the transform sees only the batches it runs.
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    step = train.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: (m(b[None]) - b.sum()).pow(2).mean(),
    )
    data = [torch.full((2,), float(i)) for i in range(4)]
    seen = []

    def transform(b):
        seen.append(float(b[0]))
        return b * 2

    kwargs = dict(checkpoint_dir=tmp_path, progress=False, batch_transform=transform)
    hist = train.fit(step, data, steps=2, **kwargs)
    train.fit(step, data, resume=True, **kwargs)
    assert seen == [0.0, 1.0, 2.0, 3.0]
    # The step trained on the transformed batches (2*i), not on data: at
    # w = 0 the loss of batch 1 is (0 - 4)**2 after one update from b = 0.
    assert hist[0]["loss"] == 0.0 and hist[1]["loss"] == 16.0
    with pytest.raises(TypeError, match="batch_transform must be None or a callable"):
        train.fit(step, data, batch_transform=2, progress=False)


def test_bad_arguments_are_refused():
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.make_mesh()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = distributed.make_mesh()
        with pytest.raises(ValueError, match="world size 1"):
            distributed.make_mesh(2)
        with pytest.raises(ValueError, match="strategy must be one of"):
            distributed.shard_state(MLP(problem()[0]), mesh, "zero3")
        with pytest.raises(ValueError, match=r"leaf 1 .* has shape \(\)"):
            distributed.shard_batch((torch.ones(2), torch.tensor(1.0)), mesh)
    finally:
        dist.destroy_process_group()


def test_global_mean_under_ddp_equals_one_process(ranks):
    w, batches = masked_problem()
    one_loss, one_w = _masked_train(w, batches)
    assert one_loss[2] == 0.0  # no label at all: 0, not NaN
    for rank in ranks:
        (loss, weight), (naive_loss, naive_w) = rank["global_mean"]
        np.testing.assert_allclose(loss, one_loss, **tolerance("float32"))
        np.testing.assert_allclose(weight, one_w, **tolerance("float32_trajectory"))
        # Not vacuous: each rank's own mean is far off.
        assert np.abs(naive_loss - one_loss).max() > 0.1
        assert np.abs(naive_w - one_w).max() > 0.05
