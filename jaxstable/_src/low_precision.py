"""AdamW with low-precision moments and parameters that keep their updates.

`low_precision_adamw` stores Adam's moments in a chosen dtype (float32,
bfloat16, or float16 / float8 with a per-tensor scale), computes the update
in float32, and rounds it into the parameters' own dtype by round-to-nearest,
stochastic rounding (a key in the state) or Kahan summation (a compensation
buffer in the parameters' dtype). Its state also says, per step, how much of
the update rounding lost (`RoundingStats`). Everything is a select: no
``conditional``, no host transfer. `torchref.transforms.low_precision_adamw`
computes the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _stablecore.low_precision import (
    DTYPE_LIMITS,
    SCALED_DTYPES,
    RoundingStats,
    StallMonitor,
    check_hyper,
    check_param_update,
    check_state_dtype,
    stochastic_dtype_error,
)

__all__ = [
    "LowPrecisionAdamWState",
    "RoundingStats",
    "StallMonitor",
    "low_precision_adamw",
    "rounding_stats",
]

_F32 = jnp.float32


class LowPrecisionAdamWState(NamedTuple):
    """State of `low_precision_adamw`.

    Attributes:
      count: int32, steps applied so far.
      b1_power: float32, ``b1 ** count`` kept as a running product (the bias
        correction; torchref keeps the same product, so both round alike).
      b2_power: float32, ``b2 ** count``.
      mu: the first moments, in ``mu_dtype`` (divided by ``mu_scale``).
      nu: the second moments, in ``nu_dtype`` (divided by ``nu_scale``).
      mu_scale: float32 per tensor, ``max|mu| / dtype max``, for float16 and
        float8 storage (their narrow exponent range); ``()`` for float32 and
        bfloat16, whose range is float32's: a scale there would always be 1.
      nu_scale: the same for ``nu``.
      compensation: the Kahan buffers (``param_update="kahan"``), one per
        parameter in its dtype: the part of the updates not yet in it;
        ``()`` otherwise.
      key: uint32 ``[2]``, the key of the next stochastic rounding
        (``param_update="stochastic"``), ``()`` otherwise.
      stats: `RoundingStats` of the latest step.
    """

    count: jax.Array
    b1_power: jax.Array
    b2_power: jax.Array
    mu: Any
    nu: Any
    mu_scale: Any
    nu_scale: Any
    compensation: Any
    key: Any
    stats: RoundingStats


def _load(q: jax.Array, scale: jax.Array | None) -> jax.Array:
    return q.astype(_F32) if scale is None else q.astype(_F32) * scale


def _store(x: jax.Array, dtype: str, floor: bool):
    """``(stored, scale, underflowed)``: x in ``dtype`` (scaled per tensor for
    the narrow formats, ``scale`` None for the others; clipped to the largest
    finite: float8_e4m3fn has no inf). With ``floor``, a positive entry below
    the smallest normal is stored as that normal, never as 0 (a second
    moment read back as 0 would make the next update ``m / eps``)."""
    big, tiny = DTYPE_LIMITS[dtype]
    scale, y = None, x
    if dtype in SCALED_DTYPES:
        amax = jnp.max(jnp.abs(x))
        scale = jnp.where(amax > 0, amax / _F32(big), _F32(1.0))
        y = x / scale
    y = jnp.clip(y, -_F32(big), _F32(big))
    under = jnp.logical_and(y > 0, y < _F32(tiny))
    if floor:
        y = jnp.where(under, _F32(tiny), y)
    return y.astype(dtype), scale, under


def _round_stochastic(t: jax.Array, key: jax.Array) -> jax.Array:
    """float32 -> bfloat16, up with probability (t - down) / ulp: a random
    16-bit integer added to the bits that bfloat16 drops, then truncated.
    Non-finite values pass as they are (NaN bits plus a carry could wrap)."""
    bits = jax.lax.bitcast_convert_type(t, jnp.uint32)
    noise = jax.random.bits(key, t.shape, jnp.uint32) >> 16
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, _F32)
    return jnp.where(jnp.isfinite(t), out, t).astype(jnp.bfloat16)


def _apply(mode, p, u, comp, key):
    """``(new_p, new_comp, effective)``: the parameter after the update ``u``
    (float32) and the move that counts as applied (module docstring)."""
    p32 = p.astype(_F32)
    t = p32 + u
    if mode == "kahan":
        y = comp.astype(_F32) + u
        new = (p32 + y).astype(p.dtype)
        moved = new.astype(_F32) - p32
        new_comp = (y - moved).astype(p.dtype)
        return new, new_comp, moved + (new_comp.astype(_F32) - comp.astype(_F32))
    if mode == "stochastic" and p.dtype == jnp.bfloat16:
        return _round_stochastic(t, key), comp, t - p32
    new = t.astype(p.dtype)
    return new, comp, new.astype(_F32) - p32


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), _F32(0.0))


def _stats(parts) -> RoundingStats:
    """Global `RoundingStats` from per-leaf ``(u, decay, effective, under)``."""
    total = {k: _F32(0.0) for k in ("err", "u", "moving", "lost", "dec", "dlost")}
    under, entries = _F32(0.0), 0
    for u, decay, eff, nu_under in parts:
        lost = jnp.logical_and(u != 0, eff == 0)
        total["err"] += jnp.sum(jnp.square(eff - u))
        total["u"] += jnp.sum(jnp.square(u))
        total["moving"] += jnp.sum(u != 0, dtype=_F32)
        total["lost"] += jnp.sum(lost, dtype=_F32)
        total["dec"] += jnp.sum(jnp.abs(decay))
        total["dlost"] += jnp.sum(jnp.where(lost, jnp.abs(decay), 0))
        under += jnp.sum(nu_under, dtype=_F32)
        entries += u.size
    return RoundingStats(
        lost_update=jnp.sqrt(_ratio(total["err"], total["u"])),
        lost_params=_ratio(total["lost"], total["moving"]),
        lost_decay=_ratio(total["dlost"], total["dec"]),
        nu_underflow=under / _F32(max(entries, 1)),
    )


def _zero_stats() -> RoundingStats:
    return RoundingStats(*(jnp.zeros([], _F32) for _ in RoundingStats._fields))


def _hyper(name: str, value: Any, low: float, high: float | None) -> Any:
    """A Python number is checked; an array passes as it is (what
    ``optax.inject_hyperparams`` hands over, possibly traced)."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    return check_hyper(name, value, low, high)


def _check_params(mode: str, params: Any) -> None:
    if mode != "stochastic":
        return
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if jnp.dtype(p.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(_F32)):
            name = jax.tree_util.keystr(path) or "<root>"
            raise ValueError(stochastic_dtype_error(name, jnp.dtype(p.dtype).name))


def low_precision_adamw(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mu_dtype: Any = "float32",
    nu_dtype: Any = "float32",
    param_update: str = "nearest",
    seed: int = 0,
) -> optax.GradientTransformation:
    """AdamW with moments in a chosen dtype and a chosen parameter rounding.

    The step, in float32 whatever the stored dtypes (``t`` = steps applied,
    moments read back as ``stored * scale``)::

        m = b1 * m + (1 - b1) * g;      v = b2 * v + (1 - b2) * g * g
        u = -lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) - lr * wd * p

    (``u``'s Adam part is 0 where ``v`` is 0: ``g * g`` underflowed float32,
    and ``m / eps`` would be a step of unknown size), then ``m`` and ``v``
    are stored in ``mu_dtype`` / ``nu_dtype`` (float16
    and float8 with a per-tensor scale; a ``v`` entry that would underflow
    is stored as the smallest normal, never 0: read back as 0 it would make
    the next update ``m / eps``, up to 1e5 times too large) and ``u`` is
    rounded into each parameter's dtype by ``param_update``:

    - ``"nearest"``: round-to-nearest-even, what ``optax.apply_updates``
      does. In bfloat16 an update below half an ulp (2**-9 of the weight)
      is lost: the classic stall; weight decay with ``lr * wd < 2**-9``
      never shrinks a weight at all.
    - ``"stochastic"``: bfloat16 parameters round up with probability
      ``(p + u - down) / ulp`` (unbiased: the expected parameter is the
      float32 one). The key lives in the state, so a restored checkpoint
      draws the same bits; float32 parameters take ``u`` as is.
    - ``"kahan"``: a compensation buffer per parameter (its dtype) carries
      what rounding dropped into the next step: ``y = c + u``, ``p' =
      round(p + y)``, ``c' = round(y - (p' - p))``.

    The updates returned are ``p' - p`` in float32 (exact for the usual
    magnitudes), so ``optax.apply_updates`` lands on ``p'`` exactly. The
    state's ``stats`` say what rounding lost on this step (`RoundingStats`);
    `rounding_stats` finds them inside any wrapper (`stable_optimizer`).

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1: first-moment decay in [0, 1).
      b2: second-moment decay in [0, 1).
      eps: added to ``sqrt(v_hat)`` (>= 0).
      weight_decay: decoupled decay (>= 0), torch's AdamW ``weight_decay``.
      mu_dtype: storage of ``m``: ``"float32"``, ``"bfloat16"``,
        ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or the jnp
        dtype of that name.
      nu_dtype: storage of ``v``, the same choices.
      param_update: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
      seed: seed of the stochastic rounding key (an int).

    Returns:
      An `optax.GradientTransformation` whose state is a
      `LowPrecisionAdamWState`; ``update`` needs ``params``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxstable.transforms import low_precision_adamw
      >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
      >>> tx = low_precision_adamw(1e-4, weight_decay=0.0, param_update="kahan",
      ...                          mu_dtype="bfloat16", nu_dtype="bfloat16")
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones(4, jnp.bfloat16)}
      >>> for _ in range(3):
      ...     updates, state = tx.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> float(params["w"][0])  # 1 - 3e-4: below half an ulp (2**-9)
      1.0
      >>> float(state.compensation["w"][0])  # kept for the next steps
      -0.000301361083984375
    """
    lr_fn = learning_rate if callable(learning_rate) else None
    if lr_fn is None:
        _hyper("learning_rate", learning_rate, 0.0, None)
    b1, b2 = _hyper("b1", b1, 0.0, 1.0), _hyper("b2", b2, 0.0, 1.0)
    eps = _hyper("eps", eps, 0.0, None)
    weight_decay = _hyper("weight_decay", weight_decay, 0.0, None)
    mu_dtype = check_state_dtype("mu_dtype", mu_dtype)
    nu_dtype = check_state_dtype("nu_dtype", nu_dtype)
    mode = check_param_update(param_update)
    is_array = isinstance(seed, (jax.Array, np.ndarray))  # inject_hyperparams
    if not is_array and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int, got {seed!r}")

    def init_fn(params):
        _check_params(mode, params)

        def zeros(dtype):
            return jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)

        def scales(dtype):
            if dtype not in SCALED_DTYPES:
                return ()
            return jax.tree.map(lambda p: jnp.ones([], _F32), params)

        return LowPrecisionAdamWState(
            count=jnp.zeros([], jnp.int32),
            b1_power=jnp.ones([], _F32),
            b2_power=jnp.ones([], _F32),
            mu=zeros(mu_dtype),
            nu=zeros(nu_dtype),
            mu_scale=scales(mu_dtype),
            nu_scale=scales(nu_dtype),
            compensation=(
                jax.tree.map(lambda p: jnp.zeros_like(p), params)
                if mode == "kahan"
                else ()
            ),
            key=jax.random.PRNGKey(seed) if mode == "stochastic" else (),
            stats=_zero_stats(),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "low_precision_adamw needs params in update(grads, state, params)"
            )
        lr = _F32(learning_rate) if lr_fn is None else lr_fn(state.count)
        lr = jnp.asarray(lr, _F32)
        b1_power = state.b1_power * _F32(b1)
        b2_power = state.b2_power * _F32(b2)
        bc1, bc2 = _F32(1.0) - b1_power, _F32(1.0) - b2_power
        treedef = jax.tree.structure(params)
        n = treedef.num_leaves

        def flat(tree, dtype=None):  # a scale's dtype: None where it holds none
            if dtype is not None and dtype not in SCALED_DTYPES:
                return [None] * n
            return treedef.flatten_up_to(tree)

        leaves = [flat(updates), flat(params), flat(state.mu)]
        leaves += [flat(state.mu_scale, mu_dtype), flat(state.nu)]
        leaves += [flat(state.nu_scale, nu_dtype)]
        comps = treedef.flatten_up_to(state.compensation) if mode == "kahan" else None
        key, keys = state.key, None
        if mode == "stochastic":
            key, sub = jax.random.split(state.key)
            keys = jax.random.split(sub, max(treedef.num_leaves, 1))
        out, parts = [], []
        for i, (g, p, mq, ms, vq, vs) in enumerate(zip(*leaves, strict=True)):
            g32 = g.astype(_F32)
            m = _F32(b1) * _load(mq, ms) + _F32(1.0 - b1) * g32
            v = _F32(b2) * _load(vq, vs) + _F32(1.0 - b2) * (g32 * g32)
            adam = (m / bc1) / (jnp.sqrt(v / bc2) + _F32(eps))
            # v == 0 with m != 0: g * g underflowed (|g| < 1e-19, or flushed
            # to zero); m / (0 + eps) would be a step of unknown scale.
            adam = jnp.where(v > 0, adam, _F32(0.0))
            decay = lr * _F32(weight_decay) * p.astype(_F32)
            u = -(lr * adam) - decay
            comp = None if comps is None else comps[i]
            sub_key = None if keys is None else keys[i]
            new_p, new_c, eff = _apply(mode, p, u, comp, sub_key)
            mq, ms, _ = _store(m, mu_dtype, floor=False)
            vq, vs, under = _store(v, nu_dtype, floor=True)
            out.append((new_p.astype(_F32) - p.astype(_F32), mq, ms, vq, vs, new_c))
            parts.append((u, decay, eff, under))
        fields = [treedef.unflatten(list(col)) for col in zip(*out, strict=True)] or [
            treedef.unflatten([])
        ] * 6
        new_updates, mu, mu_scale, nu, nu_scale, comp_tree = fields
        return new_updates, LowPrecisionAdamWState(
            count=optax.safe_increment(state.count),
            b1_power=b1_power,
            b2_power=b2_power,
            mu=mu,
            nu=nu,
            mu_scale=mu_scale if mu_dtype in SCALED_DTYPES else (),
            nu_scale=nu_scale if nu_dtype in SCALED_DTYPES else (),
            compensation=comp_tree if mode == "kahan" else (),
            key=key,
            stats=_stats(parts),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def rounding_stats(opt_state: Any) -> RoundingStats | None:
    """The `RoundingStats` of the `low_precision_adamw` inside an optimizer
    state (any wrapper: `stable_optimizer`, `skip_spikes`, ``optax.chain``,
    ``optax.inject_hyperparams``), or None when there is none. After a
    skipped step they are those of the latest applied step (a skip keeps the
    old state).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable.transforms import (low_precision_adamw, rounding_stats,
      ...                                   stable_optimizer)
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> tx = stable_optimizer(low_precision_adamw(1e-5, weight_decay=0.0))
      >>> state = tx.init(params)
      >>> _, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
      >>> float(rounding_stats(state).lost_update)  # 1e-5 < half an ulp of 1
      1.0
    """
    found = optax.tree_utils.tree_get_all_with_path(
        opt_state, "stats", filtering=lambda _, v: isinstance(v, RoundingStats)
    )
    return found[0][1] if found else None
