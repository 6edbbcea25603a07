"""``compare.py --devices N``: every run data parallel over N devices.

JAX: the run's state replicated on a mesh of N devices and every global
batch split over them (`jaxstable.distributed`); on a CPU machine the N
devices are forced host devices (:func:`force_host_devices`, called by
`examples.harness.main` before JAX starts). torch: N spawned DDP processes
(gloo, this host; `torchref.distributed`), each on its rows of the same
global batches (:func:`torch_multiprocess`), with batch norms and the
task's loss made global so that each run computes the 1-device run. Each
run gets a replica check (:func:`replica_check`), and the plan can be
compared with its 1-device run (:func:`one_device_agreement`,
:func:`devices_report`). `examples/harness.py` calls into this module; a
task opts in with ``multi_device = True``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

from examples import harness

# A torch rank waits this long in a collective for a peer that died or took
# another path before giving up (gloo's own default is 30 minutes).
COLLECTIVE_TIMEOUT_S = 300
# Set while a DDP rank runs the task's loss through the DDP wrapper: only
# then do `global_mean` and the batch norms of `_global_batch_norms` talk to
# the other ranks. A re-run on this rank alone (`diagnostics.locate`, the
# naive run's copy of the model) stays local, so it cannot leave a peer
# waiting in a collective it never joins.
_COLLECTIVE = {"on": False}


def force_host_devices(n: int) -> None:
    """Makes JAX see `n` devices: ``n`` forced host CPU devices on a CPU box.

    Adds ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS``, which
    XLA reads once, when JAX starts its CPU backend: `main` calls this right
    after parsing the command line, before any JAX computation (no re-exec).
    With GPUs (or TPUs) JAX's devices are the accelerators, the flag does not
    touch them, and the mesh takes the first `n` real devices.

    Raises:
      RuntimeError: JAX has fewer than `n` devices (its backend had already
        started in this process with fewer, or there are fewer accelerators).

    Example:
        >>> force_host_devices(1)  # one device: nothing to do
    """
    if n <= 1:
        return
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
    # Each forced device runs its part of a step on a thread of the CPU
    # client's pool, as many threads as cores unless PJRT_NPROC says
    # otherwise; the parts meet in every all-reduce, so with fewer threads
    # than devices one part may never start (4 devices on 2 cores: XLA
    # aborted after 40 s, jaxstable/tests/test_distributed.py).
    os.environ.setdefault("PJRT_NPROC", str(max(2 * n, os.cpu_count() or 1)))
    import jax

    have = jax.device_count()
    if have < n:
        raise RuntimeError(
            f"--devices {n} needs {n} JAX devices, but JAX has {have} "
            f"({jax.default_backend()}): XLA_FLAGS is read once per process, "
            "so run compare.py in a fresh process (or on a machine with that "
            "many accelerators)"
        )


def jax_distribute(
    config: harness.BaseConfig, state: Any, batches: list
) -> tuple[Any, list]:
    """``(state, batches)`` placed data parallel on ``config.devices`` devices.

    The state (a `TrainState` or the naive step's dict) is replicated, each
    GLOBAL batch split along its rows (`jaxstable.distributed.shard_state`
    / `shard_batch`): the jitted step then computes the 1-device run's
    losses, batch statistics and gradients as one SPMD program. One device:
    both returned as they are.

    Example:
        >>> state, batches = jax_distribute(harness.BaseConfig(), {"w": 1.0}, [])
        >>> state, batches
        ({'w': 1.0}, [])
    """
    if config.devices == 1:
        return state, batches
    from jaxstable import distributed

    mesh = distributed.make_mesh(config.devices)
    state = distributed.shard_state(state, mesh, "data_parallel")
    return state, [distributed.shard_batch(b, mesh) for b in batches]


def replica_check(devices: int, identical: bool, histories: list) -> dict[str, Any]:
    """``replicas`` of a `examples.harness.RunResult`: did every replica decide alike?

    Args:
      devices: the device (JAX) or process (torch) count.
      identical: every copy of the final model is bitwise equal
        (`replicas_identical` of the framework's ``distributed`` module).
      histories: the `fit` records of every rank (JAX: one, the program is
        one SPMD program).

    Returns:
      ``{"devices", "replicas_identical", "ranks_agree"}``; ``ranks_agree``:
      every rank recorded the same ``finite``, ``skipped_total`` and
      ``loss_scale`` at every step (the skip decisions).

    Example:
        >>> h = [{"finite": True, "skipped_total": 0, "loss_scale": 2.0}]
        >>> replica_check(2, True, [h, h])["ranks_agree"]
        True
    """
    keys = ("finite", "skipped_total", "loss_scale")
    decisions = [[tuple(r[k] for k in keys) for r in h] for h in histories]
    return {
        "devices": devices,
        "replicas_identical": bool(identical),
        "ranks_agree": all(d == decisions[0] for d in decisions),
    }


def global_mean(local_mean: Any, local_count: Any) -> Any:
    """Under DDP, the mean over the GLOBAL batch from this rank's mean.

    A task's torch loss that averages over a varying number of items (pixels
    not ignored, boxes) calls this with its local mean and item count. DDP
    averages the ranks' gradients, which is the global batch's gradient only
    if every rank holds as many items; this rescales the local loss by
    ``count * world / global count`` for the gradient, and its VALUE is the
    global mean (the same on every rank, as the 1-process run records it):
    one all-reduce of two floats. In one process, or outside a DDP forward
    (see ``_COLLECTIVE``), it returns ``local_mean`` itself.

    Example:
        >>> import torch
        >>> float(global_mean(torch.tensor(2.0), 3))
        2.0
    """
    if not _COLLECTIVE["on"]:
        return local_mean
    import torch
    import torch.distributed as dist

    count = torch.as_tensor(local_count, dtype=torch.float32)
    totals = torch.stack([local_mean.detach().float() * count, count])
    dist.all_reduce(totals)
    factor = count * dist.get_world_size() / totals[1]
    share = local_mean * factor.to(local_mean.dtype)
    value = (totals[0] / totals[1]).to(local_mean.dtype)
    return share + (value - share).detach()  # value: global; gradient: share


_SUM_OVER_RANKS: dict[str, Any] = {}


def _sum_over_ranks(t: Any) -> Any:
    """``t`` summed over the ranks, differentiable: the gradient of a rank's
    input is the sum of every rank's gradient of the output (every rank's
    loss depends on every rank's rows through it). torch's own
    ``torch.distributed.nn.functional.all_reduce`` does this but is
    deprecated in torch 2.13. The `torch.autograd.Function` is built on
    first use (the harness imports torch lazily)."""
    if "apply" not in _SUM_OVER_RANKS:
        import torch
        import torch.distributed as dist

        class SumOverRanks(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                x = x.clone()
                dist.all_reduce(x)
                return x

            @staticmethod
            def backward(ctx, grad):
                grad = grad.clone()
                dist.all_reduce(grad)
                return grad

        _SUM_OVER_RANKS["apply"] = SumOverRanks.apply
    return _SUM_OVER_RANKS["apply"](t)


class _GlobalBatchNorm:
    """Mixin of `_global_batch_norms`: training-mode statistics over the
    rows of every rank (torch's ``SyncBatchNorm`` refuses CPU tensors)."""

    def forward(self, x):
        if not (self.training and _COLLECTIVE["on"]):
            return super().forward(x)
        import torch
        import torch.distributed as dist

        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        x32 = x.float()  # float32 statistics, as F.batch_norm keeps them
        count = torch.tensor(float(x.numel() // x.shape[1]))
        dist.all_reduce(count)
        mean = _sum_over_ranks(x32.sum(dims)) / count
        centred = x32 - mean.view(shape)
        var = _sum_over_ranks((centred * centred).sum(dims)) / count  # biased
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum
                m = 1.0 / float(self.num_batches_tracked) if m is None else m
                unbiased = var * count / max(float(count) - 1, 1.0)
                for buf, new in (
                    (self.running_mean, mean),
                    (self.running_var, unbiased),
                ):
                    buf.mul_(1 - m).add_(new.to(buf.dtype), alpha=m)
        return y.to(x.dtype)


def _global_batch_norms(model: Any) -> Any:
    """``model`` with every batch norm computing DDP-global statistics.

    The 1-device run normalises over the whole batch; a DDP rank would use
    its own rows only (different numbers, and torch's ``SyncBatchNorm`` runs
    on GPUs only). Each batch norm's class is swapped in place for a
    subclass (same parameters, buffers, dtype and state_dict keys).
    """
    import torch

    for module in model.modules():
        cls = type(module)
        bn = torch.nn.modules.batchnorm._BatchNorm
        if isinstance(module, bn) and not isinstance(module, _GlobalBatchNorm):
            module.__class__ = type(
                f"Global{cls.__name__}", (_GlobalBatchNorm, cls), {}
            )
    return model


def _ddp_parts(parts: harness.TorchParts, mesh: Any) -> harness.TorchParts:
    """The task's torch parts on a DDP rank: global batch norms, the loss run
    through `DistributedDataParallel`, this rank's rows of every batch.

    The harness keeps the plain module (its optimizer, clipping, copies and
    diagnostics see the usual parameter names); only the loss goes through
    the DDP wrapper, whose backward all-reduces (averages) the gradients.
    """
    import torch

    from torchref import distributed

    inner = _global_batch_norms(parts.model)
    ddp = distributed.shard_state(inner, mesh, "data_parallel")

    def loss_fn(model, batch):
        # a copy of the model, or diagnostics.locate's op-by-op re-run (in
        # anomaly mode): this rank alone, no collective
        if model is not inner or torch.is_anomaly_enabled():
            return parts.loss_fn(model, batch)
        _COLLECTIVE["on"] = True
        try:
            return parts.loss_fn(ddp, batch)
        finally:
            _COLLECTIVE["on"] = False

    def to_torch(batch):
        return distributed.shard_batch(parts.to_torch(batch), mesh)

    return dataclasses.replace(parts, model=inner, loss_fn=loss_fn, to_torch=to_torch)


def _die_with_parent() -> None:
    # Linux: the kernel kills this rank if compare.py dies (even by SIGKILL),
    # instead of leaving it waiting in a collective for COLLECTIVE_TIMEOUT_S.
    import ctypes
    import signal
    import sys

    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _torch_rank(rank, world, store_dir, results, task, config, weights, batches,
                heldout, progress):  # fmt: skip
    """One DDP process of `torch_multiprocess` (spawned): its records and
    replica check, and rank 0's RunResult, into ``results``."""
    import datetime
    import traceback

    _die_with_parent()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
    try:
        import torch
        import torch.distributed as dist

        from torchref import distributed

        torch.set_num_threads(config.torch_threads)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(store_dir, "store"), world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            mesh = distributed.make_mesh()
            box = {}

            def wrap(parts):
                box["parts"] = _ddp_parts(parts, mesh)
                return box["parts"]

            result = harness._run_torch(
                task, config, weights, batches, heldout, progress and rank == 0,
                None, wrap,
            )  # fmt: skip
            identical = distributed.replicas_identical(box["parts"].model)
            payload = (result if rank == 0 else None, result.metrics, identical)
            results.put((rank, True, payload))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def torch_multiprocess(task, config, weights, batches, heldout, progress=True,
                       log=None, timeout_s=None) -> harness.RunResult:  # fmt: skip
    """One torch run in ``config.devices`` DDP processes (gloo, this host).

    Spawns the ranks (`torch.multiprocessing`, rendezvous in a `FileStore`
    of a temporary folder: no port), each trains on its rows of the same
    global batches; rank 0's RunResult is returned (its records hold the
    global loss, see `global_mean`) with ``replicas`` from every rank. The
    ranks never outlive the call: joined, else terminated, else killed, on
    success, error, timeout or Ctrl-C.

    Args:
      timeout_s: seconds for the whole run (default ``300 + 10 * steps``).

    Raises:
      RuntimeError: a rank failed (its traceback) or died.
      TimeoutError: the ranks did not finish in time.
    """
    import tempfile

    import torch.multiprocessing as mp

    world = config.devices
    timeout_s = 300 + 10 * config.steps if timeout_s is None else timeout_s
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="compare-ddp-") as store_dir:
        args = (world, store_dir, results, task, config, weights, batches, heldout)
        procs = [
            ctx.Process(target=_torch_rank, args=(r, *args, progress), daemon=True)
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            out = _collect(procs, results, time.monotonic() + timeout_s, timeout_s)
        finally:
            _stop(procs)
    result = out[0][0]
    identical = all(o[2] for o in out)
    result.replicas = replica_check(world, identical, [o[1] for o in out])
    if log is not None:
        for record in result.metrics:
            log(record)
    return result


def _collect(procs, results, deadline, timeout_s) -> list:
    import queue

    out = {}
    while len(out) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(procs)} torch processes did not finish in {timeout_s} s; "
                f"results from ranks {sorted(out)}"
            )
        try:
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                and r not in out
            ]  # fmt: skip
            if dead:
                raise RuntimeError(
                    f"torch rank(s) {dead} died (exit codes "
                    f"{[procs[r].exitcode for r in dead]}) without a result"
                ) from None
            continue
        if not ok:
            raise RuntimeError(f"torch rank {rank} failed:\n{payload}")
        out[rank] = payload
    return [out[r] for r in range(len(procs))]


def _stop(procs) -> None:
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
    for p in procs:
        for end in (p.terminate, p.kill):
            if p.is_alive():
                end()
                p.join(timeout=5)


def one_device_agreement(
    runs: list[harness.RunResult], refs: list[harness.RunResult]
) -> list[dict]:
    """Each N-device run against the same run on one device.

    Per run: ``max_rel_loss_diff`` (max |loss_N - loss_1| / |loss_1| over
    the steps where both losses are finite; NaN when the step counts differ,
    a loss is non-finite in one run only, or a loss is zero),
    ``same_decisions`` (``finite``, ``skipped_total``
    and ``loss_scale`` equal at every step) and both held-out headline
    scores.

    Example:
        >>> rec = lambda l: {"loss": l, "finite": True, "skipped_total": 0,
        ...                  "loss_scale": 1.0}
        >>> mk = lambda l: harness.RunResult(
        ...     "jax", harness.BaseConfig(), [rec(l)], None, l, 0, {"miou": 0.5}, 1.0)
        >>> a = one_device_agreement([mk(1.0001)], [mk(1.0)])[0]
        >>> round(a["max_rel_loss_diff"], 6), a["same_decisions"]
        (0.0001, True)
    """
    keys = ("finite", "skipped_total", "loss_scale")
    rows = []
    for r, ref in zip(runs, refs, strict=True):
        diff = _rel_loss_diff(
            [m["loss"] for m in r.metrics], [m["loss"] for m in ref.metrics]
        )
        same = [tuple(m[k] for k in keys) for m in r.metrics] == [
            tuple(m[k] for k in keys) for m in ref.metrics
        ]
        key = next(iter(r.scores), None)
        rows.append(
            {
                "run": r.name,
                "max_rel_loss_diff": harness.json_float(diff),
                "same_decisions": same,
                "score": None if key is None else harness.json_float(r.scores[key]),
                "score_1_device": None
                if key is None
                else harness.json_float(ref.scores[key]),
            }
        )
    return rows


def _rel_loss_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or [math.isfinite(x) for x in a] != [
        math.isfinite(y) for y in b
    ]:
        return math.nan
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(y)]
    if any(y == 0 for _, y in pairs):
        return math.nan
    return max((abs(x - y) / abs(y) for x, y in pairs), default=0.0)


def devices_report(summary: dict[str, Any]) -> list[str]:
    """The "N devices" section of ``report.md`` (nothing on one device).

    Example:
        >>> devices_report({"config": {"devices": 1}, "runs": []})
        []
        >>> devices_report({"config": {"devices": 2}, "runs": []})[0]
        '## 2 devices'
    """
    n = summary.get("config", {}).get("devices", 1)  # a summary may omit config
    if n <= 1:
        return []
    lines = [
        f"## {n} devices",
        "",
        f"Every run is data parallel over {n} devices: JAX on a mesh of {n} "
        f"devices (forced host CPU devices on a CPU machine), torch in {n} DDP "
        "processes (gloo); each replica trains on its rows of the same global batches. "
        "A replica check per run: every rank took the same skip decisions "
        "(finite, skipped_total, loss scale at every step) and every copy of "
        "the final model is bitwise identical.",
        "",
        "| run | ranks agree | replicas identical |",
        "|---|---|---|",
    ]
    for r in summary["runs"]:
        rep_ = r.get("replicas", {})
        lines.append(
            f"| {r['framework']} {r['precision']} {r['mode']} | "
            f"{rep_.get('ranks_agree')} | {rep_.get('replicas_identical')} |"
        )
    agreement = summary.get("one_device")
    if agreement:
        lines += [
            "",
            "Agreement with 1 device (the same runs on one device / one "
            "process, `--one-device-reference`):",
            "",
            "| run | max relative loss difference | same skip decisions | "
            "held-out score | on 1 device |",
            "|---|---|---|---|---|",
        ]
        for a in agreement:
            lines.append(
                f"| {a['run']} | {harness.fmt(a['max_rel_loss_diff'], '.2e')} | "
                f"{a['same_decisions']} | {harness.fmt(a['score'], '.3f')} | "
                f"{harness.fmt(a['score_1_device'], '.3f')} |"
            )
    return [*lines, ""]
