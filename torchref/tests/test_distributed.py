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
import json
import os
import queue
import shutil
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
        log=train.Log(log if rank0 else None, progress=False),
        batch_transform=lambda b: distributed.shard_batch(b, mesh),
        checkpoint=train.Checkpointing(ckpt, every=20) if rank0 else None,
    )
    out = {k: np.array([h[k] for h in hist]) for k in ("loss_scale", "finite")}
    out["skipped_total"] = np.array([h["skipped_total"] for h in hist])
    names = ("w1", "b1", "w2", "b2")
    out["params"] = np.concatenate([_full(getattr(model.module, n)) for n in names])
    if rank0:
        # (the bad-batch list beside them aside: the NaN batch is listed)
        out["checkpoints"] = sorted(set(os.listdir(ckpt)) - {"bad_batches.json"})
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
    out["fits"] = _fits(params, batches, os.path.join(folder, "fits"), True)
    out["errors"] = _errors(params, batches)
    out["folder"] = folder
    out["global_mean"] = _masked_runs(*masked_problem())
    out["outside_params"] = _sharded_temperature(folder)
    # Last: it breaks the process group (rank 1 leaves fit, rank 0's next
    # collective fails).
    out["raises"] = _guarded(lambda: _raise_on_rank_1(params, batches))
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
def _temperature_step(strategy=None):
    """An MLP-free TrainStep whose loss divides by a learned temperature: a
    parameter the optimizer holds outside the model (issue 34 item 8)."""
    torch.manual_seed(0)
    model, temp = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.tensor(1.0))
    if strategy is not None:
        model = distributed.shard_state(model, distributed.make_mesh(), strategy)
    opt = torch.optim.Adam([*model.named_parameters(), ("temperature", temp)])

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]) / temp, batch[1])

    step = train.TrainStep(model, opt, loss_fn, check_update=strategy != "fsdp")
    return step, temp


def _sharded_temperature(folder):
    """Under FSDP2 (the same batches on every rank: the temperature is no
    FSDP parameter, its gradient is not reduced): 2 steps, a sharded
    checkpoint, and new objects loading it; the temperature before / after."""
    step, temp = _temperature_step("fsdp")
    for _ in range(2):
        step((torch.ones(4, 3), torch.tensor([0, 1, 0, 1])))
    train.save_checkpoint(os.path.join(folder, "outside.dcp"), step)
    step, again = _temperature_step("fsdp")
    train.load_checkpoint(os.path.join(folder, "outside.dcp"), step)
    return temp.item(), again.item()


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
        train.fit(step, data, batch_transform=2, log=None)


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


# ------------------------------------------- fit under DDP (issue 26, torch)
# The 40 batches of `problem` without its all-NaN batch 7: the first
# non-finite step (19) has NaN in rank 1's rows only, the next (32) a +inf
# in rank 0's rows only. fit runs on every rank with the SAME arguments
# (checkpoint_dir and log_path too: rank 0 alone writes them).
FIT_STEPS = 40
FP16_STEPS = 12


def fit_batches(batches):
    return [b for i, b in enumerate(batches) if i != 7][:FIT_STEPS]


def fp16_batches(seed: int = 1):
    """Targets of size ~2**8: at the scale 2**15 a row's float16 output
    gradient ``scale * 2 * err / (16 * 3)`` passes float16's 65504, so the
    first steps overflow and the scale backs off, then grows back (period
    2) until it overflows again: one device's skips."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(FP16_STEPS):
        x = rng.normal(size=(BATCH, IN)).astype(np.float32)
        y = (rng.normal(size=(BATCH, OUT)) * 2.0**8).astype(np.float32)
        out.append((x, y))
    return out


class MLPExtra(MLP):
    """`MLP` plus a bias ``extra`` that the forward adds only when told."""

    def __init__(self, params):
        super().__init__(params)
        self.extra = torch.nn.Parameter(torch.ones(OUT))

    def forward(self, x, use_extra=True):
        return super().forward(x) + self.extra if use_extra else super().forward(x)


def _new_step(params, ddp, *, fp16=False, loss_fn=mse, find_unused=None):
    """A TrainStep on `MLP`: one process, or ``ddp`` True / "data_parallel"
    / "fsdp" under the process group (FSDP2 without the update check, see
    `run_trajectory`)."""
    model = MLP(params) if find_unused is None else MLPExtra(params)
    strategy = "data_parallel" if ddp is True else ddp
    if ddp:
        mesh = distributed.make_mesh()
        kw = {"find_unused_parameters": True} if find_unused else {}
        model = distributed.shard_state(model, mesh, strategy, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    check = strategy != "fsdp"
    if fp16:
        ls = DynamicLossScale(loss_scale=2.0**15, period=2)
        return train.TrainStep(
            model, opt, loss_fn, scaler=ls, autocast_dtype="f16", check_update=check
        )
    ls = DynamicLossScale(loss_scale=2.0**10, period=8)
    return train.TrainStep(
        model, opt, loss_fn, max_grad_norm=1.0, scaler=ls, check_update=check
    )


def _params_of(step):
    plain = getattr(step.model, "module", step.model)
    return np.concatenate([_full(getattr(plain, n)) for n in ("w1", "b1", "w2", "b2")])


def _records(hist):
    keys = ("loss", "loss_scale", "finite", "skipped_total")
    return {k: np.array([h[k] for h in hist]) for k in keys}


def _guarded(fn):
    """``fn()``, or the text of what it raised (the tests name it)."""
    try:
        return fn()
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"


def _fits(params, batches, folder, ddp):
    """The fit runs of the issue-26 tests, in one process or on a DDP rank;
    each section's result, or the text of what it raised."""
    data = [(torch.tensor(x), torch.tensor(y)) for x, y in fit_batches(batches)]
    mesh = distributed.make_mesh() if ddp else None
    kw = dict(progress=False)
    if ddp:
        kw["batch_transform"] = lambda b: distributed.shard_batch(b, mesh)

    def run(step, data, **more):
        hist = train.fit(step, data, **kw, **more)
        return {**_records(hist), "params": _params_of(step)}, hist

    def skip():
        # The default locate_first=1 (step 19 is located); a log and
        # checkpoints given on every rank.
        out, hist = run(
            _new_step(params, ddp), data, checkpoint_dir=os.path.join(folder, "skip"),
            checkpoint_every=10, log_path=os.path.join(folder, "skip.jsonl"),
        )  # fmt: skip
        return {**out, "located": [h["step"] for h in hist if "location" in h]}

    def resume():
        # 20 steps, then new objects on every rank (as after a kill) and the
        # same call with resume=True.
        res = dict(checkpoint_dir=os.path.join(folder, "resume"), checkpoint_every=10)
        train.fit(_new_step(params, ddp), data, steps=20, **res, **kw)
        out, hist = run(_new_step(params, ddp), data, resume=True, **res)
        return {**out, "first": hist[0]["step"]}

    def rollback():
        # After each non-finite step, to a snapshot taken every 5 steps.
        out, hist = run(_new_step(params, ddp), data, nan_policy="rollback",
                        max_consecutive_nonfinite=1, rollback_every=5)  # fmt: skip
        return {**out, "rolled": [h["step"] for h in hist if h.get("rolled_back")]}

    def stop():
        try:
            run(_new_step(params, ddp), data, nan_policy="stop",
                max_consecutive_nonfinite=1, locate_first=0)  # fmt: skip
        except train.NonFiniteError as e:
            return e.step, len(e.history)
        return None

    def fp16(strategy=ddp):
        # float16 under autocast from the scale 2**15.
        step = _new_step(params, strategy, fp16=True)
        fp16 = [(torch.tensor(x), torch.tensor(y)) for x, y in fp16_batches()]
        out, _ = run(step, fp16)
        return {**out, "final_scale": step.scaler.get_scale()}

    def fsdp():
        # FSDP2 resumes from the DDP run's checkpoint at step 20 and writes
        # its own (sharded) at step 40.
        src, dst = os.path.join(folder, "skip"), os.path.join(folder, "fsdp")
        if dist.get_rank() == 0:
            os.makedirs(dst)
            shutil.copy(os.path.join(src, "step_00000020.pt"), dst)
        dist.barrier()
        model = distributed.shard_state(MLP(params), mesh, "fsdp")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ls = DynamicLossScale(loss_scale=2.0**10, period=8)
        step = train.TrainStep(
            model, opt, mse, max_grad_norm=1.0, scaler=ls, check_update=False
        )
        with _no_full_gather():  # its own checkpoint is sharded
            out, hist = run(step, data, checkpoint_dir=dst, resume=True)
        return {**out, "first": hist[0]["step"]}

    def fsdp_resume():
        # FSDP2 from the start: 20 steps with sharded checkpoints every 10
        # (torch.distributed.checkpoint: each rank writes its shards; a
        # gather of the full model would raise here), then new objects
        # resume on every rank. Each rank draws from its own RNG stream:
        # the resume restores each its own.
        res = dict(checkpoint_dir=os.path.join(folder, "dcp"), checkpoint_every=10)
        with _no_full_gather():
            torch.manual_seed(100 + dist.get_rank())
            train.fit(_new_step(params, "fsdp"), data, steps=20, **res, **kw)
            drawn = torch.rand(2).tolist()
            torch.manual_seed(0)
            step = _new_step(params, "fsdp")
            out, hist = run(step, data, resume=True, **res)
            rng = [drawn, torch.rand(2).tolist()]
            # save_checkpoint under FSDP2: a sharded directory too.
            train.save_checkpoint(os.path.join(folder, "saved.dcp"), step)
        # The sharded checkpoint at step 20 restores into DDP (each rank
        # reads the whole tensors, no collective).
        step = _new_step(params, True)
        train.CheckpointManager(res["checkpoint_dir"]).restore(step, 20)
        return {**out, "first": hist[0]["step"], "rng": rng, "ddp": _params_of(step)}

    def fsdp_rollback():
        # Back to the last sharded checkpoint on disk (every 5 steps, the
        # first one before step 0 with no Adam state yet): every rank
        # restores it together.
        ckpt = os.path.join(folder, "fsdp_rollback")
        with _no_full_gather():
            out, hist = run(
                _new_step(params, "fsdp"), data, nan_policy="rollback",
                rollback_to="disk", max_consecutive_nonfinite=1,
                checkpoint_dir=ckpt, checkpoint_every=5,
            )  # fmt: skip
        return {**out, "rolled": [h["step"] for h in hist if h.get("rolled_back")]}

    sections = {"skip": skip, "resume": resume, "rollback": rollback}
    if ddp:
        sections["fsdp"] = fsdp
        sections["fsdp_resume"] = fsdp_resume
        sections["fsdp_rollback"] = fsdp_rollback
        # Sharded checkpoints need one directory: each rank its own is refused.
        own = os.path.join(folder, f"own{dist.get_rank()}")
        sections["fsdp_dirs"] = lambda: train.fit(
            _new_step(params, "fsdp"), data, checkpoint_dir=own, **kw
        )
    sections.update(stop=stop, fp16=fp16)
    if ddp:
        sections["fp16_fsdp"] = lambda: fp16("fsdp")
    return {name: _guarded(fn) for name, fn in sections.items()}


class _no_full_gather:
    """Makes a gather of the full FSDP2 state (`TrainStep.state_dict`) raise
    for the block: sharded checkpoints must not need one."""

    def __enter__(self):
        from torchref._src import distributed as impl

        self.impl, self.gather = impl, impl._gather_full

        def refused(tree):
            raise AssertionError("the full FSDP2 state was gathered")

        impl._gather_full = refused

    def __exit__(self, *exc):
        self.impl._gather_full = self.gather


def _errors(params, batches):
    """What a DDP rank raises for the misuses of item 7 (message texts), each
    guarded (`_guarded`); the one that can leave DDP's all-reduces unpaired
    (a parameter unused on one rank) last."""
    x, y = (torch.tensor(a) for a in fit_batches(batches)[0])
    mesh = distributed.make_mesh()
    batch = distributed.shard_batch((x, y), mesh)
    rank = dist.get_rank()

    def bypass(model, b):  # calls the plain module: no all-reduce
        return ((model.module(b[0]) - b[1]) ** 2).mean()

    def unused(model, b):  # rank 0 alone uses `extra`
        return ((model(b[0], rank == 0) - b[1]) ** 2).mean()

    def differ():  # every rank its own initial weights
        distributed.shard_state(MLP({k: v + rank for k, v in params.items()}), mesh)

    def unused_ok():
        # With find_unused_parameters=True the step runs and stays in sync.
        step = _new_step(params, True, loss_fn=unused, find_unused=True)
        for _ in range(2):
            step(batch)
        # A second TrainStep on the same DDP model reuses the comm hook.
        again = train.TrainStep(step.model, step.optimizer, unused)
        again(batch)
        return distributed.replicas_identical((step.model, step.optimizer))

    def foreign_hook():  # a DDP model with a comm hook of the user's
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = distributed.shard_state(MLP(params), mesh)
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        train.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), mse)

    return {
        "differ": _guarded(differ),
        "foreign_hook": _guarded(foreign_hook),
        "bypass": _guarded(lambda: _new_step(params, True, loss_fn=bypass)(batch)),
        "unused_ok": _guarded(unused_ok),
        "unused": _guarded(
            lambda: _new_step(params, True, loss_fn=unused, find_unused=False)(batch)
        ),
    }


def _raise_on_rank_1(params, batches):
    """fit in which rank 1's loss_fn raises at step 3: what each rank raises."""
    data = [(torch.tensor(x), torch.tensor(y)) for x, y in fit_batches(batches)]
    mesh = distributed.make_mesh()

    def loss_fn(model, b):
        if dist.get_rank() == 1 and step.steps_done == 3:
            raise ValueError("a bad batch on rank 1")
        return mse(model, b)

    step = _new_step(params, True, loss_fn=loss_fn)
    t0 = time.monotonic()
    try:
        train.fit(
            step,
            data[:6],
            log=None,
            batch_transform=lambda b: distributed.shard_batch(b, mesh),
        )
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None


@pytest.fixture(scope="module")
def fits_single():
    params, batches = problem()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return _fits(params, batches, folder, False)


def _same_records(got, want, what, params_tol="float32_trajectory"):
    from conftest import tolerance

    assert isinstance(got, dict), f"{what}: {got}"  # else what it raised
    for key in ("finite", "skipped_total", "loss_scale"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what} {key}")
    # The record's loss is the global mean (over both ranks' rows), as the
    # 1-process run records it (not rank 0's own mean).
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, err_msg=what)
    np.testing.assert_allclose(
        got["params"], want["params"], **tolerance(params_tol), err_msg=what
    )


@pytest.mark.parametrize("policy", ["skip", "rollback", "stop"])
def test_fit_under_ddp_takes_one_path_when_one_rank_has_nan(ranks, fits_single, policy):
    # Step 19 is non-finite in rank 1's rows only; fit locates it (locate_first
    # = 1), rolls back or stops: every rank does the same, and the run equals
    # the 1-process run.
    want = fits_single[policy]
    got = [r["fits"][policy] for r in ranks]
    if policy == "stop":
        assert got == [want, want] == [(19, 20)] * 2
        return
    for rank, out in enumerate(got):
        _same_records(out, want, f"{policy} rank {rank}")
    np.testing.assert_array_equal(got[0]["params"], got[1]["params"])
    key = "located" if policy == "skip" else "rolled"
    assert got[0][key] == got[1][key] == want[key] == [19, 32][: len(want[key])]


def test_fit_under_ddp_writes_on_rank_0_and_resumes_on_every_rank(ranks, fits_single):
    # Every rank gave the same checkpoint_dir and log_path: rank 0 wrote one
    # log of 40 records (the global losses) and the checkpoints; a resume on
    # new objects restores every rank at step 20 from rank 0's checkpoint.
    skip = fits_single["skip"]
    folder = os.path.join(ranks[0]["folder"], "fits")
    with open(os.path.join(folder, "skip.jsonl"), encoding="utf-8") as f:
        logged = [json.loads(line)["loss"] for line in f]
    np.testing.assert_allclose(logged, skip["loss"], rtol=1e-6)
    for rank, r in enumerate(ranks):
        got = r["fits"]["resume"]
        assert got["first"] == 20, rank
        rest = {k: v[20:] for k, v in skip.items() if k not in ("params", "located")}
        _same_records(got, {**rest, "params": skip["params"]}, f"resume rank {rank}")
    # A DDP checkpoint restores in one process (unwrapped names).
    step = _new_step(problem()[0], False)
    train.CheckpointManager(os.path.join(folder, "skip")).restore(step)
    np.testing.assert_array_equal(_params_of(step), ranks[0]["fits"]["skip"]["params"])


@pytest.mark.parametrize("section", ["fsdp", "fsdp_resume"])
def test_fsdp_checkpoints_hold_every_shard_across_placements(
    ranks, fits_single, section
):
    # FSDP2 resumed at step 20 from a DDP checkpoint ("fsdp") or from its own
    # sharded one ("fsdp_resume", new objects as after a kill) and ended on
    # the 1-process trajectory; its sharded checkpoints restore into one
    # process.
    skip = fits_single["skip"]
    for rank, r in enumerate(ranks):
        got = r["fits"][section]
        assert isinstance(got, dict) and got["first"] == 20, (rank, got)
        rest = {k: v[20:] for k, v in skip.items() if k not in ("params", "located")}
        _same_records(got, {**rest, "params": skip["params"]}, f"{section} {rank}")
    np.testing.assert_array_equal(
        ranks[0]["fits"][section]["params"], ranks[1]["fits"][section]["params"]
    )
    step = _new_step(problem()[0], False)
    folder = os.path.join(ranks[0]["folder"], "fits", section.replace("_resume", ""))
    if section == "fsdp_resume":
        folder = os.path.join(ranks[0]["folder"], "fits", "dcp")
    mgr = train.CheckpointManager(folder)
    assert os.path.isdir(mgr._path(40)) and mgr._path(40).endswith(".dcp")
    mgr.restore(step)
    np.testing.assert_array_equal(_params_of(step), ranks[0]["fits"][section]["params"])


def test_sharded_checkpoints_keep_every_shard_and_restore_anywhere(ranks):
    import torch.distributed.checkpoint as dcp

    got = [r["fits"]["fsdp_resume"] for r in ranks]
    # Each rank restored its own RNG stream (ranks seeded apart).
    for rank, r in enumerate(got):
        assert r["rng"][0] == r["rng"][1], rank
    assert got[0]["rng"][0] != got[1]["rng"][0]
    # Step 20: each rank wrote its own file, and w1 (8 x 16, sharded by
    # rows) is stored whole: the chunks of both ranks cover its 8 rows.
    path = os.path.join(ranks[0]["folder"], "fits", "dcp", "step_00000020.dcp")
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(path))
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, shape in [
        ("model/w1", (IN, HIDDEN)),
        ("optimizer/w1/exp_avg", (IN, HIDDEN)),
        ("model/b2", (OUT,)),
    ]:
        assert tuple(meta[key].size) == shape
        assert sum(c.sizes[0] for c in meta[key].chunks) == shape[0], key
    # save_checkpoint wrote a sharded directory that load_checkpoint reads.
    step = _new_step(problem()[0], False)
    train.load_checkpoint(os.path.join(ranks[0]["folder"], "fits", "saved.dcp"), step)
    np.testing.assert_array_equal(_params_of(step), got[0]["params"])
    # One process and DDP (2 ranks) restore the same step-20 state.
    step = _new_step(problem()[0], False)
    train.CheckpointManager(os.path.dirname(path)).restore(step, 20)
    for r in got:
        np.testing.assert_array_equal(_params_of(step), r["ddp"])
    assert step.steps_done == 20 and step.optimizer.state_dict()["state"]
    # Another model is refused, naming the leaf (not a raw shape error).
    other = {**problem()[0], "w1": np.zeros((IN, 4), np.float32)}
    other["w2"] = np.zeros((4, OUT), np.float32)
    with pytest.raises(
        ValueError, match=r"model/w1: checkpoint \(8, 16\) float32, target \(8, 4\)"
    ):
        train.load_checkpoint(path, _new_step(other, False))


def test_fsdp_rolls_back_to_sharded_checkpoints_as_one_process(ranks, fits_single):
    # The same rollbacks and trajectory as one process rolling back to its
    # in-memory snapshots (taken every 5 steps, as the checkpoints here).
    want = fits_single["rollback"]
    for rank, r in enumerate(ranks):
        got = r["fits"]["fsdp_rollback"]
        _same_records(got, want, f"fsdp rollback rank {rank}")
        assert got["rolled"] == want["rolled"] == [19, 32]


def test_sharded_checkpoints_refuse_a_directory_per_rank(ranks):
    for r in ranks:
        got = r["fits"]["fsdp_dirs"]
        assert "raised ValueError: under FSDP2 every rank writes its shards" in got


def test_a_damaged_sharded_checkpoint_is_refused_and_skipped(ranks, tmp_path):
    # A rank's file lost (or changed) is caught by the sha256 saved in the
    # header; restore warns and goes back to the checkpoint before it.
    src = os.path.join(ranks[0]["folder"], "fits", "dcp")
    for n in (20, 30):
        shutil.copytree(os.path.join(src, f"step_{n:08d}.dcp"),
                        tmp_path / f"step_{n:08d}.dcp")  # fmt: skip
    os.remove(tmp_path / "step_00000030.dcp" / "__1_0.distcp")
    step = _new_step(problem()[0], False)
    with pytest.raises(ValueError, match=r"files \['__1_0.distcp'\] are missing"):
        train.load_checkpoint(tmp_path / "step_00000030.dcp", step)
    with pytest.warns(RuntimeWarning, match="trying the checkpoint before it"):
        _, info = train.CheckpointManager(tmp_path).restore(step)
    assert info["step"] == 20 and step.steps_done == 20


@pytest.mark.parametrize("strategy", ["fp16", "fp16_fsdp"])
def test_fp16_ddp_and_fsdp_have_one_devices_headroom(ranks, fits_single, strategy):
    # Each replica backpropagates loss/2 and DDP (its comm hook) or FSDP2
    # (its reduce-scatter, divide factor 1) sums: the same skips and final
    # scale as one device (each replica's own mean would overflow at half
    # the scale and skip more).
    want = fits_single["fp16"]
    assert (~want["finite"]).sum() >= 2 and want["finite"].any()
    for rank, r in enumerate(ranks):
        got = r["fits"][strategy]
        assert got["final_scale"] == want["final_scale"], rank
        # float16 matmuls over 8 rows and over 16 round differently.
        _same_records(got, want, f"fp16 rank {rank}", "float16")


def test_misuses_under_ddp_are_clear_errors_on_every_rank(ranks):
    for r in ranks:
        e = r["errors"]
        assert "did not call the DistributedDataParallel model" in str(e["bypass"])
        assert "parameter(s) extra take part in the loss on some" in str(e["unused"])
        assert "find_unused_parameters=True" in e["unused"]
        assert e["unused_ok"] is True
        assert "ranks [1] hold other initial parameters" in str(e["differ"])
        assert "already has one: wrap the model without" in str(e["foreign_hook"])


def test_a_rank_that_raises_stops_the_others_naming_it(ranks):
    r0, r1 = (r["raises"] for r in ranks)
    assert r1[:2] == ("ValueError", "a bad batch on rank 1")
    assert r0[0] == "RuntimeError"
    assert "rank 1 failed at step 3: ValueError: a bad batch on rank 1" in r0[1]
    assert r0[2] < TIMEOUT_S // 2  # not the process group's timeout


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


def test_a_sharded_checkpoint_holds_the_parameters_outside_the_model(ranks):
    saved = ranks[0]["outside_params"][0]
    assert saved != 1.0  # trained
    assert all(r["outside_params"] == (saved, saved) for r in ranks)
    # One process reads the whole tensors alone.
    step, temp = _temperature_step()
    train.load_checkpoint(os.path.join(ranks[0]["folder"], "outside.dcp"), step)
    assert temp.item() == saved
