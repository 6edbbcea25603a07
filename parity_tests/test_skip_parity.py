"""skip_non_finite vs GradScaler skipping optimizer.step() on a non-finite step.

Both sides see the same gradients (some steps poisoned with NaN/Inf). torch:
Adam stepped through GradScaler (which skips `optimizer.step()` when the
unscaled grads hold an inf/NaN); JAX: `skip_non_finite(optax.adam)`. After
every step the Adam moments, step count and params agree, and on a skipped
step both sides leave them exactly as they were.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from conftest import torch_device
from jaxstable import loss_scale as jls
from jaxstable import transforms

_POISON = {3: np.nan, 4: np.inf, 9: -np.inf}
_STEPS = 14
DEV = torch_device()  # CUDA when present: both frameworks on the GPU


def _grad_sequence():
    rng = np.random.default_rng(0)
    seq = []
    for i in range(_STEPS):
        g = {
            "w": rng.standard_normal((4, 3)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float32),
        }
        if i in _POISON:
            g["w"][1, 2] = _POISON[i]
        seq.append(g)
    return seq


def test_skip_matches_grad_scaler_skipped_step(tol):
    seq = _grad_sequence()
    init = {"w": np.full((4, 3), 0.5, np.float32), "b": np.zeros(3, np.float32)}

    # torch: the real GradScaler decides to skip optimizer.step().
    tparams = {
        k: torch.nn.Parameter(torch.from_numpy(v.copy()).to(DEV))
        for k, v in init.items()
    }
    opt = torch.optim.Adam(tparams.values(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**4)

    # JAX: the same Adam inside skip_non_finite, with the same loss scale.
    tx = transforms.skip_non_finite(optax.adam(1e-2))
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state = tx.init(params)
    ls = jls.DynamicLossScale(loss_scale=2.0**4)

    @jax.jit
    def jstep(params, state, ls, g):
        grads = ls.unscale(ls.scale(g))
        finite = jls.all_finite(grads)
        updates, state = tx.update(grads, state, params, grads_finite=finite)
        return optax.apply_updates(params, updates), state, ls.adjust(finite), finite

    for i, g in enumerate(seq):
        before_t = {
            k: (p.detach().clone(), dict(opt.state.get(p, {})))
            for k, p in tparams.items()
        }
        before_j = (params, state)

        opt.zero_grad()
        loss = sum((tparams[k] * torch.from_numpy(g[k]).to(DEV)).sum() for k in tparams)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        params, state, ls, finite = jstep(params, state, ls, g)

        bad = i in _POISON
        assert bool(finite) == (not bad)
        assert int(state.skipped_total) == sum(j <= i for j in _POISON)
        assert float(ls.loss_scale) == scaler.get_scale()
        adam = state.inner_state[0]
        if bad:
            # Nothing moved on either side.
            for k, p in tparams.items():
                torch.testing.assert_close(p.detach(), before_t[k][0], rtol=0, atol=0)
                st = opt.state.get(p, {})
                assert set(st) == set(before_t[k][1])
                for name, v in st.items():
                    assert torch.equal(v, before_t[k][1][name]), name
            jax.tree.map(
                np.testing.assert_array_equal,
                (params, state.inner_state),
                (before_j[0], before_j[1].inner_state),
            )
        # Same Adam state and params as torch after every step.
        for k, p in tparams.items():
            st = opt.state[p]
            assert int(st["step"].item()) == int(adam.count)
            np.testing.assert_allclose(
                np.asarray(adam.mu[k]), st["exp_avg"].cpu().numpy(), **tol("float32")
            )
            np.testing.assert_allclose(
                np.asarray(adam.nu[k]), st["exp_avg_sq"].cpu().numpy(), **tol("float32")
            )
            np.testing.assert_allclose(
                np.asarray(params[k]), p.detach().cpu().numpy(), **tol("float32")
            )
    assert int(adam.count) == _STEPS - len(_POISON)
