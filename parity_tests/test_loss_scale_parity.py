"""DynamicLossScale vs the real torch.amp.GradScaler("cpu"): equal scales, bit for bit.

GradScaler is driven the way a training loop drives it (scale -> backward ->
unscale_ -> step -> update) on a one-element parameter whose gradient is set to
inf on the chosen steps; jaxstable's scale is advanced with `adjust` under
`lax.scan`. The finite/non-finite sequence is drawn like real overflow: the
higher the scale, the likelier a non-finite step, so the scale wanders over
many octaves without falling below min_loss_scale (GradScaler has no floor).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxstable import loss_scale as jls


def _overflow_like_sequence(n, *, init, factor, period, lo, hi, seed):
    """Finite flags whose non-finite rate rises with the (simulated) scale."""
    rng = np.random.default_rng(seed)
    log_s, counter, flags = np.log(init), 0, []
    for _ in range(n):
        frac = np.clip((log_s - np.log(lo)) / (np.log(hi) - np.log(lo)), 0.0, 1.0)
        ok = bool(rng.random() > 0.02 + 0.6 * frac)
        flags.append(ok)
        if ok:
            counter += 1
            if counter == period:
                counter, log_s = 0, log_s + np.log(factor)
        else:
            counter, log_s = 0, log_s - np.log(factor)
    return np.array(flags)


def _torch_scales(flags, *, init, factor, period):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init,
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=period,
    )
    out = np.empty(len(flags), np.float32)
    for i, ok in enumerate(flags):
        opt.zero_grad(set_to_none=False)
        scaler.scale(p.sum()).backward()
        if not ok:
            p.grad.fill_(float("inf"))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        out[i] = scaler.get_scale()  # a Python float of the float32 tensor
    return out


@jax.jit
def _jax_scales(ls, flags):
    def body(ls, ok):
        ls = ls.adjust(ok)
        return ls, ls.loss_scale

    return jax.lax.scan(body, ls, flags)


@pytest.mark.parametrize(
    ("factor", "period", "init", "n"),
    [
        (2, 7, 2.0**16, 5000),  # small period: thousands of growths and backoffs
        (2, 2000, 2.0**16, 4200),  # GradScaler's defaults
        (3, 3, 1000.3, 3000),  # non-power-of-two factor and scale
        (1.5, 2, 12345.678, 3000),  # 1/1.5 is inexact in float32 and float64
    ],
)
def test_dynamic_loss_scale_matches_grad_scaler_bit_for_bit(factor, period, init, n):
    if period == 2000:
        flags = np.ones(n, bool)
        flags[[10, 11, 2100]] = False  # back off, grow (2011), back off, grow (4100)
        ls = jls.DynamicLossScale()  # defaults must equal GradScaler's
    else:
        flags = _overflow_like_sequence(
            n, init=init, factor=factor, period=period, lo=2.0**4, hi=2.0**40, seed=n
        )
        ls = jls.DynamicLossScale(loss_scale=init, period=period, factor=factor)
    expected = _torch_scales(flags, init=init, factor=factor, period=period)
    assert expected.min() >= 1.0  # min_loss_scale never binds: a fair comparison
    final, got = _jax_scales(ls, jnp.asarray(flags))
    got = np.asarray(got)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    # The comparison covered both directions many times.
    changes = np.diff(np.concatenate([[np.float32(init)], expected]))
    assert (changes > 0).sum() >= (2 if period == 2000 else 50)
    assert (changes < 0).sum() >= (2 if period == 2000 else 50)
    assert float(final.loss_scale) == expected[-1]


def test_growth_stops_below_float32_overflow_like_grad_scaler():
    # period 1 from 2**120: growth would pass float32's max 3.4e38 = 2**128;
    # GradScaler keeps the scale (and resets its tracker) instead of going inf.
    flags = np.ones(40, bool)
    flags[[20, 21, 30]] = False
    expected = _torch_scales(flags, init=2.0**120, factor=2, period=1)
    assert expected.max() == np.float32(2.0**127)
    ls = jls.DynamicLossScale(loss_scale=2.0**120, period=1, factor=2)
    _, got = _jax_scales(ls, jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_unscale_matches_grad_scaler_unscale_():
    # GradScaler unscales by multiplying with float32(1/scale) taken in float64.
    grads = np.random.default_rng(0).standard_normal(257).astype(np.float32) * 1e3
    for scale in (2.0**16, 1000.3, 3.0):
        p = torch.nn.Parameter(torch.zeros(257))
        opt = torch.optim.SGD([p], lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        scaler.scale(torch.zeros(())).to(torch.float32)  # initialise the scale
        p.grad = torch.from_numpy(grads) * scaler.get_scale()
        scaled = p.grad.numpy().copy()
        scaler.unscale_(opt)
        got = jls.StaticLossScale(scale).unscale(jnp.asarray(scaled))
        np.testing.assert_array_equal(np.asarray(got), p.grad.numpy())
