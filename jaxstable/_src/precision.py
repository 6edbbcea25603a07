"""Precision policies (jmp), dtype limits and the headroom of a pytree."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np

# The policy type is jmp's own (params/compute/output dtypes and their casts);
# re-exported so that both packages name it `precision.Policy`.
Policy = jmp.Policy

__all__ = [
    "DtypeLimits",
    "PolicyNotAppliedWarning",
    "dtype_limits",
    "get_policy",
    "headroom",
]

# The policy grammar is the same in torchref.precision (same names, same
# errors, same messages): one dtype name for all three parts, a Keras-style
# mixed name, or key=dtype pairs; case-insensitive. "half" follows jmp:
# float16 on CPU/GPU, bfloat16 on TPU (torch, without TPUs: float16).
_DTYPE_NAMES: dict[str, Any] = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "f32": jnp.float32,
    "f64": jnp.float64,
    "float16": jnp.float16,
    "float32": jnp.float32,
    "float64": jnp.float64,
    "fp16": jnp.float16,
    "fp32": jnp.float32,
    "full": jnp.float32,
}
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute"}
_KEYS |= {"output": "output", "o": "output"}
# Keras-style names for the usual mixed-precision recipe: (params, compute, output).
_NAMED = {
    "mixed_float16": (jnp.float32, jnp.float16, jnp.float32),
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16, jnp.float32),
}
_ALLOWED = (
    "one dtype name for params, compute and output "
    f"({', '.join(sorted([*_DTYPE_NAMES, 'half']))}), "
    f"{' or '.join(sorted(_NAMED))}, or comma-separated key=dtype pairs with "
    "keys params|p, compute|c, output|o (e.g. 'params=float32,compute=float16,"
    "output=float32' or 'p=f32,c=bf16,o=f32'); case-insensitive"
)


def _parse_dtype(name: str, spec: str):
    if name == "half":
        return jmp.half_dtype()
    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"unknown dtype {name!r} in policy {spec!r}; allowed: {_ALLOWED}"
        )
    return _DTYPE_NAMES[name]


def get_policy(policy: str | jmp.Policy) -> jmp.Policy:
    """Parses a mixed-precision policy string into a `jmp.Policy`.

    Grammar (the same in `torchref.precision.get_policy`; case-insensitive,
    spaces ignored):

    - one dtype name for all three parts: ``bf16``, ``bfloat16``, ``f16``,
      ``fp16``, ``float16``, ``half``, ``f32``, ``fp32``, ``float32``,
      ``full``, ``f64``, ``float64`` (``half`` is jmp's: float16 on CPU/GPU,
      bfloat16 on TPU);
    - ``mixed_float16`` / ``mixed_bfloat16``: params and output float32,
      compute float16 / bfloat16;
    - comma-separated ``key=dtype`` pairs with keys ``params|p``,
      ``compute|c``, ``output|o``, each key at most once. Missing keys follow
      jmp: params default to float32, compute follows params, output follows
      compute.

    Args:
      policy: the string, or a `jmp.Policy` (returned unchanged).

    Returns:
      A `jmp.Policy`.

    Raises:
      ValueError: unknown key or dtype name, repeated key, empty string; the
        message lists what is allowed.
      TypeError: `policy` is neither a string nor a `jmp.Policy`.

    Example:
      >>> from jaxstable import precision
      >>> p = precision.get_policy("params=float32,compute=float16,output=float32")
      >>> [d.__name__ for d in (p.param_dtype, p.compute_dtype, p.output_dtype)]
      ['float32', 'float16', 'float32']
      >>> precision.get_policy("p=f32,c=bf16").output_dtype.__name__
      'bfloat16'
      >>> precision.get_policy("Mixed_Float16").compute_dtype.__name__
      'float16'
    """
    if isinstance(policy, jmp.Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a string or jmp.Policy, got {type(policy).__name__}"
        )
    spec = policy.strip().lower()
    if not spec:
        raise ValueError(f"empty policy string {policy!r}; allowed: {_ALLOWED}")
    if spec in _NAMED:
        p, c, o = _NAMED[spec]
        return jmp.Policy(param_dtype=p, compute_dtype=c, output_dtype=o)
    if "=" not in spec:
        d = _parse_dtype(spec, policy)
        return jmp.Policy(param_dtype=d, compute_dtype=d, output_dtype=d)
    parts: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad part {item.strip()!r} in policy {policy!r}; allowed: {_ALLOWED}"
            )
        if _KEYS[key] in parts:
            raise ValueError(
                f"{_KEYS[key]!r} given twice in policy {policy!r}; allowed: {_ALLOWED}"
            )
        parts[_KEYS[key]] = _parse_dtype(value, policy)
    param = parts.get("params", jnp.float32)
    compute = parts.get("compute", param)
    output = parts.get("output", compute)
    return jmp.Policy(param_dtype=param, compute_dtype=compute, output_dtype=output)


class DtypeLimits(NamedTuple):
    """Numerical limits of a floating dtype.

    Attributes:
      max: largest finite value (65504 for float16).
      tiny: smallest positive normal value (6.1e-5 for float16).
      eps: spacing of 1.0 and the next value (9.8e-4 for float16).
      max_exp_arg: ``log(max)``, the largest x with ``exp(x) <= max``: exp
        overflows float16 above 11.09, float32 and bfloat16 above 88.72.
    """

    max: float
    tiny: float
    eps: float
    max_exp_arg: float


def dtype_limits(dtype: Any) -> DtypeLimits:
    """Returns `DtypeLimits` (max, tiny, eps, max_exp_arg) of a floating dtype.

    Args:
      dtype: a floating dtype or its name (``jnp.float16``, ``"bfloat16"``).

    Returns:
      `DtypeLimits` of Python floats.

    Raises:
      TypeError: `dtype` is not a floating dtype (the same error and text as
        `torchref.precision.dtype_limits`).

    Example:
      >>> from jaxstable import precision
      >>> lim = precision.dtype_limits("float16")
      >>> lim.max, round(lim.max_exp_arg, 2)
      (65504.0, 11.09)
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        name = repr(dtype) if dt is None else dt.name
        raise TypeError(
            "dtype_limits needs a floating dtype (float16, bfloat16, float32, "
            f"float64, float8 variants), got {name}"
        )
    fi = jnp.finfo(dt)
    mx = float(fi.max)
    return DtypeLimits(
        max=mx, tiny=float(fi.tiny), eps=float(fi.eps), max_exp_arg=math.log(mx)
    )


def headroom(tree: Any, dtype: Any) -> Any:
    """Per-leaf ``max|x| / dtype_max``: how close each leaf is to overflowing `dtype`.

    A value above 1 means casting that leaf to `dtype` gives inf; 1e-3 leaves
    about 10 bits of room (a factor 1000). Computed in float32 on device
    (jit-safe); non-finite leaves give inf or nan, empty leaves 0.

    Args:
      tree: a pytree of arrays.
      dtype: the floating dtype to compare against (e.g. ``jnp.float16``).

    Returns:
      A pytree of float32 scalars with the structure of `tree`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstable import precision
      >>> h = precision.headroom({"w": jnp.array([-32752.0, 1.0])}, jnp.float16)
      >>> round(float(h["w"]), 3)
      0.5
    """
    mx = (
        np.float32(dtype_limits(dtype).max) if jnp.dtype(dtype) != jnp.float64 else None
    )

    def leaf(x):
        x = jnp.asarray(x, jnp.float32)
        if x.size == 0:
            return jnp.zeros([], jnp.float32)
        m = jnp.max(jnp.abs(x))
        # float32 cannot hold float64's max; relative to it every float32 is tiny.
        return m / mx if mx is not None else m * 0.0

    return jax.tree_util.tree_map(leaf, tree)


# ------------------------------------------------- what the policy really did
class PolicyNotAppliedWarning(UserWarning):
    """A policy's compute dtype that the model's matmuls did not run in.

    Warned once per train step by `jaxstable.train.make_train_step` when,
    after tracing, fewer than half of the matrix multiplications and
    convolutions of the loss and its gradient (``dot_general``,
    ``conv_general_dilated``, counted as traced, a ``scan`` body times its
    length) run in the policy's compute dtype: a module whose ``dtype`` is
    float32 (``nnx.Embed`` takes its embedding's) promotes the cast inputs
    back, and every later layer follows. The message names the first
    promotion and the fix. Silence it like any warning::

        warnings.filterwarnings("ignore", category=PolicyNotAppliedWarning)

    Example:
      >>> from jaxstable import precision
      >>> issubclass(precision.PolicyNotAppliedWarning, UserWarning)
      True
    """


# The scope `make_train_step` puts around the loss (its forward and, under
# `jax.grad`, its backward): the matmuls the audit counts.
LOSS_SCOPE = "jaxstable_loss"
_MATMULS = ("dot_general", "conv_general_dilated")
# Below this share of matmuls in the compute dtype the policy is called not
# applied (a float32 head over a bfloat16 body is a choice, not an accident).
MIN_COMPUTE_SHARE = 0.5


class _Op(NamedTuple):
    eqn: Any
    ins: list  # a key per input (None for a literal)
    outs: list
    in_loss: bool
    weight: int  # how many times it runs (a scan body: its length)


def _sub_jaxprs(eqn: Any) -> list:
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                out.append(v)
    return out


def _flatten(jaxpr, env, dtypes, in_loss, weight, ops, fresh) -> None:
    """Appends ``jaxpr``'s equations to ``ops`` in program order, inlining
    the sub-jaxpr of a call-like equation (pjit, remat, custom_jvp/vjp,
    scan: one sub-jaxpr taking and giving what the equation does) so that a
    value keeps one key across the call; ``dtypes`` maps keys to dtypes."""

    def key(v, env=env):
        if isinstance(v, jax.extend.core.Literal):
            return None
        if v not in env:
            env[v] = next(fresh)
            dtypes[env[v]] = getattr(v.aval, "dtype", None)
        return env[v]

    for eqn in jaxpr.eqns:
        here = in_loss or LOSS_SCOPE in str(eqn.source_info.name_stack)
        ins = [key(v) for v in eqn.invars]
        scan = eqn.primitive.name == "scan"
        w = weight * int(eqn.params.get("length", 1) if scan else 1)
        subs = _sub_jaxprs(eqn)
        if (
            len(subs) == 1
            and len(subs[0].invars) == len(ins)
            and len(subs[0].outvars) == len(eqn.outvars)
        ):
            sub = subs[0]
            inner = {
                v: k for v, k in zip(sub.invars, ins, strict=True) if k is not None
            }
            _flatten(sub, inner, dtypes, here, w, ops, fresh)
            for v, o in zip(eqn.outvars, sub.outvars, strict=True):
                k = key(o, inner)
                if k is not None:
                    env[v] = k
            continue
        for sub in subs:  # cond branches, while bodies: operands at the end
            pairs = zip(reversed(sub.invars), reversed(ins), strict=False)
            inner = {v: k for v, k in pairs if k is not None}
            _flatten(sub, inner, dtypes, here, w, ops, fresh)
        ops.append(_Op(eqn, ins, [key(v) for v in eqn.outvars], here, w))


class ComputeAudit(NamedTuple):
    """What the matmuls of a traced loss ran in (see `audit_compute`)."""

    counts: dict  # dtype name -> matmuls/convolutions that ran in it
    promotion: str | None  # where the first one off the compute dtype came from


def _floating(dtype: Any) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _op_dtype(op: _Op, dtypes: dict) -> Any:
    kinds = [dtypes.get(k) for k in op.ins[:2] if k is not None]
    if len(kinds) < 2 or not all(_floating(d) for d in kinds):
        return None
    return jnp.promote_types(*kinds)


def audit_compute(closed: Any, compute_dtype: Any, names: list) -> ComputeAudit:
    """Counts the dtypes the matmuls and convolutions inside the loss scope
    of ``closed`` (a traced train step) ran in and, when some did not run
    in ``compute_dtype``, says where the first of them got its wider input:
    the earliest equation that took a ``compute_dtype`` value and gave a
    wider one (a module promoting back), found by walking back from that
    matmul through wider values only; or the wider input it reads as is.
    ``names``: a name per input of ``closed`` (params, batch...)."""
    compute = jnp.dtype(compute_dtype)
    ops: list = []
    dtypes: dict = {}
    fresh = iter(range(10**12))
    top = closed.jaxpr
    env = {v: next(fresh) for v in (*top.invars, *top.constvars)}
    for v, k in env.items():
        dtypes[k] = getattr(v.aval, "dtype", None)
    origin = {env[v]: names[i] for i, v in enumerate(top.invars) if i < len(names)}
    _flatten(top, env, dtypes, False, 1, ops, fresh)
    counts: dict = {}
    first = None
    for op in ops:
        if not op.in_loss or op.eqn.primitive.name not in _MATMULS:
            continue
        dtype = _op_dtype(op, dtypes)
        if dtype is None:
            continue
        counts[dtype.name] = counts.get(dtype.name, 0) + op.weight
        if first is None and dtype != compute:
            first = op
    if first is None:
        return ComputeAudit(counts, None)
    order = {id(op): i for i, op in enumerate(ops)}
    producer = {k: op for op in ops for k in op.outs if k is not None}
    sites, reads, todo, seen = [], [], list(first.ins[:2]), set()
    while todo:
        k = todo.pop()
        if k is None or k in seen or not _floating(dtypes.get(k)):
            continue
        seen.add(k)
        if dtypes[k] == compute:
            continue
        op = producer.get(k)
        if op is None:
            reads.append(k)
        elif any(dtypes.get(i) == compute for i in op.ins if i is not None):
            sites.append(op)  # took the compute dtype, gave a wider one
        else:
            todo.extend(op.ins)
    if sites:
        site = min(sites, key=lambda op: order[id(op)])
        fed = _inputs_of(site, producer, origin)
        where = _where(site.eqn)
        on = f" on {', '.join(fed)}" if fed else ""
        return ComputeAudit(
            counts,
            f"a {compute.name} -> {site.eqn.outvars[0].aval.dtype} "
            f"{site.eqn.primitive.name}{on} at {where}",
        )
    read = sorted(origin.get(k, "a constant") for k in reads)
    return ComputeAudit(
        counts, f"a {dtypes[reads[0]]} input read as is: {read[0]}" if reads else None
    )


def _inputs_of(site: _Op, producer: dict, origin: dict) -> list:
    """The named inputs (params, batch leaves) ``site`` was computed from."""
    found, todo, seen = [], list(site.ins), set()
    while todo:
        k = todo.pop()
        if k is None or k in seen:
            continue
        seen.add(k)
        if k in origin:
            found.append(origin[k])
        elif k in producer:
            todo.extend(producer[k].ins)
    return sorted(set(found))[:3]


def _where(eqn: Any) -> str:
    """The library line of the equation (flax's module code) and the user's
    line that called into it, or the user's own line."""
    import linecache

    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    lib = ("site-packages", "dist-packages", "jaxstable/_src", "jaxstable\\_src")

    def text(fr):
        name = fr.file_name
        for m in lib[:2]:  # flax/nnx/nn/linear.py, not the venv's full path
            name = name.split(m + "/", 1)[-1]
        line = linecache.getline(fr.file_name, fr.start_line).strip()
        at = f"{name}:{fr.start_line} in {fr.function_name}"
        return f"{at}: `{line}`" if line else at

    for i, fr in enumerate(frames):
        if not any(m in fr.file_name for m in lib):
            if i == 0:
                return text(fr)
            # The library's outermost frame below the user's that is not a
            # decorator's wrapper (Keras wraps every call in one).
            named = [f for f in frames[:i] if "<locals>" not in f.function_name]
            return f"{text((named or frames[:i])[-1])}, called from {text(fr)}"
    return text(frames[0]) if frames else "(no source line)"


def warn_if_not_applied(
    closed: Any, policy: Any, spec: Any, names: list
) -> tuple[ComputeAudit | None, bool]:
    """``(audit, warned)``: `audit_compute` of a traced train step for a
    policy's compute dtype, with a `PolicyNotAppliedWarning` when less than
    `MIN_COMPUTE_SHARE` of the matmuls ran in it. The audit is None when
    the policy computes in its params' dtype (nothing to check)."""
    import warnings

    compute = jnp.dtype(policy.compute_dtype)
    if compute == jnp.dtype(policy.param_dtype) or not _floating(compute):
        return None, False
    audit = audit_compute(closed, compute, names)
    total = sum(audit.counts.values())
    share = audit.counts.get(compute.name, 0)
    warned = bool(total) and share < MIN_COMPUTE_SHARE * total
    if warned:
        ran = ", ".join(f"{n} in {d}" for d, n in sorted(audit.counts.items()))
        warnings.warn(
            f"make_train_step(policy={str(spec)!r}) asks for {compute.name} "
            f"compute, but only {share} of the {total} matmuls and convolutions "
            f"of the loss and its gradient ran in {compute.name} ({ran}). The "
            f"first one off {compute.name} got its input from {audit.promotion}. "
            f"A Flax module whose `dtype` is float32 promotes the {compute.name} "
            "values back to float32, and every later layer follows (nnx.Embed "
            "built without `dtype=` takes its embedding's, float32): set "
            "`dtype=None` on it (e.g. `model.embed.dtype = None`) or build the "
            f"modules with `dtype=jnp.{compute.name}` (flax's `dtype=` is the "
            "compute dtype, `param_dtype=` the storage dtype); Keras layers "
            "compute in their dtype policy: keras.config.set_dtype_policy("
            f"'mixed_{compute.name}') before building the model. To silence: "
            "warnings.filterwarnings('ignore', category=jaxstable.precision."
            "PolicyNotAppliedWarning)",
            PolicyNotAppliedWarning,
            stacklevel=4,
        )
    return audit, warned
