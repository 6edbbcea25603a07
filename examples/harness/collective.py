"""What a task's torch loss calls to be global under DDP (`examples.harness.ddp`).

:func:`global_mean` turns a rank's mean over a varying count into its share of
the global mean; :func:`gather_rows` hands the loss the whole batch's outputs
and targets. Both are identities in one process and outside a DDP forward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gather_rows", "global_mean"]

# Set while a DDP rank runs the task's loss through the DDP wrapper: only
# then do `global_mean` and the batch norms of `_global_batch_norms` talk to
# the other ranks. A re-run on this rank alone (`diagnostics.locate`, the
# naive run's copy of the model) stays local, so it cannot leave a peer
# waiting in a collective it never joins.
_COLLECTIVE = {"on": False}


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


def gather_rows(tree: Any) -> Any:
    """Under DDP, every tensor of ``tree`` with every rank's rows: the GLOBAL batch.

    A task's torch loss that is not a plain mean over its rows calls this on
    the model's outputs and the batch before computing it, so that the loss
    is the 1-process loss of the whole batch on every rank: InfoNCE sees
    every rank's embeddings as negatives (open_clip's ``gather_with_grad``
    with ``local_loss=False``), DBNet's hard-negative mining ranks the
    negatives of the whole batch, detection divides by the global box count.
    Each tensor (leaves of dicts, tuples and lists; anything else is kept)
    is concatenated along its leading axis in rank order, the rows
    `torchref.distributed.shard_batch` gave each rank, and comes back in
    its dtype (floats cross the wire as float32, float64 as itself, integers
    and bools as int64: gloo lacks some low-precision types; every round
    trip is exact). A 0-d or complex tensor is refused (ValueError).

    The gradient: every rank computes the same loss from the same gathered
    rows, so every rank holds the same gradient of them, and the gradient a
    rank's own rows get is ``world`` times its slice of it (what the sum
    over ranks of open_clip's gather would give, without the collective);
    DDP's average over the ranks then makes each parameter's gradient the
    1-process one. (In float16 that ``world`` times can overflow where one
    process does not: the loss scale's headroom under data parallelism,
    issue 26 item 5, is the step's business, not this gather's.) In one
    process, or outside a DDP forward (see ``_COLLECTIVE``), ``tree`` is
    returned as it is.

    Example:
        >>> import torch
        >>> out = gather_rows({"x": torch.ones(2, 3), "n": 4})
        >>> tuple(out["x"].shape), out["n"]
        ((2, 3), 4)
    """
    if not _COLLECTIVE["on"]:
        return tree
    import torch

    def gather(x):
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.is_complex():
                raise ValueError(
                    f"gather_rows: got a {'0-d' if x.dim() == 0 else 'complex'} "
                    "tensor; it gathers real or integer per-row tensors (leading "
                    "axis: this rank's rows)"
                )
            return _gather_function()(x)
        if isinstance(x, dict):
            return {k: gather(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(gather(v) for v in x)
        return x

    return gather(tree)


_GATHER: dict[str, Any] = {}


def _gather_function() -> Any:
    """`gather_rows`'s differentiable gather of one tensor (built on first
    use: the harness imports torch lazily)."""
    if "apply" not in _GATHER:
        import torch
        import torch.distributed as dist

        def wire_dtype(dtype):
            # gloo lacks bfloat16: float32 for the narrower floats (an exact
            # round trip), int64 for integers and bools
            if dtype == torch.float64:
                return dtype
            return torch.float32 if dtype.is_floating_point else torch.int64

        class GatherRows(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                world, rank = dist.get_world_size(), dist.get_rank()
                ctx.world, ctx.start, ctx.rows = world, rank * x.shape[0], x.shape[0]
                wire = x.detach().to(wire_dtype(x.dtype)).contiguous()
                parts = [torch.empty_like(wire) for _ in range(world)]
                dist.all_gather(parts, wire)
                return torch.cat(parts).to(x.dtype)

            @staticmethod
            def backward(ctx, grad):
                return grad[ctx.start : ctx.start + ctx.rows] * ctx.world

        _GATHER["apply"] = GatherRows.apply
    return _GATHER["apply"]
