"""Data-parallel and fully sharded training with torch.distributed.

The mirror of `jaxstable.distributed`, on torch's own engines: one process
per device (``torchrun`` or `torch.multiprocessing`), a process group, and

* ``"data_parallel"``: `DistributedDataParallel`; its all-reduce averages the
  gradients during ``backward``, so every rank's GradScaler sees the same
  global gradient (a NaN in one rank's slice reaches every rank) and takes
  the same skip decision and loss-scale update.
* ``"fsdp"``: FSDP2 ``fully_shard``; gradients are reduce-scattered, so each
  rank holds only its shard of them and a check of the local shard could
  disagree between ranks. torch's GradScaler already acts on the global
  flag there: its ``unscale_`` on DTensor gradients reduces ``found_inf``
  over the mesh (a max all-reduce of one float per step, done by DTensor's
  handler of ``_amp_foreach_non_finite_check_and_unscale_``). (FSDP1 needs
  `ShardedGradScaler` for the same.)

`torchref.train.TrainStep` runs unchanged on the wrapped model (under both it
backpropagates each rank's loss / N and has the gradients summed, DDP by a
comm hook, FSDP2 by a divide factor of 1: one device's float16 headroom,
see `_Replicas`); under FSDP2 build it with ``check_update=False``: its
update check copies the state with ``torch._foreach_copy_``, which DTensor
does not implement in torch 2.13.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "DATA_AXIS",
    "STRATEGIES",
    "global_mean",
    "make_mesh",
    "replicas_identical",
    "shard_batch",
    "shard_state",
]

DATA_AXIS = "data"
STRATEGIES = ("data_parallel", "fsdp")


def make_mesh(
    num_devices: int | None = None,
    *,
    device_type: str = "cpu",
    axis_name: str = DATA_AXIS,
) -> DeviceMesh:
    """A 1-D `DeviceMesh` over the ranks of the default process group.

    The process group must be initialised (`torch.distributed.
    init_process_group`, done for you by ``torchrun`` scripts that call it);
    one rank is one device.

    Args:
      num_devices: must equal the world size (None: the world size); kept
        for the signature of `jaxstable.distributed.make_mesh`.
      device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
      axis_name: the mesh dimension name.

    Returns:
      ``init_device_mesh(device_type, (world,), mesh_dim_names=(axis_name,))``.

    Raises:
      RuntimeError: no process group is initialised.
      ValueError: ``num_devices`` differs from the world size.

    Example:
      >>> import torch.distributed as dist
      >>> from torchref import distributed
      >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
      ...                         world_size=1)
      >>> mesh = distributed.make_mesh(1)
      >>> mesh.mesh_dim_names, mesh.size()
      (('data',), 1)
      >>> dist.destroy_process_group()
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh needs an initialised process group: call "
            "torch.distributed.init_process_group first (torchrun sets "
            "RANK/WORLD_SIZE/MASTER_ADDR for it)"
        )
    world = dist.get_world_size()
    if num_devices is not None and (
        isinstance(num_devices, bool) or num_devices != world
    ):
        raise ValueError(
            f"num_devices must be None or the world size {world} (one device "
            f"per process), got {num_devices!r}"
        )
    return init_device_mesh(device_type, (world,), mesh_dim_names=(axis_name,))


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            "mesh must be a 1-D torch DeviceMesh (see make_mesh), got "
            f"{type(mesh).__name__}"
        )


def shard_state(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    strategy: str = "data_parallel",
    *,
    find_unused_parameters: bool = False,
) -> torch.nn.Module:
    """Wraps ``model`` for ``strategy``: DDP or FSDP2 ``fully_shard``.

    Every rank must build the same model (same seed or weights): this is
    checked (one all-gather of a sha256 of the parameters and buffers) and a
    mismatch is a ValueError naming the ranks, as DDP would silently take
    rank 0's values and FSDP2 would stitch the ranks' different shards into
    one model. Build the optimizer AFTER this call for ``"fsdp"`` (the
    parameters become sharded DTensors); DDP keeps the parameter objects.

    Args:
      model: the `nn.Module`.
      mesh: a 1-D mesh (`make_mesh`).
      strategy: ``"data_parallel"`` or ``"fsdp"``.
      find_unused_parameters: DDP's option of that name, for a model whose
        forward leaves some parameters unused on some ranks (a `TrainStep`
        refuses such a step without it, naming the parameters).

    Returns:
      ``DistributedDataParallel(model, device_mesh=mesh)`` or the model
      itself, sharded in place by ``fully_shard(model, mesh=mesh)``.

    Example:
      >>> import torch, torch.distributed as dist
      >>> from torchref import distributed
      >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
      ...                         world_size=1)
      >>> model = distributed.shard_state(torch.nn.Linear(2, 1),
      ...                                 distributed.make_mesh())
      >>> type(model).__name__
      'DistributedDataParallel'
      >>> dist.destroy_process_group()
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(find_unused_parameters, bool):
        raise TypeError(
            "find_unused_parameters must be True or False, got "
            f"{find_unused_parameters!r}"
        )
    _check_mesh(mesh)
    every = _digests(model)
    differ = [] if every is None else [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        raise ValueError(
            f"ranks {differ} hold other initial parameters or buffers than rank 0 "
            "(a sha256 of every tensor of the model differs): build the model "
            "from the same seed or weights on every rank before shard_state"
        )
    if strategy == "data_parallel":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_mesh=mesh, find_unused_parameters=find_unused_parameters
        )
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)


def shard_batch(batch: Any, mesh: DeviceMesh) -> Any:
    """This rank's slice of every leaf of a GLOBAL batch (leading axis).

    Rank ``r`` of ``n`` gets rows ``[r*b/n, (r+1)*b/n)``, the rows
    `jaxstable.distributed.shard_batch` puts on device ``r``: with a loss
    that is a mean over the rows, DDP's gradient average is the gradient of
    the whole batch.

    Args:
      batch: a pytree (tuples, lists, dicts) of tensors, each with a leading
        axis whose size is a multiple of the mesh size.
      mesh: a 1-D mesh (`make_mesh`).

    Returns:
      The same pytree of slices (views).

    Raises:
      ValueError: a leaf is not a tensor with such a leading axis (names it).

    Example:
      >>> import torch, torch.distributed as dist
      >>> from torchref import distributed
      >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
      ...                         world_size=1)
      >>> b = distributed.shard_batch({"x": torch.ones(4, 3)},
      ...                             distributed.make_mesh())
      >>> tuple(b["x"].shape)
      (4, 3)
      >>> dist.destroy_process_group()
    """
    _check_mesh(mesh)
    n, rank = mesh.size(), mesh.get_local_rank()
    leaves, spec = tree_flatten(batch)
    out = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or len(leaf) % n:
            shape = tuple(getattr(leaf, "shape", ()))
            raise ValueError(
                f"batch leaf {i} (in flattening order) has shape {shape}: its "
                f"leading (batch) axis must be a multiple of the {n} ranks"
            )
        rows = len(leaf) // n
        out.append(leaf[rank * rows : (rank + 1) * rows])
    return tree_unflatten(out, spec)


def global_mean(
    values: torch.Tensor, mask: Any = None, *, group: Any = None
) -> torch.Tensor:
    """The mean of ``values`` over the GLOBAL batch, weighted by ``mask``.

    ``sum(values * mask) / sum(mask)`` over every element of every rank:
    what one process computes over the whole batch, also when the ranks
    hold different numbers of counted elements (``ignore_index`` labels,
    padding). DDP averages the ranks' gradients, which is the global
    batch's gradient only when every rank counts as many elements; with
    uneven counts the mean of the ranks' means is off (measured: 1.797
    instead of 1.283 at step 0, params 0.144 off after training).

    With an initialised process group of more than one rank, the
    ``(sum, count)`` pair is all-reduced (one all-reduce of two floats; a
    collective: every rank of ``group`` must call it, e.g. inside the DDP
    forward). The VALUE returned is the global mean on every rank; its
    GRADIENT is ``world * d sum_r / count``, this rank's share times the
    world size, so DDP's average of the gradients is one process's gradient
    of the global mean. `jaxstable.distributed.global_mean` (with
    ``axis_name`` under `jax.shard_map`) is the same. Without a process
    group (or one rank) it is the plain masked mean.

    Nothing counted anywhere (``count == 0``): 0.0 with a zero gradient,
    as `torchref.losses.softmax_cross_entropy` returns for an all-ignored
    batch (torch's mean gives NaN, 0/0).

    Args:
      values: per-element losses, e.g. ``softmax_cross_entropy(...,
        reduction="none")`` (0 where the label is ignored).
      mask: None (every element counts 1), or booleans or non-negative
        weights broadcastable to ``values``.
      group: the process group (None: the default one).

    Returns:
      A float32 scalar tensor.

    Example:
      >>> import torch
      >>> from torchref import distributed, losses
      >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.0]])
      >>> labels = torch.tensor([0, -1, -1, 1])
      >>> per = losses.softmax_cross_entropy(logits, labels, dim=1,
      ...                                    ignore_index=-1, reduction="none")
      >>> loss = distributed.global_mean(per, labels != -1)
      >>> bool(torch.isclose(loss, losses.softmax_cross_entropy(
      ...     logits[[0, 3]], labels[[0, 3]], dim=1)))
      True
    """
    values = torch.as_tensor(values).float()
    if mask is None:
        weights = torch.ones_like(values)
    else:
        weights = torch.as_tensor(mask, device=values.device).float()
        weights = weights.expand_as(values)
    # where, not values * weights: a masked-out NaN/inf (a padded row) must
    # not reach the sum (inf * 0 = NaN).
    total = torch.where(weights != 0, values * weights, 0.0).sum()
    count = weights.sum()
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        safe = torch.where(count > 0, count, 1.0)
        return torch.where(count > 0, total / safe, 0.0)
    totals = torch.stack([total.detach(), count.detach()])
    dist.all_reduce(totals, group=group)
    safe = torch.where(totals[1] > 0, totals[1], 1.0)
    value = torch.where(totals[1] > 0, totals[0] / safe, 0.0)
    share = torch.where(totals[1] > 0, world * total / safe, 0.0)
    return share + (value - share).detach()  # value: global; gradient: share


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for s in obj.state.values() for t in s.values() if torch.is_tensor(t)]
    if isinstance(obj, torch.amp.GradScaler):
        return [obj._scale] if obj.is_enabled() and obj._scale is not None else []
    leaves, _ = tree_flatten(obj)
    if len(leaves) == 1 and leaves[0] is obj:  # a leaf of none of these kinds
        return []
    return [t for leaf in leaves for t in _tensors(leaf)]


def _local_replicas(t: torch.Tensor) -> torch.Tensor | None:
    """The data of ``t`` that every rank should hold identically, or None."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t
    # A DTensor: only a fully replicated one has the same data everywhere.
    if all(p.is_replicate() for p in placements):
        return t.to_local()
    return None


def _digests(obj: Any) -> list[str] | None:
    """Every rank's sha256 of the replicated tensors of ``obj`` (a
    collective), or None with one rank or no process group."""
    digest = hashlib.sha256()
    for t in _tensors(obj):
        local = _local_replicas(t)
        if local is not None:
            data = local.detach().cpu().contiguous().reshape(-1)
            digest.update(data.view(torch.uint8).numpy().tobytes())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest.hexdigest())
    return every


def replicas_identical(obj: Any) -> bool:
    """Whether every rank holds bitwise the same replicated tensors.

    Collects the tensors of ``obj`` (a module's parameters and buffers, an
    optimizer's state, a GradScaler's scale, or a pytree of those and of
    tensors), skips sharded DTensors (their shards differ by design), hashes
    the bytes (NaN payloads included) and all-gathers the digests. A
    collective: every rank must call it.

    Args:
      obj: see above.

    Returns:
      True when all ranks' digests are equal (always True with one rank or
      no process group).

    Example:
      >>> import torch
      >>> from torchref import distributed
      >>> distributed.replicas_identical(torch.nn.Linear(2, 1))
      True
    """
    every = _digests(obj)
    return every is None or all(d == every[0] for d in every)


# ------------------------------------------------- used by TrainStep and fit
def _ddp(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    ddp = torch.nn.parallel.DistributedDataParallel
    return model if isinstance(model, ddp) else None


def is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP wrapper holds (the model itself otherwise)."""
    ddp = _ddp(model)
    return model if ddp is None else ddp.module


def _plain_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with the keys of the unwrapped module."""
    return inner_module(model).state_dict()


def load_plain_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Loads a state dict saved with or without DDP's ``module.`` prefix."""
    if state and all(k.startswith("module.") for k in state):
        state = type(state)((k[len("module.") :], v) for k, v in state.items())
    inner_module(model).load_state_dict(state)


def _sum_hook(group, bucket):  # unannotated: DDP checks the annotations
    """A DDP comm hook: the ranks' gradients SUMMED (DDP's own hook averages).

    `TrainStep` backpropagates ``scale / N`` times each replica's loss (see
    `_Replicas.share`): the sum is then ``scale`` times the global gradient.
    """
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _Replicas:
    """What `TrainStep` does differently on a DDP or FSDP2 model.

    * float16 headroom (DDP and FSDP2): each replica's backward of its own
      mean is N times its share of the global gradient (its rows are 1/N of
      the batch but its mean divides by B/N), so under DDP's averaging (or
      FSDP2's averaging reduce-scatter) every replica overflows at 1/N of
      the scale one device overflows at. The step backpropagates ``loss /
      N`` instead and the gradients are summed, not averaged: DDP through
      `_sum_hook`, FSDP2 through its own gradient divide factor set to 1
      with sum-only collectives (`_sum_fsdp_gradients`). Every row's
      gradient is then the one a single device computes at the same scale,
      bit for bit with N a power of 2, and the skip decisions and the final
      scale are one device's.
    * `agree`: one all-reduce per step of the ranks' losses (the record's
      loss is the global mean, as one device reports it; a non-finite loss
      on one rank makes every rank skip) and of which parameters got a
      gradient (a parameter used on one rank only is an error that names it,
      instead of silently unsynchronised updates).
    * a loss_fn that bypasses the DDP wrapper (``model.module(x)``): its
      gradients would never be all-reduced; the step raises.
    """

    def __init__(self, model: torch.nn.Module, ddp: Any) -> None:
        self.model, self.ddp = model, ddp
        self.group = ddp.process_group if ddp is not None else None
        self.size = dist.get_world_size(self.group)
        self.forward_calls = 0
        inner = inner_module(model)
        self.names = [n for n, p in inner.named_parameters() if p.requires_grad]
        self.params = [p for p in inner.parameters() if p.requires_grad]
        if ddp is None:  # FSDP2
            _sum_fsdp_gradients(model)
            return
        hooks = [h for h, _ in ddp._comm_hooks]
        if hooks and hooks != [_sum_hook]:  # [_sum_hook]: a TrainStep before
            raise ValueError(
                "TrainStep registers its own DDP communication hook (a sum of "
                "the gradients, for float16 headroom: see torchref.distributed)"
                "; this DistributedDataParallel already has one: wrap the "
                "model without a comm hook"
            )
        if not hooks:
            ddp.register_comm_hook(self.group, _sum_hook)
        ddp.register_forward_pre_hook(self._count)

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Replicas | None:
        ddp = _ddp(model)
        if ddp is None and not is_fsdp(model):
            return None
        if not dist.is_initialized():
            return None
        return cls(model, ddp)

    def _count(self, *_: Any) -> None:
        self.forward_calls += 1

    def share(
        self, share: torch.Tensor, loss: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(what this replica backpropagates, the global loss)``.

        One all-reduce (SUM, float64) before the backward, so that no rank
        is left inside DDP's gradient all-reduces: the ranks' losses (the
        global mean over equal shards, as one device reports it; a non-finite
        loss on one rank is non-finite on all, so all skip) and, under DDP
        without ``find_unused_parameters``, which parameters this loss uses
        (a walk of its autograd graph: a parameter used on some ranks only
        would leave DDP's all-reduces unpaired; a RuntimeError names it on
        every rank instead). The share is ``share / N`` (see the class
        docstring).
        """
        if self.ddp is not None and self.forward_calls == 0:
            raise RuntimeError(
                "loss_fn did not call the DistributedDataParallel model it was "
                "given (e.g. it called model.module(x)): its gradients would not "
                "be all-reduced and the ranks' parameters and loss scales would "
                "drift apart. Call model(x) in loss_fn"
            )
        flags: list[float] = []
        if self.ddp is not None and not self.ddp.find_unused_parameters:
            used = _graph_leaves(share)
            flags = [float(id(p) in used) for p in self.params]
        vec = torch.tensor([float(loss.detach()), *flags], dtype=torch.float64)
        dist.all_reduce(vec, group=self.group)
        counts = zip(self.names if flags else [], vec[1:].tolist(), strict=True)
        partial = [n for n, c in counts if 0 < c < self.size]
        if partial:
            raise RuntimeError(
                f"step {step}: parameter(s) {', '.join(partial)} take part in the "
                "loss on some ranks only: DDP's gradient all-reduces would not "
                "pair up. Wrap the model with torchref.distributed.shard_state("
                "model, mesh, find_unused_parameters=True), or use every "
                "parameter on every rank"
            )
        total = (vec[0] / self.size).to(loss.dtype)
        # The value: the global loss; the gradient: this rank's share's.
        return share / self.size, total


def _sum_fsdp_gradients(model: torch.nn.Module) -> None:
    """Makes every FSDP2 module of ``model`` SUM its reduce-scattered
    gradients (FSDP2 divides the sum by the world size by default).

    `TrainStep` backpropagates ``scale / N`` times each replica's loss (see
    `_Replicas`): the sum is then ``scale`` times the global gradient, as
    under DDP's `_sum_hook`. ``set_gradient_divide_factor(1.0)`` alone
    would reduce with ``PREMUL_SUM``, which gloo lacks;
    ``set_force_sum_reduction_for_comms(True)`` makes it a plain SUM with
    no division (a factor of 1). A divide factor the user set already is
    refused: the two would compound.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        factors = {g.gradient_divide_factor for g in groups} - {None, 1.0}
        if factors:
            raise ValueError(
                "TrainStep sets FSDP2's gradient divide factor to 1 (a sum of "
                "the gradients, for float16 headroom: see torchref.distributed)"
                f"; this model's {type(module).__name__} already has "
                f"{sorted(factors)}: shard it without set_gradient_divide_factor"
            )
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def _graph_leaves(t: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) ``t``'s autograd graph reaches."""
    seen, todo, leaves = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            leaves.add(id(var))
        todo.extend(n for n, _ in node.next_functions)
    return leaves


def _gather_full(tree: Any) -> Any:
    """``tree`` with every sharded DTensor gathered into a plain tensor (a
    collective per DTensor, in the tree's order: every rank calls it).

    Used by `TrainStep.state_dict` under FSDP2, so that the checkpoint rank 0
    writes holds every shard (not rank 0's alone) with the shapes one
    process has: it restores in any placement.
    """
    if isinstance(tree, dict):
        return type(tree)((k, _gather_full(v)) for k, v in tree.items())
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return type(tree)(_gather_full(v) for v in tree)
    if hasattr(tree, "full_tensor"):
        return tree.full_tensor()
    return tree


def _shard_like(saved: Any, like: Any) -> Any:
    """``saved`` (full tensors) placed as the DTensors of ``like`` are (the
    keys both hold; the rest as saved)."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(saved, dict) and isinstance(like, dict):
        return type(saved)(
            (k, _shard_like(v, like[k]) if k in like else v) for k, v in saved.items()
        )
    if hasattr(like, "placements") and torch.is_tensor(saved):
        if hasattr(saved, "placements"):
            saved = saved.full_tensor()
        # src_data_rank=None: every rank holds the full tensor and keeps its
        # own part (no collective: ranks restore one after the other).
        return distribute_tensor(
            saved.to(like.dtype),
            like.device_mesh,
            list(like.placements),
            src_data_rank=None,
        )
    return saved


def _fsdp_optimizer_like(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """The DTensor placements each saved optimizer-state tensor takes: its
    parameter's when it has the parameter's shape (Adam's moments), else
    none (Adam's step count)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    like = {}
    for i, state in saved.get("state", {}).items():
        p = params[i] if isinstance(i, int) and i < len(params) else None
        if p is None or not hasattr(p, "placements"):
            continue
        like[i] = {
            k: p
            for k, v in state.items()
            if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)
        }
    return {"state": like}
