"""The YOLO recipe (examples/detection/recipe*.py): JAX vs torch, step by step.

A tiny model with every parameter group (conv weight and linear weight with
decay, batch-norm weight without, batch-norm and linear biases in the bias
group) starts from the same weights in both frameworks and is trained with
the recipe under the guards (clip at 10, skip non-finite) through warmup and
decay, one batch carrying an inf input (a real non-finite gradient). After
every step: each group's LR and the momentum, every parameter, every
momentum buffer and the weight EMA (Ultralytics' ModelEMA) agree
(float32_trajectory tolerance); the bad step is skipped on both sides and
advances neither schedule nor EMA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

from conftest import tolerance
from examples.detection import recipe as recipe_lib
from examples.detection import recipe_jax, recipe_torch
from jaxstable import transforms as jtf
from torchref import transforms as ttf

STEPS, WARMUP, BAD_STEP = 150, 60, 40
SETTINGS = dict(warmup_steps=WARMUP, lr=0.05, decay="cosine", weight_decay=5e-3)


class Tiny(nn.Module):
    """conv (no bias) -> batch norm -> relu -> mean pool -> linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))


# JAX path -> (torch name, to-JAX layout)
NAMES = {
    ("conv", "kernel"): ("conv.weight", lambda w: w.transpose(2, 3, 1, 0)),
    ("bn", "scale"): ("bn.weight", lambda w: w),
    ("bn", "bias"): ("bn.bias", lambda w: w),
    ("fc", "kernel"): ("fc.weight", lambda w: w.T),
    ("fc", "bias"): ("fc.bias", lambda w: w),
}


def _jax_forward(p, x):
    """Tiny's forward, NHWC; train-mode batch norm (biased batch variance)."""
    y = jax.lax.conv_general_dilated(
        x, p["conv"]["kernel"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=jax.lax.Precision.HIGHEST,
    )  # fmt: skip
    mean = y.mean((0, 1, 2))
    var = ((y - mean) ** 2).mean((0, 1, 2))
    y = (y - mean) / jnp.sqrt(var + 1e-5) * p["bn"]["scale"] + p["bn"]["bias"]
    h = jax.nn.relu(y).mean((1, 2))
    return jnp.dot(h, p["fc"]["kernel"], precision="highest") + p["fc"]["bias"]


def _batches():
    """Seeded (NCHW x, y) batches; targets of scale 20 make the early
    gradient norms exceed the clip at 10; BAD_STEP's input holds an inf."""
    rng = np.random.default_rng(0)
    for step in range(STEPS + 1):
        x = rng.normal(size=(8, 3, 5, 5)).astype(np.float32)
        y = (rng.normal(size=(8, 2)) * 20).astype(np.float32)
        if step == BAD_STEP:
            x[3, 1, 2, 2] = np.inf
        yield step, x, y


def _jax_buffers(opt_state):
    """{path: momentum buffer} from every group's optax.trace state."""
    found = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda s: isinstance(s, optax.TraceState)
    )
    out = {}
    for trace in (s.trace for s in found if isinstance(s, optax.TraceState)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(trace):
            out[tuple(k.key for k in path)] = np.asarray(leaf)
    return out


def _jax_count(opt_state) -> int:
    """The schedule's step count (every group's is the same)."""
    # inject_hyperparams' state (InjectStatefulHyperparamsState in optax 0.2.8)
    injected = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda s: hasattr(s, "hyperparams")
    )
    counts = {int(s.count) for s in injected if hasattr(s, "hyperparams")}
    assert len(counts) == 1
    return counts.pop()


@pytest.fixture
def one_torch_thread():
    """Tiny eager ops: with torch's 2 threads on the loaded 2-core machine a
    conv of 8x3x5x5 took 17.6 ms, with one thread 0.46 ms (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_recipe_trajectory_matches_torch(one_torch_thread):
    torch.manual_seed(0)
    model = Tiny()
    named = dict(model.named_parameters())
    params = {"conv": {}, "bn": {}, "fc": {}}
    for (a, b), (n, f) in NAMES.items():
        params[a][b] = jnp.asarray(f(named[n].detach().numpy()))

    ema_settings = dict(decay=0.99, tau=20.0)  # ramps within the 150 steps
    tx = jtf.stable_optimizer(
        recipe_jax.with_ema(
            recipe_jax.yolo_optimizer(STEPS, **SETTINGS), STEPS, **ema_settings
        ),
        max_grad_norm=10.0,
    )

    @jax.jit
    def jax_step(p, s, x, y):
        grads = jax.grad(lambda q: jnp.mean((_jax_forward(q, x) - y) ** 2))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, jtf.global_norm(grads)

    opt, sched = recipe_torch.yolo_optimizer(model, STEPS, **SETTINGS)
    guarded = ttf.stable_optimizer(opt, max_grad_norm=10.0)
    ema = recipe_torch.WeightEma(model, STEPS, **ema_settings)
    state, tol = tx.init(params), tolerance("float32_trajectory")
    clipped = applied = 0
    for step, x, y in _batches():
        used = [(g["lr"], g["momentum"]) for g in opt.param_groups]
        params, state, norm = jax_step(params, state, np.moveaxis(x, 1, -1), y)
        opt.zero_grad()
        torch.mean((model(torch.tensor(x)) - torch.tensor(y)) ** 2).backward()
        guarded.step()
        skip = jtf.find_skip_state(state)
        assert bool(skip.last_finite) == guarded.skip_state.last_finite
        assert guarded.skip_state.last_finite == (step != BAD_STEP), step
        if guarded.skip_state.last_finite:
            sched.step()
            ema.update(model)  # after applied steps only, as with_ema's skip
            applied += 1
            clipped += float(norm) > 10.0
            hp = recipe_jax.group_hyperparams(state)  # of the step just taken
            for name, (lr, momentum) in zip(recipe_lib.GROUPS, used, strict=True):
                assert hp[name]["learning_rate"] == lr, (name, step)
                assert hp[name]["momentum"] == momentum, (name, step)
        # a skipped step advanced neither schedule
        assert sched.last_epoch == applied == _jax_count(state), step
        buffers, averaged = _jax_buffers(state), recipe_jax.ema_weights(state)
        assert ema.updates == applied
        for (a, b), (n, f) in NAMES.items():
            p = named[n]
            np.testing.assert_allclose(
                params[a][b], f(p.detach().numpy()), **tol, err_msg=f"{n} @ {step}"
            )
            np.testing.assert_allclose(
                averaged[a][b], f(ema.ema[n].numpy()), **tol,
                err_msg=f"weight EMA of {n} @ {step}",
            )  # fmt: skip
            np.testing.assert_allclose(
                buffers[(a, b)], f(opt.state[p]["momentum_buffer"].numpy()), **tol,
                err_msg=f"momentum buffer of {n} @ {step}",
            )  # fmt: skip
    assert applied == STEPS and clipped >= 3  # warmup, decay and the clip ran
    # the last step ran at the end of the cosine, near lr * lrf = 1% of lr
    last = recipe_jax.group_hyperparams(state)["decay"]["learning_rate"]
    assert last < 0.02 * SETTINGS["lr"]


def _ultralytics(step, nw, lr0, lrf, epochs, cos, bias_lr, mom0, mom):
    """Ultralytics' warmup and lambda, restated with np.interp (float64)."""
    if cos:
        lf = max((1 - math.cos(min(step, epochs) * math.pi / epochs)) / 2, 0)
        lf = lf * (lrf - 1) + 1
    else:
        lf = max(1 - step / epochs, 0) * (1.0 - lrf) + lrf
    target = lr0 * lf
    if step <= nw:
        return (
            np.interp(step, [0, nw], [bias_lr, target]),
            np.interp(step, [0, nw], [0.0, target]),
            np.interp(step, [0, nw], [mom0, mom]),
        )
    return target, target, mom


@pytest.mark.parametrize("decay", recipe_lib.DECAYS)
def test_schedule_is_ultralytics(decay):
    """Every step of the table: Ultralytics' formulas (per step) to float32."""
    r = recipe_lib.Recipe(steps=120, warmup_steps=30, decay=decay)
    table = r.table()
    for step in range(r.steps + 5):
        bias, other, mom = _ultralytics(
            step, 30, r.lr, r.final_lr_fraction, r.steps, decay == "cosine",
            r.warmup_bias_lr, r.warmup_momentum, r.momentum,
        )  # fmt: skip
        got = r.hyperparameters(step)
        np.testing.assert_allclose(got, [bias, other, other, mom], rtol=1e-7)
        np.testing.assert_array_equal(got, table[min(step, r.steps)])


def test_param_groups_agree():
    """The same parameters land in the same group in both frameworks."""
    model = Tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    torch_groups = {
        names[id(p)]: g
        for g, ps in recipe_torch.param_groups(model).items()
        for p in ps
    }
    tree = {"conv": {}, "bn": {}, "fc": {}}
    for a, b in NAMES:
        tree[a][b] = jnp.zeros(1)
    labels = recipe_jax.param_labels(tree)
    jax_groups = {NAMES[(a, b)][0]: labels[a][b] for (a, b) in NAMES}
    assert jax_groups == torch_groups
    assert torch_groups == {
        "conv.weight": "decay", "bn.weight": "no_decay", "bn.bias": "bias",
        "fc.weight": "decay", "fc.bias": "bias",
    }  # fmt: skip


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(decay="step"), r"unknown decay 'step'; valid values: linear, cosine"),
        (dict(lr=0.0), r"lr must be a number > 0.0, got 0.0"),
        (dict(momentum=1.5), r"momentum must be a number >= 0.0 and <= 1.0"),
        (dict(final_lr_fraction=-0.1), r"final_lr_fraction must be a number >= 0"),
        (dict(warmup_steps=2.5), r"warmup_steps must be an int, got 2.5"),
        (dict(weight_decay=float("nan")), r"weight_decay must be a number >= 0"),
    ],
)
@pytest.mark.parametrize("side", ["jax", "torch"])
def test_bad_settings_raise(side, settings, message):
    with pytest.raises(ValueError, match=message):
        if side == "jax":
            recipe_jax.yolo_optimizer(10, **settings)
        else:
            recipe_torch.yolo_optimizer(Tiny(), 10, **settings)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(decay=1.5, tau=10.0), r"decay must be a number >= 0.0 and <= 1.0"),
        (dict(decay=0.9, tau=0.0), r"tau must be a number > 0.0, got 0.0"),
    ],
)
def test_bad_ema_settings_raise(settings, message):
    with pytest.raises(ValueError, match=message):
        recipe_jax.with_ema(optax.sgd(0.1), 10, **settings)
    with pytest.raises(ValueError, match=message):
        recipe_torch.WeightEma(Tiny(), 10, **settings)
