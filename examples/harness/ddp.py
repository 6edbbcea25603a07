"""``compare.py --devices N``, torch: one run in N DDP processes (gloo, this host).

:func:`torch_multiprocess` spawns the ranks; each runs
`torch_runner.run_torch` on its rows of the same global batches, with batch
norms and the task's loss made global (`examples.harness.collective`:
``global_mean``, ``gather_rows``, re-exported here) so that each run
computes the 1-device run. `examples.harness.run.train_and_evaluate` calls
it for a torch config with ``devices > 1``; a task opts in with
``Task.multi_device``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from examples.harness import torch_runner

# gather_rows, global_mean: what a task's loss calls, importable from here too
from examples.harness.collective import _COLLECTIVE
from examples.harness.collective import gather_rows as gather_rows
from examples.harness.collective import global_mean as global_mean
from examples.harness.devices import replica_check
from examples.harness.parts import TorchParts
from examples.harness.results import RunResult

# A torch rank waits this long in a collective for a peer that died or took
# another path before giving up (gloo's own default is 30 minutes).
COLLECTIVE_TIMEOUT_S = 300


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


def _ddp_parts(parts: TorchParts, mesh: Any) -> TorchParts:
    """The task's torch parts on a DDP rank: global batch norms, the loss run
    through `DistributedDataParallel`, this rank's rows of every batch.

    The harness keeps the plain module (its optimizer, copies and
    diagnostics see the usual parameter names) and hands the wrapper over
    as ``parts.ddp``: the stable `torchref.train.TrainStep` drives it, with
    the library's data-parallel step (each rank backpropagates its loss / N
    and the gradients are summed: one device's float16 headroom and skip
    decisions); the naive step runs the loss through it too (DDP's own
    average, as users do). The loss goes through the wrapper, whose
    backward all-reduces the gradients, whichever of the two it is given.
    """
    import torch

    from torchref import distributed

    inner = _global_batch_norms(parts.model)
    ddp = distributed.shard_state(inner, mesh, "data_parallel")

    def loss_fn(model, batch):
        # a copy of the model, or diagnostics.locate's op-by-op re-run (it
        # traces under a TorchDispatchMode; older versions used anomaly
        # mode): this rank alone, no collective
        ours = model is inner or model is ddp
        if not ours or torch.is_anomaly_enabled() or _is_traced():
            return parts.loss_fn(model, batch)
        _COLLECTIVE["on"] = True
        try:
            return parts.loss_fn(ddp, batch)
        finally:
            _COLLECTIVE["on"] = False

    def to_torch(batch):
        return distributed.shard_batch(parts.to_torch(batch), mesh)

    return dataclasses.replace(
        parts, model=inner, loss_fn=loss_fn, to_torch=to_torch, ddp=ddp
    )


def _is_traced() -> bool:
    """Whether a TorchDispatchMode (``diagnostics.locate``'s tracer) is on."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return is_in_torch_dispatch_mode()


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

            result = torch_runner.run_torch(
                task, config, weights, batches, heldout,
                progress=progress and rank == 0, wrap=wrap,
            )  # fmt: skip
            identical = distributed.replicas_identical(box["parts"].model)
            payload = (result if rank == 0 else None, result.metrics, identical)
            results.put((rank, True, payload))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def torch_multiprocess(task, config, weights, batches, heldout, progress=True,
                       log=None, timeout_s=None) -> RunResult:  # fmt: skip
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
