"""`fit`'s public surface in both frameworks (issue 34): at most 10
parameters, NaN policies, checkpointing and logging as values, evaluation
as one pair, and the old keywords still working for one release with a
DeprecationWarning naming the new form."""

from __future__ import annotations

import doctest
import inspect
import warnings

import jax.numpy as jnp
import optax
import pytest
import torch

from _stablecore import fit as core_fit
from _stablecore import nan_policy
from jaxstable import train as jtrain
from jaxstable import transforms as jtx
from torchref import train as ttrain

TRAINS = {"jax": jtrain, "torch": ttrain}


_JSTEP = jtrain.make_train_step(lambda p, b: jnp.sum((p - b) ** 2))


def _fit(framework, data, **kw):
    """The history of a tiny fit (y = x @ w) in `framework`."""
    if framework == "jax":
        state = jtrain.TrainState.create(
            params=jnp.zeros(2), optimizer=jtx.stable_optimizer(optax.sgd(0.1))
        )
        step = _JSTEP
        return jtrain.fit(state, step, [jnp.asarray(b) for b in data], **kw)[1]
    model = torch.nn.Linear(2, 1, bias=False)
    step = ttrain.TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: ((m.weight[0] - b) ** 2).sum(),
    )
    return ttrain.fit(step, [torch.tensor(b) for b in data], **kw)


DATA = [[1.0, 1.0], [float("nan"), 1.0], [1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("framework", sorted(TRAINS))
def test_fit_takes_at_most_ten_parameters(framework):
    params = inspect.signature(TRAINS[framework].fit).parameters
    assert len(params) <= 10, list(params)
    assert "nan_policy" in params and "max_consecutive_nonfinite" not in params


def test_both_packages_export_the_same_values():
    for name in ("NanPolicy", "Checkpointing", "Log"):
        assert getattr(jtrain, name) is getattr(ttrain, name)


@pytest.mark.parametrize("framework", sorted(TRAINS))
@pytest.mark.parametrize(
    "old, new",
    [
        (
            dict(nan_policy="rollback", max_consecutive_nonfinite=1, rollback_every=2),
            "nan_policy=NanPolicy.rollback(max_consecutive=1, every=2)",
        ),
        (dict(stop_after_nonfinite=1), "nan_policy=NanPolicy.skip(stop_after=1)"),
        (dict(eval_fn=lambda s: {}, eval_every=2), "evaluate=(eval_fn, every)"),
        (dict(progress=False), "pass log=None"),
    ],
    ids=["policy", "stop_after", "eval", "log"],
)
def test_old_keywords_warn_naming_the_new_form_and_still_work(framework, old, new):
    train = TRAINS[framework]
    kw = dict(old)
    new_kw = dict(log=None)
    if "nan_policy" in kw or "stop_after_nonfinite" in kw:
        new_kw["nan_policy"] = eval(
            new.split("=", 1)[1], {"NanPolicy": train.NanPolicy}
        )
    if "eval_fn" in kw:
        new_kw["evaluate"] = (kw["eval_fn"], kw["eval_every"])
    if "progress" not in kw:
        kw["log"] = None
    with pytest.warns(DeprecationWarning, match="deprecated") as caught:
        hist = _fit(framework, DATA, **kw)
    assert any(new in str(w.message) for w in caught), [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form: no warning
        again = _fit(framework, DATA, **new_kw)
    assert [r["step"] for r in again] == [r["step"] for r in hist]
    assert [r["finite"] for r in again] == [r["finite"] for r in hist]


@pytest.mark.parametrize("framework", sorted(TRAINS))
def test_old_checkpoint_keywords_warn_and_resume(framework, tmp_path):
    with pytest.warns(DeprecationWarning, match=r"checkpoint=Checkpointing\("):
        _fit(framework, DATA[:2], checkpoint_dir=tmp_path, log=None)
    with pytest.warns(DeprecationWarning, match=r"checkpoint=Checkpointing\("):
        hist = _fit(framework, DATA, checkpoint_dir=tmp_path, resume=True, log=None)
    assert [r["step"] for r in hist] == [2, 3]


@pytest.mark.parametrize("framework", sorted(TRAINS))
@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(nan_policy="skip"), DeprecationWarning, None),
        (dict(nan_policy=3), TypeError, "nan_policy must be a NanPolicy"),
        (dict(evaluate=lambda s: {}), TypeError, r"evaluate must be None or a pair"),
        (dict(evaluate=(lambda s: {}, 0)), ValueError, "evaluate's every must be"),
        (dict(log=3), TypeError, "log must be None, a path or a Log"),
        (dict(checkpoint=3), TypeError, "checkpoint must be None, a directory"),
        (
            dict(nan_policy=jtrain.NanPolicy.rollback(to="disk")),
            ValueError,
            r"restores from disk: it needs checkpoint=",
        ),
        (
            dict(nan_policy=jtrain.NanPolicy.stop(), max_consecutive_nonfinite=2),
            TypeError,
            "belong to the old form",
        ),
    ],
)
def test_bad_arguments_are_named(framework, kw, error, match):
    kw = {"log": None, **kw}
    if error is DeprecationWarning:
        with pytest.warns(DeprecationWarning):
            _fit(framework, DATA[:1], **kw)
        return
    with pytest.raises(error, match=match):
        _fit(framework, DATA[:1], **kw)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda P: P.rewind(after=3, window=2), r"window \(2\) must be >= after"),
        (lambda P: P.rollback(to="tape"), "NanPolicy.rollback: to must be one of"),
        (lambda P: P.rollback(every=0), "NanPolicy.rollback: every must be"),
        (lambda P: P.skip(stop_after=-1), "NanPolicy.skip: stop_after must be"),
    ],
)
def test_bad_policies_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make(jtrain.NanPolicy)


def test_a_policy_shows_the_call_that_makes_it():
    P = jtrain.NanPolicy
    assert repr(P.skip()) == "NanPolicy.skip()"
    assert repr(P.rewind(after=2, skip=1)) == "NanPolicy.rewind(after=2, skip=1)"
    assert P.rollback(max=5) == P.rollback(max=5) != P.rollback()


@pytest.mark.parametrize("module", [nan_policy, core_fit])
def test_the_shared_values_docstring_examples_run(module):
    # The values live once in _stablecore (both packages re-export them):
    # tests/test_doctests.py runs the packages' own modules only.
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False)
    assert result.attempted and not result.failed
