"""Checkpoints of a `TrainState` (or any pytree) on orbax-checkpoint.

One checkpoint is a directory that orbax writes under a temporary name and
renames once complete, so a crash mid-save never leaves a partial
checkpoint under the final name. It holds two items: ``state`` (the leaves,
a list of numpy arrays) and ``meta`` (JSON: the format, the run's global
step, the data position, the metrics, `fit`'s NaN-policy state, the
optimizer state's and loss scale's type names, each leaf's path, shape and
dtype, and a sha256 over all of these and every leaf's bytes, so that a
flipped bit anywhere, the data position included, is caught rather than
loaded).

Any pytree JAX can flatten is saved: through flax's state dicts where flax
knows the type (a `TrainState`, a loss scale with its period, FrozenDict,
NamedTuples), through JAX's own flattening elsewhere (``nnx.State``,
dataclasses). A typed PRNG key is saved as its key data and implementation
name, a zero-size array as its shape and dtype (orbax refuses to write
one), None as no leaf; a restore rebuilds the target's own structure and
types.

Older checkpoints are still read: format 1 (``jaxstable-checkpoint-1``,
whose sha256 covered the arrays only) and flax-msgpack files. Their data
position is not under a checksum, and they hold no NaN-policy state.
"""

from __future__ import annotations

import os
from typing import Any

from flax import serialization

from _stablecore.checkpoint import fsync_tree as _fsync_tree
from jaxstable._src.checkpoint_checks import (
    check_loss_scale_name,
    check_loss_scale_type,
    check_optimizer_types,
    check_same_structure,
)
from jaxstable._src.checkpoint_format import (
    TYPES_KEY,
    Loaded,
    leaf_spec,
    migrate_v1,
    orbax_checkpoint,
    payload,
    read_checkpoint,
)
from jaxstable._src.checkpoint_sharded import flat_leaves, rebuild

__all__ = ["load_checkpoint", "save_checkpoint"]


def restore_onto(path: Any, loaded: Loaded, target: Any, snapshot=False) -> Any:
    """`loaded` (or its snapshot) restored onto `target`, after checking that
    both have the same types and leaves (refused with a ValueError)."""
    if loaded.raw is not None:
        check_loss_scale_type(path, loaded.raw, target)
    else:
        check_loss_scale_name(path, loaded.types, target)
    check_optimizer_types(path, loaded.types, target)
    values, specs = loaded.snapshot if snapshot else loaded[:2]
    expected = {p: leaf_spec(v) for p, v in flat_leaves(target).items()}
    check_same_structure(path, specs, expected)
    return rebuild(target, values)


def save_checkpoint(
    path: str | os.PathLike, state: Any, *, data_position: int | None = None
) -> None:
    """Writes `state` as an orbax checkpoint directory at `path` (replaced if present).

    Every leaf is saved (loss-scale fields and skip counters included), with
    the optimizer state's and loss scale's type names, so that
    `load_checkpoint` can refuse a checkpoint of another optimizer by name,
    and a sha256 of the leaves and the meta, so that a damaged one is
    refused too. Any pytree JAX can flatten is accepted (see the module
    docstring: ``nnx.State``, typed PRNG keys, zero-size arrays...). The
    write is atomic (orbax renames a complete temporary directory). For a
    run, `CheckpointManager` keeps several, by global step.

    Args:
      path: the checkpoint directory to write.
      state: a `TrainState` or any pytree of arrays, numbers and PRNG keys.
      data_position: batches of the run consumed so far (kept in the meta;
        `CheckpointManager.restore` returns it), or None.

    Raises:
      TypeError: a leaf that is not an array, a number or a PRNG key (named
        by its path).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import loss_scale, train
      >>> s = train.TrainState.create(params=jnp.ones(2), optimizer=optax.sgd(0.1),
      ...                             loss_scale=loss_scale.DynamicLossScale(period=7))
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> train.save_checkpoint(path, s)
      >>> blank = train.TrainState.create(params=jnp.zeros(2), optimizer=optax.sgd(0.1),
      ...                                 loss_scale=loss_scale.DynamicLossScale())
      >>> r = train.load_checkpoint(path, blank)
      >>> r.params.tolist(), r.loss_scale.period
      ([1.0, 1.0], 7)
    """
    ocp = orbax_checkpoint()
    args = payload(state, None, data_position)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(os.path.abspath(path), args=args, force=True)
    _fsync_tree(os.path.abspath(path))


def load_checkpoint(path: str | os.PathLike, target: Any) -> Any:
    """Reads a checkpoint written by `save_checkpoint` into the structure of `target`.

    Nothing is restored unless the checkpoint is intact (its sha256) and
    matches `target` exactly: the same loss-scale type, the same optimizer
    state types, and the same leaf paths with the same shapes and dtypes
    (params, optimizer state, model state, counters). flax alone would load
    a (2, 3) array into a (3, 3) target, or a float16 one into a float32
    target, without a word. Leaves are matched by their path (a dict's
    keys, a field's name), never by position. The result has `target`'s
    pytree structure and types (an ``nnx.State`` stays one, a typed PRNG key
    a typed key), its arrays on the devices and shardings of `target`'s. A
    file (not a directory) is read as the older flax-msgpack format,
    without a checksum.

    Args:
      path: the checkpoint directory (or an older msgpack file).
      target: a state of the same structure (supplies ``tx`` and types).

    Returns:
      The restored state.

    Raises:
      FileNotFoundError: no checkpoint at `path`.
      ValueError: naming the file and what is wrong: a damaged or truncated
        checkpoint; the checkpoint's loss scale is of another type than
        ``target.loss_scale`` (e.g. saved `DynamicLossScale`, target
        `NoOpLossScale`: restoring would drop or invent fields); its
        optimizer state types differ from those of ``target.tx`` (e.g.
        adam's into sgd's); or leaves are missing, extra, or of another shape
        or dtype (each listed with its path, saved vs expected).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax
      >>> from jaxstable import train
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> s = train.TrainState.create(params=jnp.full(2, 3.0), optimizer=optax.sgd(0.1))
      >>> train.save_checkpoint(path, s)
      >>> blank = s.replace(params=jnp.zeros(2))
      >>> train.load_checkpoint(path, blank).params.tolist()
      [3.0, 3.0]
      >>> try:
      ...     train.load_checkpoint(path, s.replace(params=jnp.zeros(3)))
      ... except ValueError as e:
      ...     print(str(e).splitlines()[1])
        params: checkpoint (2,) float32, target (3,) float32
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            raw = serialization.msgpack_restore(f.read())
        saved_types = raw.pop(TYPES_KEY, None) if isinstance(raw, dict) else None
        raw = migrate_v1(raw)
        values = flat_leaves(raw)
        specs = {p: leaf_spec(v) for p, v in values.items()}
        loaded = Loaded(values, specs, saved_types, {}, raw, None)
    else:
        loaded = read_checkpoint(path)
    return restore_onto(path, loaded, target)
