"""Carry a running training job from PyTorch to JAX and back, mid-run.

A torchref run is a `torchref.train.TrainStep`: the model, a torch optimizer,
a GradScaler and the step's counters. A jaxstable run is a
`jaxstable.train.TrainState`. This module moves everything that decides the
next steps from one to the other:

==========================  ===============================================
torch                       JAX (``TrainState``)
==========================  ===============================================
model parameters            ``params``
model buffers (BN stats)    ``model_state``
Adam/AdamW ``exp_avg``,     the ``ScaleByAdamState`` found inside
``exp_avg_sq``, ``step``    ``opt_state`` (``mu``, ``nu``, ``count``)
SGD ``momentum_buffer``     the ``TraceState`` inside ``opt_state``
GradScaler ``scale``,       `jaxstable.loss_scale.DynamicLossScale`
``_growth_tracker``,        (``loss_scale``, ``counter``, ``period``,
``growth_interval``,        ``factor``; ``min_loss_scale``, ``hysteresis``
``growth_factor``           and the non-finite run from torchref's
                            ``DynamicGradScaler``)
``TrainStep.skip_state``    the `SkipNonFiniteState` counters, and
                            ``skipped_total``
``TrainStep.steps_done``    ``step``
==========================  ===============================================

The optax state is located generically: the single ``ScaleByAdamState`` or
``TraceState`` anywhere in the chain (inside `stable_optimizer`'s skip and
clip, `optax.chain`, `optax.inject_hyperparams`...). Hyperparameters are not
state: build the other side's optimizer with the same ones (optax's
``adamw(weight_decay=...)`` is torch's AdamW's ``weight_decay``; torch's
defaults differ from optax's). What a run does NOT carry: RNG states and the
data position (the caller resumes its data at ``steps_done``), torch-only
buffers (``num_batches_tracked``: the target keeps its own), LR schedules
(torch keeps them outside the optimizer; ``optax.inject_hyperparams``'s own
count is left as the target's), and, into a plain `torch.amp.GradScaler`,
``min_loss_scale`` (GradScaler has no floor; torchref's ``DynamicGradScaler``
keeps it).

Parameters are matched by name, through a :class:`Layout` (where a torch key
lives in the JAX pytrees and how its array is laid out; optimizer moments
have their parameter's shape and take the same layout). The segmentation
U-Net's layout is `examples.segmentation.carry_over.unet_layout`.

Bad input never converts silently: a torch optimizer or loss scale of a kind
the target cannot hold, a parameter without a counterpart, a shape mismatch
or GradScaler settings jaxstable cannot follow raise an error naming them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from jaxstable import loss_scale as jls
from jaxstable import transforms
from jaxstable.train import TrainState

__all__ = [
    "Layout",
    "load_torch_run_state",
    "torch_run_from_train_state",
    "torch_run_state",
    "train_state_from_torch",
]

_MOMENT_STATES = (optax.ScaleByAdamState, optax.TraceState)
_SKIP_FIELDS = (
    "skipped_total",
    "consecutive",
    "last_finite",
    "exceeded",
    "last_grads_finite",
    "non_finite_updates",
)


def _identity(key: str, array: np.ndarray) -> np.ndarray:
    del key
    return array


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each torch ``state_dict`` entry lives in the JAX pytrees.

    Attributes:
      path: ``path(key)`` -> the JAX leaf's path as a tuple of dict keys and
        list indices (``("encoders", 0, "bn1", "scale")``; an NNX
        ``Variable``'s ``.value`` is not part of it), or None for a
        torch-only entry that is not carried.
      to_jax: ``to_jax(key, array)`` -> the array in the JAX layout (a float32
        numpy array in, the same out; e.g. a Linear weight transposed).
      to_torch: the inverse of ``to_jax``.

    Example:
      >>> names = {"weight": "kernel", "bias": "bias"}
      >>> lin = Layout(
      ...     path=lambda key: ("fc", names[key.split(".")[1]]),
      ...     to_jax=lambda key, a: a.T if key.endswith("weight") else a,
      ...     to_torch=lambda key, a: a.T if key.endswith("weight") else a)
      >>> lin.path("fc.weight"), lin.to_jax("fc.weight", np.zeros((3, 2))).shape
      (('fc', 'kernel'), (2, 3))
    """

    path: Callable[[str], tuple | None]
    to_jax: Callable[[str, np.ndarray], np.ndarray] = _identity
    to_torch: Callable[[str, np.ndarray], np.ndarray] = _identity


# ----------------------------------------------------------------- torch run
def _param_names(step: Any) -> list[str]:
    """Parameter names in the optimizer's order (its state is keyed by it)."""
    names = {id(p): n for n, p in step.model.named_parameters()}
    return [names[id(p)] for g in step.optimizer.param_groups for p in g["params"]]


def torch_run_state(step: Any) -> dict[str, Any]:
    """A snapshot (deep copy) of a torchref run, in plain state dicts.

    Args:
      step: a `torchref.train.TrainStep`.

    Returns:
      ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(),
      "scaler": scaler.state_dict() ({} without an enabled scaler),
      "skip_state": the step's counters (a dict), "steps_done": int,
      "param_names": the parameters' names in the optimizer's order}``.

    Example:
      >>> from torchref.train import TrainStep
      >>> model = torch.nn.Linear(2, 1)
      >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                  lambda m, b: m(b).sum())
      >>> run = torch_run_state(step)
      >>> run["param_names"], run["steps_done"], run["scaler"]
      (['weight', 'bias'], 0, {})
    """
    scaler = step.scaler
    enabled = scaler is not None and scaler.is_enabled()
    return copy.deepcopy(
        {
            "model": step.model.state_dict(),
            "optimizer": step.optimizer.state_dict(),
            "scaler": scaler.state_dict() if enabled else {},
            "skip_state": dataclasses.asdict(step.skip_state),
            "steps_done": int(step.steps_done),
            "param_names": _param_names(step),
        }
    )


def load_torch_run_state(step: Any, run: Mapping[str, Any]) -> None:
    """Loads a :func:`torch_run_state` dict into a `TrainStep`, in place.

    Args:
      step: a `torchref.train.TrainStep` built like the run's (same model
        architecture, optimizer type and hyperparameters, loss scale kind).
      run: from :func:`torch_run_state` or :func:`torch_run_from_train_state`.

    Raises:
      ValueError: the parameter names or order differ, or one side has an
        enabled GradScaler and the other not.

    Example:
      >>> from torchref.train import TrainStep
      >>> model = torch.nn.Linear(2, 1)
      >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
      ...                  lambda m, b: m(b).sum())
      >>> run = torch_run_state(step)
      >>> run["steps_done"] = 7
      >>> load_torch_run_state(step, run)
      >>> step.steps_done
      7
    """
    names = _param_names(step)
    if list(run["param_names"]) != names:
        raise ValueError(
            f"the run's parameters {list(run['param_names'])} are not this "
            f"step's {names} (same names in the same optimizer order)"
        )
    scaler = step.scaler
    enabled = scaler is not None and scaler.is_enabled()
    if bool(run["scaler"]) != enabled:
        have = "an enabled GradScaler" if enabled else "no enabled GradScaler"
        saved = "a GradScaler state" if run["scaler"] else "none"
        raise ValueError(f"the run holds {saved}, but this step has {have}")
    step.model.load_state_dict(run["model"])
    step.optimizer.load_state_dict(run["optimizer"])
    if enabled:
        scaler.load_state_dict(run["scaler"])
    step.skip_state = type(step.skip_state)(**run["skip_state"])
    step.steps_done = int(run["steps_done"])


# ------------------------------------------------------ pytrees <-> tensors
def _plain_path(keypath: tuple) -> tuple:
    out = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":  # an NNX Variable's array
                out.append(k.name)
        else:
            out.append(getattr(k, "key", k))
    return tuple(out)


def _float32(t: Any) -> np.ndarray:
    # A copy: `.numpy()` shares the tensor's memory, and torch updates its
    # parameters and moments in place (see examples/common/convert.py).
    return t.detach().cpu().to(torch.float32).numpy().copy()


def _tree_from_torch(tensors: Mapping[str, Any], template: Any, layout, what: str):
    """A pytree shaped like `template`, each leaf from its torch entry."""
    flat = {}
    for key, t in tensors.items():
        path = layout.path(key)
        if path is not None:
            flat[path] = (key, layout.to_jax(key, _float32(t)))

    def fill(keypath, leaf):
        path = _plain_path(keypath)
        if path not in flat:
            raise KeyError(f"{what}: the JAX leaf {path} is set by no torch entry")
        key, array = flat.pop(path)
        if array.shape != tuple(leaf.shape):
            raise ValueError(
                f"{what}: torch {key!r} converts to shape {array.shape}, the JAX "
                f"leaf {path} has {tuple(leaf.shape)}"
            )
        return jnp.asarray(array, leaf.dtype)

    tree = jax.tree_util.tree_map_with_path(fill, template)
    if flat:
        keys = sorted(key for key, _ in flat.values())
        raise KeyError(f"{what}: torch entries with no JAX leaf: {keys}")
    return tree


def _tensors_from_tree(tree: Any, keys, like: Mapping[str, Any], layout, what: str):
    """{key: tensor} for `keys` (dtype of `like[key]`), read from `tree`."""
    leaves = {
        _plain_path(kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    out = {}
    for key in keys:
        path = layout.path(key)
        if path is None:
            continue
        if path not in leaves:
            raise KeyError(f"{what}: torch {key!r} maps to {path}, no JAX leaf there")
        array = layout.to_torch(key, np.asarray(leaves[path], np.float32))
        if array.shape != tuple(like[key].shape):
            raise ValueError(
                f"{what}: the JAX leaf {path} converts to shape {array.shape}, "
                f"torch {key!r} has {tuple(like[key].shape)}"
            )
        # np.array copies: a JAX array's numpy view is read-only.
        out[key] = torch.from_numpy(np.array(array, order="C")).to(like[key].dtype)
    return out


# ------------------------------------------------------------- optimizer
def _torch_kind(groups: list[dict[str, Any]]) -> str:
    """ "adam" (Adam, AdamW), "sgd_momentum" or "sgd", refusing what the optax
    counterpart cannot continue."""
    kinds = set()
    for g in groups:
        if g.get("maximize"):
            raise ValueError("maximize=True has no optax counterpart here")
        if "betas" in g:
            if g.get("amsgrad"):
                raise ValueError(
                    "amsgrad=True is not supported (its max_exp_avg_sq has no "
                    "place in optax's ScaleByAdamState)"
                )
            kinds.add("adam")
        elif "momentum" in g:
            if g["momentum"] and g.get("dampening", 0):
                raise ValueError(
                    f"SGD dampening={g['dampening']} is not supported: optax's "
                    "trace has none (torch's default 0 is)"
                )
            kinds.add("sgd_momentum" if g["momentum"] else "sgd")
        else:
            raise ValueError(
                "supported torch optimizers: Adam, AdamW, SGD; got param group "
                f"keys {sorted(k for k in g if k != 'params')}"
            )
    if len(kinds) != 1:
        raise ValueError(f"param groups of different kinds: {sorted(kinds)}")
    return kinds.pop()


_NODE_OF = {"adam": optax.ScaleByAdamState, "sgd_momentum": optax.TraceState}


def _moment_node(opt_state: Any, kind: str):
    """The one ScaleByAdamState / TraceState of `opt_state` (None for "sgd")."""
    nodes = [
        n
        for n in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, _MOMENT_STATES)
        )
        if isinstance(n, _MOMENT_STATES)
    ]
    want = _NODE_OF.get(kind)
    found = [type(n).__name__ for n in nodes]
    if want is None and not nodes:
        return None
    if want is None or len(nodes) != 1 or not isinstance(nodes[0], want):
        need = "none" if want is None else f"one {want.__name__}"
        raise ValueError(
            f"the torch optimizer is {kind!r}, so the optax state needs {need}; "
            f"it holds {found or 'none'} (build the optax optimizer of the same kind)"
        )
    return nodes[0]


def _replace_node(tree: Any, cls: type, new: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: new if isinstance(x, cls) else x,
        tree,
        is_leaf=lambda x: isinstance(x, cls),
    )


def _per_param(optimizer: Mapping[str, Any], names: list[str]) -> dict[str, dict]:
    indices = [i for g in optimizer["param_groups"] for i in g["params"]]
    state = optimizer["state"]
    per = {n: state.get(i, {}) for i, n in zip(indices, names, strict=True)}
    empty = [n for n, s in per.items() if not s]
    if empty and len(empty) != len(per):
        raise ValueError(f"torch optimizer state is missing for {empty}")
    return {} if empty else per


def _opt_state_from_torch(optimizer, names, opt_state, layout):
    kind = _torch_kind(optimizer["param_groups"])
    node = _moment_node(opt_state, kind)
    per = _per_param(optimizer, names)
    if node is None or not per:  # plain SGD, or no step taken yet: fresh state
        return opt_state
    if kind == "sgd_momentum":
        buf = {n: s["momentum_buffer"] for n, s in per.items()}
        trace = _tree_from_torch(buf, node.trace, layout, "momentum_buffer")
        return _replace_node(opt_state, optax.TraceState, node._replace(trace=trace))
    steps = {float(s["step"]) for s in per.values()}
    if len(steps) != 1:
        raise ValueError(f"Adam step counts differ between parameters: {steps}")
    new = node._replace(
        count=jnp.asarray(int(steps.pop()), node.count.dtype),
        mu=_tree_from_torch(
            {n: s["exp_avg"] for n, s in per.items()}, node.mu, layout, "exp_avg"
        ),
        nu=_tree_from_torch(
            {n: s["exp_avg_sq"] for n, s in per.items()}, node.nu, layout, "exp_avg_sq"
        ),
    )
    return _replace_node(opt_state, optax.ScaleByAdamState, new)


def _optimizer_from_jax(opt_state, like_optimizer, names, like_params, layout):
    kind = _torch_kind(like_optimizer["param_groups"])
    node = _moment_node(opt_state, kind)
    indices = [i for g in like_optimizer["param_groups"] for i in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    if kind == "adam":
        mu = _tensors_from_tree(node.mu, names, like_params, layout, "mu")
        nu = _tensors_from_tree(node.nu, names, like_params, layout, "nu")
        count = float(node.count)  # torch keeps the step as a float32 tensor
        for i, n in zip(indices, names, strict=True):
            state[i] = {"step": torch.tensor(count), "exp_avg": mu[n]}
            state[i]["exp_avg_sq"] = nu[n]
    elif kind == "sgd_momentum":
        # A zero buffer continues exactly like torch's first step (buf = g).
        buf = _tensors_from_tree(node.trace, names, like_params, layout, "trace")
        state = {
            i: {"momentum_buffer": buf[n]} for i, n in zip(indices, names, strict=True)
        }
    groups = copy.deepcopy(like_optimizer["param_groups"])
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------ loss scale
def _loss_scale_from_torch(scaler: Mapping[str, Any], target: Any) -> Any:
    kind = type(target).__name__
    if isinstance(target, jls.NoOpLossScale):
        if scaler:
            raise ValueError("the torch run has a GradScaler; the target NoOpLossScale")
        return target
    if not scaler:
        raise ValueError(f"the torch run has no enabled GradScaler; the target {kind}")
    if isinstance(target, jls.StaticLossScale):
        return jls.StaticLossScale(scaler["scale"])
    if not isinstance(target, jls.DynamicLossScale):
        raise TypeError(f"unsupported target loss scale {kind}")
    growth, backoff = float(scaler["growth_factor"]), float(scaler["backoff_factor"])
    if backoff != 1.0 / growth:
        raise ValueError(
            f"GradScaler backoff_factor={backoff} is not 1/growth_factor="
            f"{1.0 / growth}: DynamicLossScale backs off by 1/factor"
        )
    return jls.DynamicLossScale(
        loss_scale=scaler["scale"],
        counter=int(scaler["_growth_tracker"]),
        period=int(scaler["growth_interval"]),
        factor=growth,
        # torchref's DynamicGradScaler keeps these; a plain GradScaler has no
        # floor and no hysteresis: the target's are kept.
        min_loss_scale=scaler.get("min_loss_scale", target.min_loss_scale),
        hysteresis=int(scaler.get("hysteresis", target.hysteresis)),
        non_finite_counter=int(scaler.get("_nonfinite_run", 0)),
    )


def _scaler_from_jax(ls: Any, like: Mapping[str, Any]) -> dict[str, Any]:
    kind = type(ls).__name__
    if isinstance(ls, jls.NoOpLossScale):
        if like:
            raise ValueError(
                "the JAX run has NoOpLossScale; the torch step a GradScaler"
            )
        return {}
    if not like:
        raise ValueError(
            f"the JAX run has {kind}; the torch step no enabled GradScaler"
        )
    if isinstance(ls, jls.StaticLossScale):
        if float(ls.loss_scale) != float(like["scale"]):
            raise ValueError(
                f"StaticLossScale({float(ls.loss_scale)}): build the torch "
                "StaticLossScale with the same loss_scale (a static scaler "
                f"resets to its own, {float(like['scale'])})"
            )
        return dict(like)
    if not isinstance(ls, jls.DynamicLossScale):
        raise TypeError(f"unsupported loss scale {kind}")
    plain = "hysteresis" not in like  # a torch.amp.GradScaler, no subclass
    if plain and (int(ls.hysteresis) != 1 or int(ls.non_finite_counter) != 0):
        raise ValueError(
            f"DynamicLossScale(hysteresis={ls.hysteresis}) needs torchref's "
            "DynamicGradScaler (torchref.loss_scale.DynamicLossScale(hysteresis=...)"
            ".make_scaler()); a plain GradScaler backs off on every non-finite step"
        )
    factor = float(ls.factor)
    return {
        "scale": float(ls.loss_scale),
        "growth_factor": factor,
        "backoff_factor": 1.0 / factor,  # as torchref's make_scaler builds it
        "growth_interval": int(ls.period),
        "_growth_tracker": int(ls.counter),
        "min_loss_scale": float(ls.min_loss_scale),
        "hysteresis": int(ls.hysteresis),
        "_nonfinite_run": int(ls.non_finite_counter),
    }


# ------------------------------------------------------------- counters
def _with_skip_counters(opt_state: Any, counters: Mapping[str, Any]) -> Any:
    cls = transforms.SkipNonFiniteState
    skip = transforms.find_skip_state(opt_state)
    if skip is None:
        return opt_state
    new = skip._replace(
        **{
            k: jnp.asarray(counters[k], jnp.asarray(getattr(skip, k)).dtype)
            for k in _SKIP_FIELDS
        }
    )
    return _replace_node(opt_state, cls, new)


def _skip_counters(state: TrainState, like: Mapping[str, Any]) -> dict[str, Any]:
    skip = transforms.find_skip_state(state.opt_state)
    if skip is None:  # a step without a skip transform counts only the total
        return {**like, "skipped_total": int(state.skipped_total)}
    return {
        k: (bool if isinstance(like[k], bool) else int)(getattr(skip, k))
        for k in _SKIP_FIELDS
    }


# ------------------------------------------------------------- the two ways
def train_state_from_torch(
    run: Mapping[str, Any], target: TrainState, layout: Layout
) -> TrainState:
    """A jaxstable `TrainState` that continues a torch run.

    Args:
      run: a :func:`torch_run_state` dict.
      target: a `TrainState` built the way the JAX run will train (its ``tx``
        of the torch optimizer's kind and hyperparameters, its loss scale
        type, params and model state of the model's shapes): its values are
        replaced, its structure and dtypes kept.
      layout: the model's :class:`Layout`.

    Returns:
      ``target`` with params, model state, optimizer moments and step count,
      skip counters, loss scale, ``step`` and ``skipped_total`` of the run.

    Raises:
      ValueError / KeyError / TypeError: naming what does not match (an
        optimizer or loss scale of another kind, a missing or extra
        parameter, a shape).

    Example:
      >>> import optax
      >>> from jaxstable import loss_scale, train, transforms
      >>> from torchref import loss_scale as tls
      >>> from torchref.train import TrainStep
      >>> _ = torch.manual_seed(0)
      >>> model = torch.nn.Linear(2, 1)
      >>> step = TrainStep(model, torch.optim.Adam(model.parameters(), lr=0.1),
      ...                  lambda m, b: m(b).sum(),
      ...                  scaler=tls.DynamicLossScale(period=3))
      >>> _ = step(torch.ones(4, 2))
      >>> names = {"weight": "kernel", "bias": "bias"}
      >>> lin = Layout(path=lambda key: (names[key],),
      ...              to_jax=lambda key, a: a.T if key == "weight" else a,
      ...              to_torch=lambda key, a: a.T if key == "weight" else a)
      >>> target = train.TrainState.create(
      ...     params={"kernel": jnp.zeros((2, 1)), "bias": jnp.zeros(1)},
      ...     optimizer=transforms.stable_optimizer(optax.adam(0.1)),
      ...     loss_scale=loss_scale.DynamicLossScale(period=3))
      >>> state = train_state_from_torch(torch_run_state(step), target, lin)
      >>> int(state.step), int(state.loss_scale.counter), int(state.opt_state
      ...     .inner_state[0].count)
      (1, 1, 1)
      >>> state.params["bias"].tolist() == model.bias.tolist()
      True
    """
    names = list(run["param_names"])
    model = run["model"]
    params = _tree_from_torch(
        {n: model[n] for n in names}, target.params, layout, "params"
    )
    buffers = {k: v for k, v in model.items() if k not in set(names)}
    if target.model_state is None:
        carried = [k for k in buffers if layout.path(k) is not None]
        if carried:
            raise ValueError(f"the target has no model_state for buffers {carried}")
        model_state = None
    else:
        model_state = _tree_from_torch(
            buffers, target.model_state, layout, "model_state"
        )
    opt_state = _opt_state_from_torch(run["optimizer"], names, target.opt_state, layout)
    opt_state = _with_skip_counters(opt_state, run["skip_state"])
    return target.replace(
        step=jnp.asarray(run["steps_done"], jnp.int32),
        params=params,
        opt_state=opt_state,
        loss_scale=_loss_scale_from_torch(run["scaler"], target.loss_scale),
        model_state=model_state,
        skipped_total=jnp.asarray(run["skip_state"]["skipped_total"], jnp.int32),
    )


def torch_run_from_train_state(
    state: TrainState, layout: Layout, like: Mapping[str, Any]
) -> dict[str, Any]:
    """A torch run (a :func:`torch_run_state` dict) that continues a JAX run.

    Args:
      state: the jaxstable `TrainState`.
      layout: the model's :class:`Layout`.
      like: :func:`torch_run_state` of the `TrainStep` that will continue
        (its keys, dtypes, optimizer param groups and scaler settings are
        kept; its values replaced). Entries the layout does not carry
        (``num_batches_tracked``) keep their values.

    Returns:
      A dict for :func:`load_torch_run_state`.

    Raises:
      ValueError / KeyError / TypeError: naming what does not match.

    Example:
      >>> import optax
      >>> from jaxstable import train, transforms
      >>> from torchref.train import TrainStep
      >>> state = train.TrainState.create(
      ...     params={"kernel": jnp.ones((2, 1)), "bias": jnp.zeros(1)},
      ...     optimizer=transforms.stable_optimizer(optax.sgd(0.1, momentum=0.9)))
      >>> model = torch.nn.Linear(2, 1)
      >>> step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1,
      ...                  momentum=0.9), lambda m, b: m(b).sum())
      >>> names = {"weight": "kernel", "bias": "bias"}
      >>> lin = Layout(path=lambda key: (names[key],),
      ...              to_jax=lambda key, a: a.T if key == "weight" else a,
      ...              to_torch=lambda key, a: a.T if key == "weight" else a)
      >>> run = torch_run_from_train_state(state, lin, torch_run_state(step))
      >>> load_torch_run_state(step, run)
      >>> model.weight.tolist(), sorted(step.optimizer.state_dict()["state"][0])
      ([[1.0, 1.0]], ['momentum_buffer'])
    """
    names = list(like["param_names"])
    like_model = like["model"]
    model = _tensors_from_tree(state.params, names, like_model, layout, "params")
    buffers = [k for k in like_model if k not in model and layout.path(k) is not None]
    if buffers and state.model_state is None:
        raise ValueError(f"the JAX run has no model_state for buffers {buffers}")
    if buffers:
        model.update(
            _tensors_from_tree(
                state.model_state, buffers, like_model, layout, "model_state"
            )
        )
    for key, value in like_model.items():
        model.setdefault(key, value.clone())  # torch-only, kept
    return {
        "model": {k: model[k] for k in like_model},
        "optimizer": _optimizer_from_jax(
            state.opt_state, like["optimizer"], names, like_model, layout
        ),
        "scaler": _scaler_from_jax(state.loss_scale, like["scaler"]),
        "skip_state": _skip_counters(state, like["skip_state"]),
        "steps_done": int(state.step),
        "param_names": names,
    }
