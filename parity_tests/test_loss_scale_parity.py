"""DynamicLossScale vs the real torch.amp.GradScaler("cpu"): equal scales, bit for bit.

GradScaler is driven the way a training loop drives it (scale -> backward ->
unscale_ -> step -> update) on a one-element parameter whose gradient is set to
inf on the chosen steps; jaxstable's scale is advanced with `adjust` under
`lax.scan`. The finite/non-finite sequence is drawn like real overflow: the
higher the scale, the likelier a non-finite step, so the scale wanders over
many octaves without falling below min_loss_scale (GradScaler has no floor).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxstable import loss_scale as jls
from torchref import loss_scale as tls


def _overflow_like_sequence(n, *, init, factor, period, lo, hi, seed, backoff=None):
    """Finite flags whose non-finite rate rises with the (simulated) scale."""
    down = -np.log(factor) if backoff is None else np.log(backoff)
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
            counter, log_s = 0, log_s + down
    return np.array(flags)


def _torch_scales(flags, *, init, factor, period, backoff=None):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init,
        growth_factor=factor,
        backoff_factor=1.0 / factor if backoff is None else backoff,
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


@pytest.mark.parametrize(
    ("growth", "backoff", "period"),
    [
        (1.1, 1.0 / 1.1, 2),  # the issue's: 65536 * (1/1.1) = 59578.184
        (2.0, 0.25, 3),  # GradScaler's own tests' pair, not a reciprocal
        (1.01, 0.99, 1),  # near 1: thousands of inexact products
        (1.7, 0.3, 2),
    ],
)
def test_any_growth_and_backoff_match_grad_scaler_bit_for_bit(growth, backoff, period):
    # Before: the backoff was tied to 1/factor and the product was taken in
    # float32 (factor rounded to float32): 59578.18 instead of 59578.184 at
    # the first back-off, and thousands of steps off over 3,000.
    n = 1500
    flags = _overflow_like_sequence(
        n,
        init=65536.0,
        factor=growth,
        backoff=backoff,
        period=period,
        lo=2.0**4,
        hi=2.0**40,
        seed=7,
    )
    expected = _torch_scales(
        flags, init=65536.0, factor=growth, period=period, backoff=backoff
    )
    assert expected.min() >= 1.0
    kwargs = dict(period=period, growth_factor=growth, backoff_factor=backoff)
    _, got = _jax_scales(jls.DynamicLossScale(**kwargs), jnp.asarray(flags))
    np.testing.assert_array_equal(np.asarray(got), expected)
    # torchref's loss scale builds the same GradScaler.
    scaler = tls.DynamicLossScale(**kwargs).make_scaler("cpu")
    ref = torch.amp.GradScaler("cpu", growth_factor=growth, backoff_factor=backoff)
    assert scaler.get_growth_factor() == ref.get_growth_factor()
    assert scaler.get_backoff_factor() == ref.get_backoff_factor()
    assert len(set(expected.tolist())) > 10  # many distinct products compared


def test_first_backoff_of_factor_1_1_is_torchs_59578_184():
    flags = np.array([False])
    expected = _torch_scales(flags, init=65536.0, factor=1.1, period=2000)
    assert expected[0] == np.float32(59578.184)
    for ls in (
        jls.DynamicLossScale(factor=1.1),  # jmp's spelling: backoff 1/1.1
        jls.DynamicLossScale(growth_factor=1.1, backoff_factor=1 / 1.1),
    ):
        assert float(ls.adjust(jnp.asarray(False)).loss_scale) == expected[0]


def test_a_floor_at_float32_smallest_normal_holds_and_recovers():
    # min_loss_scale = 2**-126: backing off reaches it exactly (torch clamps,
    # XLA would flush anything smaller to 0) and growth starts again from it.
    flags = np.array([False] * 8 + [True] * 4)
    init, floor = 2.0**-120, 2.0**-126
    s = tls.DynamicLossScale(loss_scale=init, min_loss_scale=floor, period=2)
    scaler = s.make_scaler("cpu")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    expected = []
    for ok in flags:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if not ok:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        expected.append(scaler.get_scale())
    ls = jls.DynamicLossScale(loss_scale=init, min_loss_scale=floor, period=2)
    _, got = _jax_scales(ls, jnp.asarray(flags))
    assert np.asarray(got).tolist() == expected
    assert min(expected) == floor and expected[-1] == 2.0**-124


def test_unscale_at_a_scale_of_2_to_the_127_matches_grad_scaler():
    # GradScaler grows to 2**127 (test above); its reciprocal is a float32
    # subnormal, which XLA flushes to 0: every gradient came out 0.
    grads = np.array([1.5, -1.25, 2.0**-20, 0.75], np.float32)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    scaler.scale(torch.zeros(()))
    scaled = (grads.astype(np.float64) * 2.0**127).astype(np.float32)
    assert np.isfinite(scaled).all()
    p.grad = torch.from_numpy(scaled.copy())
    scaler.unscale_(opt)
    for ls in (jls.StaticLossScale(2.0**127), jls.DynamicLossScale(2.0**127)):
        got = np.asarray(jax.jit(ls.unscale)(jnp.asarray(scaled)))
        np.testing.assert_array_equal(got, p.grad.numpy())
    np.testing.assert_array_equal(p.grad.numpy(), grads)


# One table for both packages: the same argument gets the same message.
BAD_ARGUMENTS = [
    (dict(min_loss_scale=1e-40), "min_loss_scale must be a float32 normal number"),
    (dict(min_loss_scale=2.0**-140), "min_loss_scale must be a float32 normal"),
    (dict(loss_scale=1e39), "loss_scale must be a float32 normal number"),
    (dict(period=2**31), r"period must be < 2\*\*31 \(its counter is an int32"),
    (dict(hysteresis=2**31), r"hysteresis must be < 2\*\*31"),
    (dict(growth_factor=1.0), "growth_factor must be a finite number > 1, got 1.0"),
    (dict(backoff_factor=1.0), "backoff_factor must be a number with 0 < backoff"),
    (dict(backoff_factor=0.0), "backoff_factor must be a number with 0 < backoff"),
    (dict(backoff_factor=True), "backoff_factor must be a number with 0 < backoff"),
    (dict(factor=3.0, growth_factor=2.0), "factor=3.0 and growth_factor=2.0 disagree"),
    (dict(loss_scale=True), "loss_scale must be a finite number > 0, got True"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_ARGUMENTS)
def test_bad_loss_scale_arguments_same_message_in_both(kwargs, match):
    messages = []
    for cls in (jls.DynamicLossScale, tls.DynamicLossScale):
        with pytest.raises(ValueError, match=match) as info:
            cls(**kwargs)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    if set(kwargs) == {"loss_scale"}:
        for cls in (jls.StaticLossScale, tls.StaticLossScale):
            with pytest.raises(ValueError, match=match):
                cls(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(loss_scale=2**16), dict(min_loss_scale=1), dict(loss_scale=2**24 + 1)],
)
def test_an_integer_scale_warns_in_both_with_its_float32_value(kwargs):
    # jmp warns too ("Expected floating type"); 2**24 + 1 is not a float32.
    name, value = next(iter(kwargs.items()))
    expected = f"{name}={value} is an integer; it is used as the float32 "
    texts = []
    for cls in (jls.DynamicLossScale, tls.DynamicLossScale):
        with pytest.warns(UserWarning, match=expected) as record:
            ls = cls(**kwargs)
        texts.append(str(record[0].message))
        if cls is jls.DynamicLossScale:
            assert float(getattr(ls, name)) == float(np.float32(value))
        elif name == "loss_scale":  # torch's GradScaler rounds it the same
            scaler = ls.make_scaler()
            scaler.scale(torch.zeros(()))  # creates the float32 scale tensor
            assert scaler.get_scale() == float(np.float32(value))
    assert texts[0] == texts[1]
    assert texts[0].endswith(
        f"{float(np.float32(value))!r}: pass a float to silence this warning"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jls.DynamicLossScale(loss_scale=65536.0)
        tls.DynamicLossScale(loss_scale=65536.0)
