"""What the guarded train step computes beyond optax's clipped step, counted
in the compiled HLO (no timing).

``make_train_step`` over ``stable_optimizer(adamw, max_grad_norm=1.0,
check_update=False)``, with and without a `DynamicLossScale`, on two
matrices and a vector. XLA:CPU evaluates the scalar operations fused into
an elementwise kernel once per element: the unscale factor's 24-step
division and the clip's selects ran for every element of every gradient,
moment and parameter (2,013 scalar operations in the kernels with the loss
scale, 63 without) until `loss_scale_math.computed_once` made them once per
step.

XLA:CPU only: the fusion decisions are the CPU compiler's.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxstable import loss_scale as jls
from jaxstable import train, transforms

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions"
)

_SHAPES = {"w1": (32, 64), "b1": (64,), "w2": (64, 64)}
# Scalar operations that choose or build a factor (compares, selects, bit
# operations); Adam's own scalar ``1 - b**t`` is a subtract, not counted.
_CHOICES = frozenset(
    {"select", "compare", "and", "or", "not", "xor", "minimum", "maximum"}
    | {"shift-left", "shift-right-logical", "divide"}
)


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _compiled_text(loss_scale) -> str:
    params = {k: jnp.full(s, 0.5) for k, s in _SHAPES.items()}
    tx = transforms.stable_optimizer(
        optax.adamw(1e-3), max_grad_norm=1.0, check_update=False
    )
    state = train.TrainState.create(params=params, optimizer=tx, loss_scale=loss_scale)
    step = train.make_train_step(_loss)
    return step.lower(state, jnp.ones((8, 32))).compile().as_text()


def _computations(text: str) -> dict[str, str]:
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head:
            name = head[1]
            comps[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    return {k: "\n".join(v) for k, v in comps.items()}


def scalar_choices_in_array_kernels(text: str) -> int:
    """Scalar compares, selects and bit operations inside the fusions that
    write an array (each runs once per element of that array)."""
    comps = _computations(text)
    entry = text[text.index("\nENTRY") :]
    count = 0
    for line in entry.splitlines():
        array = re.search(r"= \(?\w+\[\d[\d,]*\]", line)
        called = re.search(r" fusion\(.*calls=(%[\w.\-]+)", line)
        if array and called:
            ops = re.findall(r"= \w+\[\]\S* ([\w\-]+)\(", comps[called[1]])
            count += sum(op in _CHOICES for op in ops)
    return count


@pytest.mark.parametrize("loss_scale", [None, jls.DynamicLossScale()])
def test_no_scalar_factor_is_recomputed_per_element(loss_scale):
    # The unscale factor (DynamicLossScale) and the clip's two factors are
    # computed once per step and read by the kernels.
    assert scalar_choices_in_array_kernels(_compiled_text(loss_scale)) == 0
