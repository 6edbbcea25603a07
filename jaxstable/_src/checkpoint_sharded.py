"""A checkpoint's leaves and their placement (private).

A pytree as ``{path: leaf}`` (flax's state dicts where flax knows the type,
JAX's flattening elsewhere), and rebuilt from one onto a target: its
structure and types, each array on the target leaf's devices and sharding
(under `jax.distributed`, each process filling in its own devices' slices
of the same global value).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import serialization

# What a checkpoint stores as a leaf; any other pytree node is walked into.
_VALUES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _key_name(entry: Any) -> str:
    """``DictKey('w')``, ``GetAttrKey('w')``, ``SequenceKey(0)``... as "w", "0"."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_str(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"  # "<root>": a checkpoint of one array


def _children(node: Any, path: tuple[str, ...]) -> tuple[list, Any]:
    """One level of JAX's flattening of `node`: ``([(key, child)], treedef)``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if len(pairs) == 1 and not pairs[0][0]:  # a JAX leaf that is no value
        raise TypeError(
            f"cannot checkpoint {path_str(path)}: a {type(node).__name__} (a "
            "checkpoint holds arrays, numbers, typed PRNG keys and the pytrees "
            "around them)"
        )
    return [(_key_name(p[0]), child) for p, child in pairs], treedef


def flat_leaves(tree: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{path: leaf}`` of any pytree, in the tree's order.

    flax's state dict where flax knows the type (it keeps a loss scale's
    period, which JAX's flattening leaves out), JAX's flattening elsewhere
    (an ``nnx.State``, a dataclass); None and empty containers hold no leaf.
    """
    tree = serialization.to_state_dict(tree)
    if tree is None:
        return {}
    if isinstance(tree, _VALUES):
        return {path: tree}
    if type(tree) is dict:
        items = [(str(k), v) for k, v in tree.items()]
    else:
        items = _children(tree, path)[0]
    out = {}
    for key, child in items:
        out.update(flat_leaves(child, (*path, key)))
    return out


def _place(new: Any, old: Any) -> Any:
    # Onto the target's device and sharding (a sharded target gets sharded
    # arrays). An uncommitted target leaf (a one-device state never
    # device_put) gets an uncommitted array: a committed one would make the
    # jitted step compile again on its first call after a restore (5.4 s
    # instead of 0.6 ms for the 4-leaf MLP of tests/test_distributed.py, on
    # a loaded 2-core CPU).
    if not old.sharding.is_fully_addressable:
        # Several processes (jax.distributed): each one read the same global
        # value and fills in its own devices' slices of it.
        host = np.asarray(new)
        return jax.make_array_from_callback(host.shape, old.sharding, lambda i: host[i])
    return jax.device_put(new, old.sharding if old.committed else None)


def _as_leaf(value: Any, like: Any) -> Any:
    """`value` (a numpy array, or a key array) as a leaf of `like`'s type."""
    if isinstance(like, jax.Array):
        return _place(value, like)
    if isinstance(like, np.ndarray):
        return np.array(value, like.dtype)
    if isinstance(like, np.generic):
        return like.dtype.type(np.asarray(value))
    return type(like)(np.asarray(value).item())  # a Python number


def rebuild(target: Any, values: dict, path: tuple[str, ...] = ()) -> Any:
    """`target`'s structure and types, its leaves taken from `values`."""
    tree = serialization.to_state_dict(target)
    return serialization.from_state_dict(target, _fill(tree, values, path))


def _fill(node: Any, values: dict, path: tuple[str, ...]) -> Any:
    # A flax state dict with the saved leaves in it; a node flax leaves as it
    # is (an nnx.State) is rebuilt here, flax's restore then keeps it.
    if node is None:
        return None
    if isinstance(node, _VALUES):
        return _as_leaf(values[path], node)
    if type(node) is dict:
        return {k: _fill(v, values, (*path, str(k))) for k, v in node.items()}
    pairs, treedef = _children(node, path)
    children = [rebuild(c, values, (*path, k)) for k, c in pairs]
    return jax.tree_util.tree_unflatten(treedef, children)
