"""Trajectory parity: the guarded train step, JAX vs PyTorch, step by step.

The same small model (an MLP, and a conv net with batch norm) starts from the
same weights in both frameworks (torch's init, copied into the JAX layout),
sees the same seeded numpy batches, some poisoned with NaN *inputs*, and is
trained for 44 steps with clipping and a dynamic loss scale:

* JAX: ``jaxstable.train.make_train_step`` over
  ``stable_optimizer(opt, max_grad_norm=...)`` and ``DynamicLossScale``;
* torch: ``torchref.train.TrainStep`` (the real ``GradScaler``,
  ``clip_grad_norm_``) over the matching ``torch.optim`` optimizer.

After EVERY step: params agree (float32 tolerance), ``loss_scale`` and
``skipped_total`` are equal exactly, ``finite`` is False exactly on the
poisoned steps, and no parameter is ever non-finite on either side.

Hyperparameters are matched formula by formula:

* SGD+momentum: torch ``buf = momentum*buf + g`` (buf = g on the first step,
  dampening 0, no Nesterov), ``p -= lr*buf``; optax ``trace`` starts from
  zeros, so ``t = g + momentum*t`` is ``g`` on the first step: identical.
* Adam: torch ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``; optax
  ``p -= lr * m_hat / (sqrt(v_hat + 0) + eps)``: eps is added outside the
  square root of the bias-corrected v on both sides: identical.
* AdamW: torch ``p *= 1 - lr*wd`` then the Adam step (both on the old p);
  optax ``adamw`` adds ``wd*p`` to the Adam update before scaling by ``-lr``:
  ``p - lr*(adam + wd*p)``, identical. Both decay every parameter (optax's
  mask is None, torch has one param group).

Batch norm: torch's and flax's train-mode forward both normalise with the
biased batch variance, so params and metrics are compared directly. The
running statistics differ by definition (torch momentum 0.1 == flax 0.9, but
torch's running_var averages the UNBIASED variance ``n/(n-1) * biased``):
with both starting at var = 1, after k applied steps
``torch_var = 0.9**k + n/(n-1) * (flax_var - 0.9**k)`` exactly in real
arithmetic; we compare that corrected value (and the running means directly),
which also checks that a skipped step leaves the statistics untouched on both
sides.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from conftest import torch_device
from jaxstable import loss_scale as jls
from jaxstable import losses as jlosses
from jaxstable import train as jtrain
from jaxstable import transforms
from torchref import loss_scale as tls
from torchref import losses as tlosses
from torchref import train as ttrain

_STEPS = 44
DEV = torch_device()  # CUDA when present: both frameworks on the GPU
_POISON = frozenset({5, 17, 18, 30})  # NaN input at these steps (0-based)
_BATCH = 8
_CLASSES = 5
_FEATURES = 12  # MLP input width
_HW = 8  # conv net input is _HW x _HW x 3
_BN_MOMENTUM = 0.1  # torch's; flax's momentum is 1 - this
_BN_EPS = 1e-5  # both frameworks' default
# Scale 2**10 growing x2 after 8 finite steps in a row: with the poisoned
# steps above it backs off 4 times and grows 3 times within the run.
_LOSS_SCALE = 2.0**10
_PERIOD = 8

# name -> (optax factory, torch factory); hyperparameters spelled out on both
# sides (the libraries' defaults differ, e.g. AdamW weight decay 1e-4 vs 1e-2).
_LR = {"sgd_momentum": 0.05, "adam": 1e-2, "adamw": 1e-2}
_OPTIMIZERS = {
    "sgd_momentum": (
        lambda: optax.sgd(_LR["sgd_momentum"], momentum=0.9, nesterov=False),
        lambda p: torch.optim.SGD(
            p, lr=_LR["sgd_momentum"], momentum=0.9, dampening=0.0, nesterov=False
        ),
    ),
    "adam": (
        lambda: optax.adam(_LR["adam"], b1=0.9, b2=0.999, eps=1e-8),
        lambda p: torch.optim.Adam(p, lr=_LR["adam"], betas=(0.9, 0.999), eps=1e-8),
    ),
    "adamw": (
        lambda: optax.adamw(
            _LR["adamw"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05
        ),
        lambda p: torch.optim.AdamW(
            p, lr=_LR["adamw"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05
        ),
    ),
}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run torch single-threaded here: on these tiny ops its intra-op threads
    only spin-wait, which made a 44-step conv run 45x slower (6 s vs 0.13 s)
    on 2 shared cores. Restored afterwards for other tests."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ models
class TorchMLP(torch.nn.Module):
    """12-32-32-5 with tanh. Smooth on purpose: with ReLU, one pre-activation
    within float32 rounding of 0 (it happened at step 42 of the Adam run)
    switches a unit on in one framework only and the trajectories part by
    ~1e-3 at once; that is the kink, not the guards."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(_FEATURES, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, _CLASSES)

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.head(x)


class JaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        del train
        x = jnp.tanh(nn.Dense(32, name="fc1")(x))
        x = jnp.tanh(nn.Dense(32, name="fc2")(x))
        return nn.Dense(_CLASSES, name="head")(x)


class TorchConvNet(torch.nn.Module):
    """conv3x3-BN-ReLU, conv3x3/2-BN-ReLU, global average pool, linear.

    Convs before BN have no bias (BN's shift replaces it; a bias there has a
    zero gradient, which Adam would turn into +-lr noise steps)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8, eps=_BN_EPS, momentum=_BN_MOMENTUM)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(16, eps=_BN_EPS, momentum=_BN_MOMENTUM)
        self.head = torch.nn.Linear(16, _CLASSES)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class JaxConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        def bn(name):
            return nn.BatchNorm(
                use_running_average=not train,
                momentum=1.0 - _BN_MOMENTUM,
                epsilon=_BN_EPS,
                # mean((x - mean)**2), as torch; not E[x^2] - E[x]^2.
                use_fast_variance=False,
                name=name,
            )

        # torch's padding=1 on both sides; "SAME" would pad (0, 1) at stride 2.
        pad = ((1, 1), (1, 1))
        x = nn.Conv(8, (3, 3), padding=pad, use_bias=False, name="conv1")(x)
        x = nn.relu(bn("bn1")(x))
        x = nn.Conv(16, (3, 3), (2, 2), padding=pad, use_bias=False, name="conv2")(x)
        x = nn.relu(bn("bn2")(x))
        return nn.Dense(_CLASSES, name="head")(x.mean(axis=(1, 2)))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _torch_batch(x: np.ndarray, y: np.ndarray):
    return torch.from_numpy(x).to(DEV), torch.from_numpy(y.astype(np.int64)).to(DEV)


def _torch_to_jax(model: torch.nn.Module):
    """(params, batch_stats) in flax's layout from torch's parameters/buffers.

    Linear (out, in) -> Dense kernel (in, out); Conv2d (O, I, kh, kw) -> Conv
    kernel (kh, kw, I, O); BN weight/bias -> scale/bias. The running var is
    returned raw (torch's unbiased average; see the module docstring).
    """
    params, stats = {}, {}
    for name, mod in model.named_children():
        if isinstance(mod, torch.nn.Linear):
            params[name] = {"kernel": _np(mod.weight).T, "bias": _np(mod.bias)}
        elif isinstance(mod, torch.nn.Conv2d):
            params[name] = {"kernel": _np(mod.weight).transpose(2, 3, 1, 0)}
        elif isinstance(mod, torch.nn.BatchNorm2d):
            params[name] = {"scale": _np(mod.weight), "bias": _np(mod.bias)}
            stats[name] = {"mean": _np(mod.running_mean), "var": _np(mod.running_var)}
        else:
            raise TypeError(f"no layout rule for {name}: {type(mod).__name__}")
    return params, stats


# ------------------------------------------------------------------- data
def _batches(kind: str, seed: int = 0, poison=_POISON, steps=_STEPS):
    """Seeded numpy batches (torch layout), labels from a fixed random linear
    teacher; step i in _POISON gets one NaN input value."""
    rng = np.random.default_rng(seed)
    shape = (_FEATURES,) if kind == "mlp" else (3, _HW, _HW)
    teacher = rng.standard_normal((int(np.prod(shape)), _CLASSES))
    out = []
    for i in range(steps):
        x = rng.standard_normal((_BATCH, *shape)).astype(np.float32)
        y = np.argmax(x.reshape(_BATCH, -1) @ teacher, axis=-1).astype(np.int32)
        if i in poison:
            x.reshape(-1)[rng.integers(x.size)] = np.nan  # one NaN input value
        out.append((x, y))
    return out


def _to_jax_layout(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 3, 1) if x.ndim == 4 else x


# ----------------------------------------------------------------- sides
def _make_torch(
    kind, opt_name, max_grad_norm, *, scale=_LOSS_SCALE, autocast_dtype=None
):
    torch.manual_seed(0)
    model = (TorchMLP() if kind == "mlp" else TorchConvNet()).to(DEV)
    model.train()
    opt = _OPTIMIZERS[opt_name][1](model.parameters())

    def loss_fn(m, batch):
        x, y = batch
        return tlosses.softmax_cross_entropy(m(x), y)

    step = ttrain.TrainStep(
        model,
        opt,
        loss_fn,
        max_grad_norm=max_grad_norm,
        scaler=tls.DynamicLossScale(loss_scale=scale, period=_PERIOD),
        autocast_dtype=autocast_dtype,
    )
    return model, step


def _make_jax(
    kind, opt_name, max_grad_norm, torch_model, *, scale=_LOSS_SCALE, policy=None
):
    module = JaxMLP() if kind == "mlp" else JaxConvNet()
    params, stats = _torch_to_jax(torch_model)
    params = jax.tree.map(jnp.asarray, params)
    model_state = {"batch_stats": jax.tree.map(jnp.asarray, stats)} if stats else None
    tx = transforms.stable_optimizer(
        _OPTIMIZERS[opt_name][0](), max_grad_norm=max_grad_norm
    )
    state = jtrain.TrainState.create(
        params=params,
        optimizer=tx,
        loss_scale=jls.DynamicLossScale(loss_scale=scale, period=_PERIOD),
        model_state=model_state,
    )
    if model_state is None:

        def loss_fn(p, batch):
            x, y = batch
            return jlosses.softmax_cross_entropy(module.apply({"params": p}, x), y)

        return state, jtrain.make_train_step(loss_fn, policy=policy)

    def loss_fn_bn(p, ms, batch):
        x, y = batch
        logits, new_ms = module.apply(
            {"params": p, **ms}, x, train=True, mutable=["batch_stats"]
        )
        return jlosses.softmax_cross_entropy(logits, y), new_ms

    return state, jtrain.make_train_step(loss_fn_bn, has_state=True, policy=policy)


# Clip threshold inside the range of the pre-clip grad norms of these runs
# (about 0.4 to 2), so both branches of the clip run; asserted below.
_MAX_GRAD_NORM = {"mlp": 1.0, "convnet": 0.8}


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("kind", ["mlp", "convnet"])
def test_guarded_step_trajectories_agree(kind, opt_name, tol):
    f32 = tol("float32")
    traj = tol("float32_trajectory")  # params accumulate drift over the steps
    max_grad_norm = _MAX_GRAD_NORM[kind]
    batches = _batches(kind)
    tmodel, tstep = _make_torch(kind, opt_name, max_grad_norm)
    state, jstep = _make_jax(kind, opt_name, max_grad_norm, tmodel)
    # Same start (the copy is exact; checked rather than assumed).
    chex.assert_trees_all_equal(jax.device_get(state.params), _torch_to_jax(tmodel)[0])

    n_elems = _BATCH * _HW * _HW  # BN reduction size of bn1 (bn2: stride 2)
    bn_n = {"bn1": n_elems, "bn2": n_elems // 4}
    applied = 0  # finite (applied) steps so far: BN stats move only on these
    scales, clipped = [], []
    for i, (x, y) in enumerate(batches):
        tm = tstep(_torch_batch(x, y))
        state, jm = jstep(state, (jnp.asarray(_to_jax_layout(x)), jnp.asarray(y)))
        jm = jax.device_get(jm)
        where = f"{kind}/{opt_name} step {i}"

        poisoned = i in _POISON
        assert bool(jm["finite"]) is (not poisoned), where
        assert tm["finite"] is (not poisoned), where
        assert float(jm["loss_scale"]) == tm["loss_scale"], where
        assert int(jm["skipped_total"]) == tm["skipped_total"], where
        assert tm["skipped_total"] == sum(j <= i for j in _POISON), where
        assert int(state.skipped_total) == tm["skipped_total"], where
        assert float(state.loss_scale.loss_scale) == tstep.scaler.get_scale(), where
        scales.append(tm["loss_scale"])
        if not poisoned:
            applied += 1
            np.testing.assert_allclose(float(jm["loss"]), tm["loss"], **f32)
            np.testing.assert_allclose(float(jm["grad_norm"]), tm["grad_norm"], **f32)
            clipped.append(tm["grad_norm"] > max_grad_norm)
        else:
            assert not np.isfinite(jm["loss"]) and not np.isfinite(tm["loss"]), where

        tparams, tstats = _torch_to_jax(tmodel)
        chex.assert_tree_all_finite(state.params)
        chex.assert_tree_all_finite(tparams)
        chex.assert_trees_all_close(jax.device_get(state.params), tparams, **traj)
        if tstats:
            jstats = jax.device_get(state.model_state["batch_stats"])
            decay = (1.0 - _BN_MOMENTUM) ** applied
            for name, n in bn_n.items():
                np.testing.assert_allclose(
                    jstats[name]["mean"], tstats[name]["mean"], **f32, err_msg=where
                )
                unbiased = decay + n / (n - 1) * (jstats[name]["var"] - decay)
                np.testing.assert_allclose(
                    unbiased, tstats[name]["var"], **f32, err_msg=where
                )

    # The run exercised what it claims to: the scale moved both ways, and the
    # clip both fired and stayed idle.
    moves = np.sign(np.diff(scales))
    assert (moves > 0).sum() == 3 and (moves < 0).sum() == 4, scales
    assert any(clipped) and not all(clipped), clipped


# Real fp16 overflow (no poisoned input): float16 compute (JAX: a jmp policy;
# torch: CPU autocast) with a loss scale of 2**24. The scaled gradient of the
# logits alone is up to 2**24/8 = 2**21, far above fp16's max 65504, so both
# sides overflow and back off step after step until the scale fits (2**17
# here), and overflow again after the scale grows back. The two fp16 forward
# and backward passes round differently, so their trajectories agree only to
# fp16 tolerance and only for a while: past the horizons below the small
# differences are amplified (e.g. a gradient within rounding of 65504
# overflows on one side only; BN in fp16 drifts first), which is a property
# of fp16 compute, not of the guards. Adam is left out: its first step
# divides each gradient by its own magnitude, so fp16 rounding of tiny
# gradients becomes an O(lr) parameter difference at once.
_FP16_STEPS = {"mlp": 16, "convnet": 10}


@pytest.mark.parametrize("kind", ["mlp", "convnet"])
def test_real_fp16_overflow_backs_off_alike(kind, tol):
    steps, scale, max_grad_norm = _FP16_STEPS[kind], 2.0**24, 1.0
    batches = _batches(kind, poison=(), steps=steps)
    tmodel, tstep = _make_torch(
        kind, "sgd_momentum", max_grad_norm, scale=scale, autocast_dtype=torch.float16
    )
    state, jstep = _make_jax(
        kind,
        "sgd_momentum",
        max_grad_norm,
        tmodel,
        scale=scale,
        policy="params=float32,compute=float16,output=float32",
    )
    finite = []
    for i, (x, y) in enumerate(batches):
        before = jax.device_get(state.params)
        tm = tstep(_torch_batch(x, y))
        state, jm = jstep(state, (jnp.asarray(_to_jax_layout(x)), jnp.asarray(y)))
        jm = jax.device_get(jm)
        where = f"{kind} fp16 step {i}"
        assert bool(jm["finite"]) is tm["finite"], where
        assert float(jm["loss_scale"]) == tm["loss_scale"], where
        assert int(jm["skipped_total"]) == tm["skipped_total"], where
        finite.append(tm["finite"])
        tparams = _torch_to_jax(tmodel)[0]
        chex.assert_tree_all_finite(state.params)
        chex.assert_tree_all_finite(tparams)
        if not tm["finite"]:  # the overflowed update was not applied at all
            chex.assert_trees_all_equal(jax.device_get(state.params), before)
        chex.assert_trees_all_close(
            jax.device_get(state.params), tparams, **tol("float16")
        )
    # Overflow really happened (without any NaN input): the scale backed off
    # from 2**24 on the first steps, then training went on.
    assert finite[:6] == [False] * 6 and sum(finite) >= 3, finite
