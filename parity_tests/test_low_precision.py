"""low_precision_adamw in both frameworks: the same arithmetic (Kahan and
round-to-nearest agree to the bit), unbiased stochastic rounding, the
rounding statistics, and the edges: a zero gradient, an update of exactly
half an ulp, a second moment at bfloat16's smallest normal, weight decay
below the ulp, and a resume in the middle of a stochastic-rounding run.

bfloat16 around 1: the ulp is 2**-8 below 1 and 2**-7 above, so a step of
``lr`` down from 1 with ``lr < 2**-9`` rounds back to 1 (round-to-nearest).
The first Adam step is ``-lr * sign(g)`` exactly (``eps=0``), which makes
the intended update known.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from conftest import has_conditional
from jaxstable import loss_scale as jls
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import train as ttrain
from torchref import transforms as ttx

# Compile-bound: XLA with fewer optimisations (conftest.py; the same
# assertions pass either way, measured 2026-11-28).
pytestmark = pytest.mark.usefixtures("fewer_xla_optimizations")

ULP_BELOW_1 = 2.0**-8
FLOAT8 = ("float8_e5m2", "float8_e4m3fn")


def _jax_run(grads, params, jit=False, **kw):
    tx = jtx.low_precision_adamw(**kw)
    p = {"w": jnp.asarray(params, jnp.bfloat16)}
    state = tx.init(p)
    update = jax.jit(tx.update) if jit else tx.update
    for g in grads:
        upd, state = update({"w": jnp.asarray(g, jnp.bfloat16)}, state, p)
        p = optax.apply_updates(p, upd)
    return p["w"], state


def _torch_run(grads, params, **kw):
    kw["lr"] = kw.pop("learning_rate")
    w = torch.nn.Parameter(torch.tensor(params, dtype=torch.bfloat16))
    opt = ttx.low_precision_adamw([w], **kw)
    for g in grads:
        w.grad = torch.tensor(g, dtype=torch.bfloat16)
        opt.step()
    return w.detach(), opt


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy()
    return np.asarray(jnp.asarray(x, jnp.float32))


def _bits(x) -> np.ndarray:
    """A stored moment's bits (torch keeps float8 as uint8 bits)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _parity_run(mode, mu, nu, jit, steps=6):
    rng = np.random.default_rng(0)
    params = rng.normal(size=32).astype(np.float32).tolist()
    grads = (rng.normal(size=(steps, 32)) * np.logspace(-6, 0, 32)).tolist()
    kw = dict(
        learning_rate=3e-3,
        weight_decay=0.1,
        mu_dtype=mu,
        nu_dtype=nu,
        param_update=mode,
    )
    jw, js = _jax_run(grads, params, jit=jit, **kw)
    tw, opt = _torch_run(grads, params, **dict(kw))
    return jw, js, tw, opt, opt.state[_param(opt)]


def test_the_arithmetic_is_the_same_to_the_bit():
    # Op by op (JAX without jit) the two compute the same bits: the same
    # formulas in the same order, IEEE division and sqrt, the same casts.
    # (Under jit XLA may fuse a multiply-add: the next test allows that.)
    jw, js, tw, _, st = _parity_run("kahan", "bfloat16", "float8_e4m3fn", False, 3)
    np.testing.assert_array_equal(_f32(jw), _f32(tw))
    np.testing.assert_array_equal(_bits(js.mu["w"]), _bits(st["mu"]))
    np.testing.assert_array_equal(_bits(js.nu["w"]), _bits(st["nu"]))
    np.testing.assert_array_equal(_f32(js.compensation["w"]), _f32(st["compensation"]))
    assert float(js.nu_scale["w"]) == float(st["nu_scale"])


@pytest.mark.parametrize(
    "mode,mu,nu",
    [
        ("kahan", "bfloat16", "bfloat16"),
        ("nearest", "float16", "float8_e5m2"),
    ],
)
def test_both_frameworks_agree_under_jit(mode, mu, nu):
    jw, js, tw, opt, st = _parity_run(mode, mu, nu, True)
    ulp = 2.0**-7  # bfloat16's relative spacing: one rounding apart at most
    np.testing.assert_allclose(_f32(jw), _f32(tw), rtol=ulp, atol=1e-6)
    if mode == "kahan":
        p32 = _f32(jw) + _f32(js.compensation["w"])
        t32 = _f32(tw) + _f32(st["compensation"])
        np.testing.assert_allclose(p32, t32, rtol=1e-4, atol=1e-6)
    jstats, tstats = js.stats, ttx.rounding_stats(opt)
    for name in jtx.RoundingStats._fields:
        np.testing.assert_allclose(
            float(getattr(jstats, name)), float(getattr(tstats, name)), rtol=0.05
        )


def test_stochastic_rounding_is_unbiased_where_nearest_loses_the_step():
    # A step of exactly half an ulp down from 1, 4096 entries: nearest keeps
    # 1 (the tie goes to the even 1.0), the mean of the stochastic draws is
    # 1 - ulp / 2 within 5 standard errors, in both frameworks.
    fraction = 0.5
    n, lr = 4096, fraction * ULP_BELOW_1
    kw = dict(learning_rate=lr, eps=0.0, weight_decay=0.0)
    for run in (_jax_run, _torch_run):
        near, _ = run([[1.0] * n], [1.0] * n, **dict(kw, param_update="nearest"))
        assert (_f32(near) == 1.0).all(), run.__name__
        sr, state = run([[1.0] * n], [1.0] * n, **dict(kw, param_update="stochastic"))
        values = _f32(sr)
        assert set(np.unique(values)) <= {1.0, 1.0 - ULP_BELOW_1}
        bound = 5 * ULP_BELOW_1 * np.sqrt(fraction * (1 - fraction) / n)
        assert abs(values.mean() - (1.0 - lr)) < bound, run.__name__
        stats = (
            state.stats if run is _jax_run else ttx.rounding_stats(state)
        )  # nothing is lost in expectation
        # (only float32's rounding of p + u, ~2**-24 / 2**-9 of the step)
        assert float(stats.lost_update) < 1e-4


def test_rounding_stats_see_the_stall_and_the_half_ulp_tie():
    kw = dict(learning_rate=0.5 * ULP_BELOW_1, eps=0.0, weight_decay=0.0)
    for run in (_jax_run, _torch_run):
        w, state = run([[1.0, -1.0]], [1.0, 1.0], **dict(kw, param_update="nearest"))
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        # entry 0 (down, a tie) stays at the even 1.0; entry 1 goes up to
        # 1 + 2**-9, also a tie, between 1 and 1 + 2**-7: 1.0 again.
        assert _f32(w).tolist() == [1.0, 1.0]
        assert float(stats.lost_update) == 1.0
        assert float(stats.lost_params) == 1.0
        # Kahan: the half ulp waits in the buffer, the second step lands it.
        w, state = run([[1.0, 1.0]] * 2, [1.0, 1.0], **dict(kw, param_update="kahan"))
        assert _f32(w).tolist() == [1.0 - ULP_BELOW_1] * 2, run.__name__
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        assert float(stats.lost_update) < 1e-6  # the buffer's own rounding


def test_zero_gradient_moves_nothing_and_loses_nothing():
    for run in (_jax_run, _torch_run):
        for mode in ("nearest", "stochastic", "kahan"):
            w, state = run(
                [[0.0, 0.0]] * 2,
                [1.0, -3.0],
                learning_rate=1e-2,
                eps=0.0,
                weight_decay=0.0,
                param_update=mode,
            )
            stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
            assert _f32(w).tolist() == [1.0, -3.0]
            assert [float(s) for s in stats] == [0.0, 0.0, 0.0, 0.0]


def test_weight_decay_below_the_ulp():
    # lr * wd = 1e-4 < 2**-9: nearest never shrinks the weight and says so
    # (lost_decay 1); Kahan shrinks it by 1 ulp within 30 steps (2**-9 / 1e-4
    # = 19.5 steps from 1, 26 from 0.75).
    kw = dict(learning_rate=1e-2, weight_decay=1e-2, eps=0.0)
    grads = [[0.0, 0.0]] * 30
    for run in (_jax_run, _torch_run):
        w, state = run(grads, [1.0, 0.75], **dict(kw, param_update="nearest"))
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        assert _f32(w).tolist() == [1.0, 0.75]
        assert float(stats.lost_decay) == 1.0
        w, state = run(grads, [1.0, 0.75], **dict(kw, param_update="kahan"))
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        assert (_f32(w) < [1.0, 0.75]).all(), run.__name__
        assert float(stats.lost_decay) == 0.0


def test_second_moment_at_the_bfloat16_smallest_normal():
    # b2 = 0: v = g * g. g = 2**-63 gives v = 2**-126, bfloat16's smallest
    # normal: stored exactly, no underflow. With float16 storage the same v
    # next to a v of 1 is 2**-126 * 65504 after the scale: an underflow,
    # stored as float16's smallest normal, never 0.
    tiny = 2.0**-126
    for run in (_jax_run, _torch_run):
        kw = dict(learning_rate=1e-3, b2=0.0, weight_decay=0.0)
        if run is _torch_run:
            kw["betas"] = (0.9, kw.pop("b2"))
        _, state = run([[2.0**-63, 1.0]], [1.0, 1.0], nu_dtype="bfloat16", **kw)
        nu = state.nu["w"] if run is _jax_run else state.state[_param(state)]["nu"]
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        assert _f32(nu).tolist() == [tiny, 1.0]
        assert float(stats.nu_underflow) == 0.0
        _, state = run([[2.0**-63, 1.0]], [1.0, 1.0], nu_dtype="float16", **kw)
        nu = state.nu["w"] if run is _jax_run else state.state[_param(state)]["nu"]
        stats = state.stats if run is _jax_run else ttx.rounding_stats(state)
        assert _f32(nu).tolist() == [2.0**-14, 65504.0]
        assert float(stats.nu_underflow) == 0.5


def _param(opt):
    return opt.param_groups[0]["params"][0]


def test_underflowed_second_moment_never_enlarges_the_update():
    # float8_e4m3fn second moments, per-tensor scale: entry 1's v is 1e-8 of
    # entry 0's and underflows. Its later steps must not exceed those of a
    # float32-state run (stored as 0, v would restart from 1e-15 at step 2:
    # m / sqrt(v) ~ 270 instead of ~3).
    grads = [[1.0, 1e-4], [1.0, 0.0], [1.0, 1e-6]]
    kw = dict(learning_rate=1e-3, weight_decay=0.0)
    for run in (_jax_run, _torch_run):
        ref, _ = run(grads, [1.0, 1.0], **kw)
        low, _ = run(grads, [1.0, 1.0], nu_dtype="float8_e4m3fn", **kw)
        assert 1.0 - _f32(low)[1] <= 1.0 - _f32(ref)[1] + 1e-7, run.__name__


# ---------------------------------------------------------------- resume
def _jax_loss(params, batch):
    return jnp.mean((batch @ params["w"].astype(jnp.float32)) ** 2)


def _jax_state(lr=1e-3, mode="stochastic", moments=("bfloat16", "bfloat16")):
    tx = jtx.stable_optimizer(
        jtx.low_precision_adamw(
            lr, mu_dtype=moments[0], nu_dtype=moments[1], param_update=mode
        )
    )
    params = {"w": jnp.linspace(0.5, 1.5, 8, dtype=jnp.bfloat16)}
    return jtrain.TrainState.create(
        params=params, optimizer=tx, loss_scale=jls.NoOpLossScale()
    )


def _batches(n):
    rng = np.random.default_rng(1)
    return [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(n)]


@functools.cache
def _jax_step():
    return jtrain.make_train_step(_jax_loss)


# The stochastic run (its key) and a Kahan run with float8 moments (their
# per-tensor scales, the compensation buffers, float8 arrays in a checkpoint).
RESUMES = [("stochastic", ("bfloat16", "bfloat16")), ("kahan", FLOAT8)]


@pytest.mark.parametrize("mode,moments", RESUMES)
def test_jax_resume_mid_run_is_bitwise(tmp_path, mode, moments):
    step = _jax_step()
    batches = _batches(6)
    state = _jax_state(mode=mode, moments=moments)
    for i, b in enumerate(batches):
        state, _ = step(state, b)
        if i == 2:
            jtrain.save_checkpoint(tmp_path / "ckpt", state)
    blank = _jax_state(mode=mode, moments=moments)
    resumed = jtrain.load_checkpoint(tmp_path / "ckpt", blank)
    for b in batches[3:]:
        resumed, _ = step(resumed, b)
    jax.tree.map(np.testing.assert_array_equal, state.params, resumed.params)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)),
        state.opt_state,
        resumed.opt_state,
    )
    # ...and the key did move: another key gives other parameters.
    assert not np.array_equal(_f32(state.params["w"]), _f32(_jax_state().params["w"]))


def _torch_step(lr=1e-3, mode="stochastic", moments=("bfloat16", "bfloat16")):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(0.5, 1.5, 8))
    opt = ttx.low_precision_adamw(
        model.parameters(),
        lr,
        mu_dtype=moments[0],
        nu_dtype=moments[1],
        param_update=mode,
    )

    def loss_fn(m, batch):
        return (m(batch.to(torch.bfloat16)).float() ** 2).mean()

    return ttrain.TrainStep(model, opt, loss_fn)


@pytest.mark.parametrize("mode,moments", RESUMES)
def test_torch_resume_mid_run_is_bitwise(tmp_path, mode, moments):
    batches = [torch.from_numpy(b) for b in _batches(6)]
    step = _torch_step(mode=mode, moments=moments)
    for i, b in enumerate(batches):
        step(b)
        if i == 2:
            ttrain.save_checkpoint(tmp_path / "ckpt.pt", step)
    resumed = ttrain.load_checkpoint(
        tmp_path / "ckpt.pt", _torch_step(mode=mode, moments=moments)
    )
    for b in batches[3:]:
        resumed(b)
    assert torch.equal(step.model.weight, resumed.model.weight)
    a, b = step.optimizer.state_dict(), resumed.optimizer.state_dict()
    for pid, st in a["state"].items():
        for k, v in st.items():
            other = b["state"][pid][k]
            assert (
                torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other
            ), k
            if isinstance(v, torch.Tensor):
                assert v.dtype == other.dtype, k


def test_the_shared_examples_run():
    # RoundingStats and StallMonitor live once in _stablecore (both packages
    # re-export them); tests/test_doctests.py runs the packages' own modules.
    import doctest

    from _stablecore import low_precision

    result = doctest.testmod(low_precision, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


def test_jax_step_has_no_conditional_and_no_host_transfer():
    step = _jax_step()
    state, batch = _jax_state(), jnp.asarray(_batches(1)[0])
    assert not has_conditional(step.lower(state, batch))
    with jax.transfer_guard("disallow"):
        state, metrics = step(state, batch)
    assert set(jtx.RoundingStats._fields) <= set(metrics)


def test_a_stall_reaches_the_records_and_warns_in_both():
    # lr = 1e-6 on bfloat16 weights in [0.5, 1.5]: every update is far
    # below half an ulp; after StallMonitor's 50 steps fit warns.
    batches = _batches(1) * 50
    step = _jax_step()
    with pytest.warns(RuntimeWarning, match="rounding lost more than 50%"):
        _, hist = jtrain.fit(_jax_state(1e-6, "nearest"), step, batches, progress=False)
    assert [h["lost_update"] for h in hist] == [1.0] * 50
    assert hist[-1]["lost_params"] == 1.0
    with pytest.warns(RuntimeWarning, match="rounding lost more than 50%"):
        hist = ttrain.fit(
            _torch_step(1e-6, "nearest"),
            [torch.from_numpy(b) for b in batches],
            progress=False,
        )
    assert [h["lost_update"] for h in hist] == [1.0] * 50
    # Kahan keeps most: no warning. Not all: 1e-6 is 2**-20 of a weight,
    # and the bfloat16 buffer (up to half an ulp, 2**-9) holds it to 2**-17.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        hist = ttrain.fit(
            _torch_step(1e-6, "kahan"),
            [torch.from_numpy(b) for b in batches],
            progress=False,
        )
    assert max(h["lost_update"] for h in hist) < 0.2


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mu_dtype": "int8"}, r"mu_dtype must be one of .*'float8_e4m3fn'.*'int8'"),
        ({"nu_dtype": "float64"}, r"nu_dtype must be one of .*got 'float64'"),
        ({"param_update": "round"}, r"param_update must be one of .*'kahan'.*'round'"),
        ({"eps": -1.0}, r"eps must be a float >= 0.0, got -1.0"),
        ({"weight_decay": float("nan")}, r"weight_decay must be a float >= 0.0"),
        ({"seed": 1.5}, r"seed must be an int, got 1.5"),
    ],
)
def test_bad_options_are_named_in_both(kw, match):
    with pytest.raises(ValueError, match=match):
        jtx.low_precision_adamw(1e-3, **kw)
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=match):
        ttx.low_precision_adamw([w], 1e-3, **kw)


def test_stochastic_rounding_refuses_float16_parameters_in_both():
    match = r"param_update='stochastic' .* got float16 at"
    tx = jtx.low_precision_adamw(1e-3, param_update="stochastic")
    with pytest.raises(ValueError, match=match + r" \['w'\]"):
        tx.init({"w": jnp.ones(2, jnp.float16)})
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=match + " parameter 0"):
        ttx.low_precision_adamw([w], 1e-3, param_update="stochastic")


@pytest.mark.parametrize("moments", [("float32", "bfloat16"), FLOAT8])
def test_per_tensor_scales_only_for_the_narrow_formats(moments):
    # float16 and float8 need a per-tensor scale for their narrow exponent
    # range; float32 and bfloat16 (the same exponent range) would hold a
    # scale of 1 per tensor: 8 bytes per tensor for nothing. The state's
    # bytes then do not grow with the number of tensors, only with entries.
    scaled = [d for d in moments if d in FLOAT8]
    kw = dict(mu_dtype=moments[0], nu_dtype=moments[1], param_update="kahan")

    def jax_bytes(tensors):
        p = {str(i): jnp.ones(64 // tensors, jnp.bfloat16) for i in range(tensors)}
        state = jtx.low_precision_adamw(1e-3, **kw).init(p)
        assert (state.mu_scale == ()) == (moments[0] not in FLOAT8)
        assert (state.nu_scale == ()) == (moments[1] not in FLOAT8)
        return sum(x.nbytes for x in jax.tree.leaves(state))

    assert jax_bytes(8) - jax_bytes(1) == 7 * 4 * len(scaled)
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = ttx.low_precision_adamw([w], 1e-3, **kw)
    w.grad = torch.ones_like(w)
    opt.step()
    held = {k for k in opt.state[w] if k.endswith("_scale")}
    assert held == {
        name + "_scale"
        for name, d in zip(("mu", "nu"), moments, strict=True)
        if d in FLOAT8
    }
