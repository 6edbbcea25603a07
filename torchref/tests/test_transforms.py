"""torchref.transforms: clipping equals clip_grad_norm_, float32 norms for
half grads, and skipped steps leave params and optimizer state untouched."""

import copy
import math

import pytest
import torch

from torchref import transforms as tr


def _params_with_grads(scale, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for shape in [(4, 3), (3,), (2, 2, 2)]:
        p = torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
        p.grad = (scale * torch.randn(*shape, generator=g)).to(dtype)
        ps.append(p)
    return ps


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_clip_equals_clip_grad_norm_bit_for_bit(scale):
    a = _params_with_grads(scale)
    b = copy.deepcopy(a)
    for p, q in zip(a, b, strict=True):
        q.grad = p.grad.clone()
    norm = tr.clip_by_global_norm(1.0)(a)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert norm.dtype == torch.float32
    assert torch.equal(norm, ref)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.grad, q.grad)


def test_clip_with_other_eps_uses_the_same_formula(tol):
    ps = _params_with_grads(10.0)
    before = [p.grad.clone() for p in ps]
    norm = tr.clip_by_global_norm(2.0, eps=0.5)(ps)
    coef = 2.0 / (float(norm) + 0.5)
    assert coef < 1
    for p, g in zip(ps, before, strict=True):
        torch.testing.assert_close(p.grad, g * coef, **tol("float32"))


def test_clip_accepts_a_module_and_leaves_small_grads_alone():
    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().mul(1e-3).backward()
    before = [p.grad.clone() for p in m.parameters()]
    tr.clip_by_global_norm(10.0)(m)
    assert all(
        torch.equal(p.grad, g) for p, g in zip(m.parameters(), before, strict=True)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_grads_of_300_norm_finite_and_correct(dtype, tol):
    n = 1000
    g = torch.full((n,), 300.0, dtype=dtype)  # 300**2 = 9e4 > fp16 max 65504
    norm = tr.global_norm([g, g[:10]])
    assert norm.dtype == torch.float32
    expected = torch.tensor(math.sqrt(1010) * 300.0)
    torch.testing.assert_close(norm, expected, **tol("float32"))
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    p.grad = g.clone()
    pre = tr.clip_by_global_norm(1.0)([p])
    torch.testing.assert_close(
        pre, torch.tensor(math.sqrt(n) * 300.0), **tol("float32")
    )
    assert p.grad.dtype == dtype and bool(torch.isfinite(p.grad).all())
    clipped = tr.global_norm([p.grad])
    torch.testing.assert_close(clipped, torch.tensor(1.0), **tol(str(dtype)[6:]))


def test_global_norm_edge_cases():
    assert float(tr.global_norm([])) == 0.0
    assert math.isinf(float(tr.global_norm([torch.tensor([1.0, float("inf")])])))
    assert math.isnan(float(tr.global_norm([torch.tensor([float("nan")])])))
    f64 = tr.global_norm(torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert f64.dtype == torch.float32 and float(f64) == 5.0


@pytest.mark.parametrize("bad", [0, -1.0, True, "1"])
def test_clip_rejects_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm must be"):
        tr.clip_by_global_norm(bad)


def test_clip_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        tr.clip_by_global_norm(1.0, eps=-1.0)


def _adam_setup(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _backward(m, x):
    m.zero_grad()
    m(x).pow(2).mean().backward()


def test_skip_matches_gradscaler_skip_and_keeps_adam_state():
    good, bad = torch.ones(3, 4), torch.full((3, 4), float("nan"))
    m1, o1 = _adam_setup()
    opt = tr.skip_non_finite(o1, max_consecutive=1)
    m2, o2 = _adam_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    for i, x in enumerate([good, bad, bad, good]):
        _backward(m1, x)
        state_before = copy.deepcopy(o1.state_dict())
        params_before = [p.detach().clone() for p in m1.parameters()]
        opt.step()
        scaler.scale(m2(x).pow(2).mean()).backward()
        scaler.step(o2)
        scaler.update()
        o2.zero_grad()
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(p, q)
        if i in (1, 2):  # skipped: nothing moved, Adam's step count included
            assert all(
                torch.equal(p, q)
                for p, q in zip(m1.parameters(), params_before, strict=True)
            )
            after = o1.state_dict()["state"]
            for k, st in state_before["state"].items():
                assert all(torch.equal(st[n], after[k][n]) for n in st)
    st = opt.skip_state
    assert (st.skipped_total, st.consecutive, st.last_finite) == (2, 0, True)
    assert float(o1.state_dict()["state"][0]["step"]) == 2.0


def test_skip_counters_and_exceeded():
    m, o = _adam_setup()
    opt = tr.skip_non_finite(o, max_consecutive=1)
    bad = torch.full((1, 4), float("inf"))
    flags = []
    for _ in range(3):
        _backward(m, bad)
        opt.step()
        flags.append((opt.skip_state.consecutive, opt.skip_state.exceeded))
    assert flags == [(1, False), (2, True), (3, True)]
    assert opt.state == {}  # Adam never initialised its moments
    _backward(m, torch.ones(1, 4))
    opt.step()
    assert (opt.skip_state.consecutive, opt.skip_state.exceeded) == (0, False)


def test_skip_reuses_given_flag():
    m, o = _adam_setup()
    opt = tr.skip_non_finite(o)
    _backward(m, torch.ones(2, 4))
    before = [p.detach().clone() for p in m.parameters()]
    opt.step(grads_finite=False)  # caller's flag is trusted, not recomputed
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=True))
    assert opt.skip_state.skipped_total == 1


def test_skip_rejects_bad_args():
    m, o = _adam_setup()
    with pytest.raises(ValueError, match="max_consecutive must be None or an int >= 0"):
        tr.skip_non_finite(o, max_consecutive=-1)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        tr.skip_non_finite(m)


def test_stable_optimizer_clips_then_steps_and_skips():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = tr.stable_optimizer(torch.optim.SGD([w], lr=1.0), max_grad_norm=1.0)
    w.grad = torch.tensor([30.0, 40.0])
    opt.step()
    assert float(opt.grad_norm) == 50.0
    ref = torch.nn.Parameter(torch.zeros(2))
    ref.grad = torch.tensor([30.0, 40.0])
    torch.nn.utils.clip_grad_norm_([ref], 1.0)
    assert torch.equal(w.detach(), -ref.grad)  # SGD lr=1 on the clipped grad
    w.grad = torch.tensor([float("nan"), 1.0])
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w.detach(), before)
    assert math.isnan(float(opt.grad_norm))
    assert tr.find_skip_state(opt).skipped_total == 1


def test_stable_optimizer_without_skip_has_no_skip_state():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = tr.stable_optimizer(torch.optim.SGD([w], lr=1.0), skip_non_finite=False)
    assert tr.find_skip_state(opt) is None
    assert tr.find_skip_state(torch.optim.SGD([w], lr=1.0)) is None


def test_wrapper_state_dict_round_trip():
    m, o = _adam_setup()
    opt = tr.skip_non_finite(o)
    _backward(m, torch.full((1, 4), float("nan")))
    opt.step()
    _backward(m, torch.ones(1, 4))
    opt.step()
    _, o2 = _adam_setup(seed=1)
    opt2 = tr.skip_non_finite(o2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.skip_state == opt.skip_state
    assert float(o2.state_dict()["state"][0]["step"]) == 1.0


def test_update_check_reuses_its_copy_buffers_from_step_to_step():
    # The copy of params and Adam state taken before each step is written
    # into one flat buffer per (device, dtype), allocated once, not a new
    # set per step.
    # (The device path's buffer; the host path, the default for a non-fused
    # Adam, copies nothing where it proves the update finite.)
    model = torch.nn.Linear(4, 3)
    opt = tr.stable_optimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), decide_on="device"
    )
    seen = []
    for _ in range(5):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        seen.append(dict(opt._guarded._select._flat))
    # float32: weight 12 + bias 3, exp_avg and exp_avg_sq of each, 2 steps
    (buf,) = seen[-1].values()
    assert buf.numel() == 15 + 2 * 15 + 2
    assert all(s == seen[1] for s in seen[1:])  # the same tensor objects
    assert all(next(iter(s.values())) is buf for s in seen[1:])
    assert opt.skip_state.skipped_total == 0


def test_update_check_refuses_sharded_dtensor_params(tmp_path):
    # Each rank would check only its own shard: the step must say so instead.
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        opt = tr.SkipNonFinite(torch.optim.SGD([p], lr=0.1), max_consecutive=None)
        p.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()])
        with pytest.raises(NotImplementedError, match="check_update=False"):
            opt.step()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------- sparse gradients (item 14)
def _embedding(dtype=torch.float32, scale=1.0, indices=(1, 1, 2)):
    """An nn.Embedding(sparse=True) whose backward leaves an UNcoalesced
    sparse gradient (index 1 twice) of `scale` per occurrence."""
    emb = torch.nn.Embedding(4, 2, sparse=True).to(dtype)
    with torch.no_grad():
        emb.weight.fill_(0.5)
    (emb(torch.tensor(indices)).sum() * scale).backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    return emb


def _grad_scaler_finds_inf(opt):
    """GradScaler's own decision (its fp16-aware sparse check), at scale 1."""
    scaler = torch.amp.GradScaler("cpu")
    found = torch.zeros(1)
    out = scaler._unscale_grads_(opt, torch.ones(1), found, allow_fp16=True)
    return bool(sum(v.item() for v in out.values()))


@pytest.mark.parametrize("coalesced", [False, True])
@pytest.mark.parametrize(
    ("dtype", "scale", "finite"),
    [
        (torch.float32, 1.0, True),
        (torch.float32, float("nan"), False),
        # 40000 per occurrence is a finite float16; the two occurrences of
        # index 1 sum to 80000 > 65504 when coalesced (GradScaler coalesces
        # float16 sparse grads for this reason, and so do we for all dtypes).
        (torch.float16, 40000.0, False),
    ],
)
def test_skip_non_finite_with_sparse_grads_decides_like_grad_scaler(
    coalesced, dtype, scale, finite
):
    emb = _embedding(dtype, scale)
    if coalesced:
        emb.weight.grad = emb.weight.grad.coalesce()
    before = emb.weight.detach().clone()
    ref = copy.deepcopy(emb)
    ref.weight.grad = emb.weight.grad.clone()
    assert _grad_scaler_finds_inf(torch.optim.SGD(ref.parameters(), lr=0.1)) == (
        not finite
    )
    opt = tr.skip_non_finite(torch.optim.SGD(emb.parameters(), lr=0.1))
    opt.step()
    assert opt.skip_state.last_finite == finite
    if finite:
        torch.optim.SGD(ref.parameters(), lr=0.1).step()  # the plain step
        assert torch.equal(emb.weight, ref.weight)
    else:
        assert torch.equal(emb.weight.detach(), before)


def test_sparse_grads_norm_and_clip_equal_the_dense_ones(tol):
    # torch's get_total_norm / clip_grad_norm_ raise NotImplementedError on
    # sparse grads; ours use the coalesced values: the dense tensor's norm.
    emb = _embedding(scale=3.0)
    dense = emb.weight.grad.to_dense()
    assert float(tr.global_norm([emb.weight.grad])) == float(dense.norm())
    norm = tr.clip_by_global_norm(1.0)(emb.parameters())
    assert float(norm) == float(dense.norm())
    torch.testing.assert_close(
        emb.weight.grad.to_dense(), dense / dense.norm(), **tol("float32")
    )


def test_sparse_adam_in_stable_optimizer_and_train_step():
    from torchref import loss_scale, train

    emb = _embedding()
    opt = tr.stable_optimizer(
        torch.optim.SparseAdam(emb.parameters(), lr=0.1), max_grad_norm=0.5
    )
    opt.step()
    assert opt.skip_state.last_finite and float(opt.grad_norm) > 0.5
    emb = torch.nn.Embedding(4, 2, sparse=True)
    step = train.TrainStep(
        emb,
        torch.optim.SparseAdam(emb.parameters(), lr=0.1),
        lambda m, b: (m(b[0]) * b[1]).sum(),
        max_grad_norm=0.5,
        scaler=loss_scale.DynamicLossScale(),
    )
    assert step((torch.tensor([1, 1, 2]), 1.0))["finite"]
    before = emb.weight.detach().clone()
    m = step((torch.tensor([1, 1, 2]), float("nan")))
    assert not m["finite"] and torch.equal(emb.weight.detach(), before)


# ------------------------------------------- closure optimizers (item 12)
def _lbfgs_problem():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    target = {"v": torch.tensor([1.0, 2.0])}
    return w, target


def test_lbfgs_needs_a_closure_and_every_evaluation_is_checked():
    w, target = _lbfgs_problem()
    opt = tr.skip_non_finite(torch.optim.LBFGS([w], lr=0.5, max_iter=5))

    def closure():
        opt.zero_grad()
        loss = ((w - target["v"]) ** 2).sum()
        loss.backward()
        return loss

    with pytest.raises(TypeError, match=r"LBFGS.step\(\) re-evaluates the loss"):
        opt.step()
    with pytest.raises(ValueError, match="grads_finite cannot be given"):
        opt.step(closure, grads_finite=True)
    opt.step(closure)
    assert opt.skip_state.last_finite and opt.state
    moved = w.detach().clone()
    saved = copy.deepcopy(opt.optimizer.state_dict())
    target["v"] = torch.tensor([float("nan"), 1.0])
    opt.step(closure)
    assert (opt.skip_state.skipped_total, opt.skip_state.last_grads_finite) == (
        1,
        False,
    )
    assert torch.equal(w.detach(), moved)
    assert str(opt.optimizer.state_dict()) == str(saved)
    target["v"] = torch.tensor([3.0, 1.0])
    opt.step(closure)  # and it goes on
    assert opt.skip_state.last_finite and torch.isfinite(w).all()


def test_lbfgs_refused_with_a_clip_and_by_train_step():
    from torchref import train

    w, _ = _lbfgs_problem()
    with pytest.raises(ValueError, match="max_grad_norm cannot be used with LBFGS"):
        tr.stable_optimizer(torch.optim.LBFGS([w]), max_grad_norm=1.0)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"TrainStep cannot drive LBFGS.*step\(closure"):
        train.TrainStep(model, torch.optim.LBFGS(model.parameters()), lambda m, b: 0)


@pytest.mark.parametrize("wrap", ["skip_non_finite", "stable_optimizer", "skip_spikes"])
@pytest.mark.parametrize("fused", [False, True])
def test_guarded_wrappers_make_no_host_sync(wrap, fused):
    # Issue 24: the check, the clip, the spike window and the skip stay on
    # the device (a fused Adam gets GradScaler's found_inf, any other a
    # torch.where select); skip_state reads the pending flags when it is
    # read, in one transfer. The old wrappers made 2-3 per step (all_finite,
    # the norm's overflow test, the update check), skip_spikes more.
    from torchref.tests.test_train import _syncs_outside_optimizer

    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused or None)
    # decide_on="device": the no-sync path (the default for a fused Adam;
    # a non-fused one reads its flag once per step by default, as
    # GradScaler.step does, which this count would not see: a .tolist()).
    opt = {
        "skip_non_finite": lambda: tr.skip_non_finite(adam, decide_on="device"),
        "stable_optimizer": lambda: tr.stable_optimizer(
            adam, max_grad_norm=1.0, decide_on="device"
        ),
        "skip_spikes": lambda: tr.skip_spikes(
            tr.skip_non_finite(adam, decide_on="device"), window=4, min_history=1
        ),
    }[wrap]()

    def set_grads(value):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)

    set_grads(1.0)
    opt.step()  # creates Adam's state (the one host decision)
    for value, applied in ((1.0, True), (math.nan, False), (math.inf, False)):
        set_grads(value)
        before = [p.detach().clone() for p in model.parameters()]
        state = [t.clone() for s in opt.state.values() for t in s.values()]
        assert _syncs_outside_optimizer(opt.step) == 0
        after = [t for s in opt.state.values() for t in s.values()]
        unchanged = all(
            torch.equal(a, b)
            for a, b in zip(
                [*model.parameters(), *after], [*before, *state], strict=True
            )
        )
        assert unchanged is not applied
    s = opt.skip_state  # the three pending steps, recorded in order
    assert (s.skipped_total, s.consecutive, s.last_finite) == (2, 2, False)


@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("check_update", [False, True])
def test_skipped_first_step_of_fused_sgd_leaves_no_momentum_buffer(check_update, later):
    # Fused SGD's first step allocates its momentum buffers with empty_like
    # and fills them in the kernel; with found_inf set the kernel returns
    # first, so GradScaler's own skip leaves uninitialised memory (seen:
    # 3.5e35) that the next step reads as momentum. The guard must leave no
    # state, as a skipped non-fused step does. later: momentum switched on
    # after steps without (a momentum warm-up).
    w, ref = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.0 if later else 0.9, fused=True)
    opt = tr.skip_non_finite(sgd, check_update=check_update)
    if later:
        w.grad = torch.zeros(3)  # lr * 0: w stays 1
        opt.step()
        sgd.param_groups[0]["momentum"] = 0.9
    w.grad = torch.tensor([1.0, math.nan, 1.0])
    opt.step()
    assert not sgd.state.get(w)
    assert opt.skip_state.skipped_total == 1
    plain = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for _ in range(2):
        w.grad, ref.grad = torch.full((3,), 2.0), torch.full((3,), 2.0)
        opt.step()
        plain.step()
    torch.testing.assert_close(w, ref)
    torch.testing.assert_close(
        sgd.state[w]["momentum_buffer"], plain.state[ref]["momentum_buffer"]
    )


@pytest.mark.parametrize("kind", ["pre", "post", "global_post"])
def test_step_hooks_do_not_run_on_a_skipped_step(kind):
    # GradScaler does not call optimizer.step() on a skipped step, so its
    # hooks (an EMA update, a logger) never see it. The device select runs
    # the step and selects back afterwards: a post hook would copy the NaN
    # parameters the step wrote before they are selected back.
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    seen = []
    if kind == "global_post":
        from torch.optim.optimizer import register_optimizer_step_post_hook as register
    else:
        register = getattr(sgd, f"register_step_{kind}_hook")
    handle = register(lambda o, args, kwargs: seen.append(w.detach().clone()))
    opt = tr.skip_non_finite(sgd)
    try:
        w.grad = torch.tensor([1.0, math.nan])
        opt.step()
        assert seen == [] and w.tolist() == [1.0, 1.0]
        w.grad = torch.tensor([1.0, 1.0])
        opt.step()
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.isfinite(seen[0]).all()
    assert opt.skip_state.skipped_total == 1


@pytest.mark.parametrize("wrap", ["skip_non_finite", "train_step"])
def test_pending_flags_stay_bounded_when_skip_state_is_never_read(wrap, monkeypatch):
    # Each step leaves two 0-d device flags until skip_state is read: a loop
    # that never reads it (step(sync=False), a plain skip_non_finite loop)
    # must not keep every step's flags (a GPU block each).
    from torchref._src import guard as _tr
    from torchref.train import TrainStep

    monkeypatch.setattr(_tr, "_MAX_PENDING", 4, raising=False)
    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrap == "train_step":
        step = TrainStep(model, sgd, lambda m, x: m(x).sum())
        run = lambda x: step(x, sync=False)  # noqa: E731
    else:
        step = tr.skip_non_finite(sgd)

        def run(x):
            model.zero_grad()
            model(x).sum().backward()
            step.step()

    for i in range(11):
        run(torch.full((1, 2), math.nan if i in (3, 9, 10) else 1.0))
        assert len(step._pending) <= 4
    s = step.skip_state
    assert (s.skipped_total, s.consecutive, s.last_finite) == (3, 2, False)
    assert s.non_finite_updates == 0


@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_fused_steps_copy_nothing(make, monkeypatch):
    # A fused optimizer gets found_inf and nothing is copied or kept, its
    # first step included (whose state a skip removes without a copy).
    from torchref._src import update_check as _tr

    takes = []
    take = _tr.DeviceSelect.take
    monkeypatch.setattr(
        _tr.DeviceSelect, "take", lambda s, ts: takes.append(len(ts)) or take(s, ts)
    )
    w = torch.nn.Parameter(torch.ones(3))
    make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[make]
    opt = tr.skip_non_finite(make([w], lr=0.5, fused=True), check_update=False)
    for g in (1.0, math.nan, 1.0, math.inf):
        w.grad = torch.full((3,), g)
        before = w.detach().clone()
        opt.step()
        assert torch.equal(w, before) is (not math.isfinite(g))
    assert takes == [] and opt._guarded._select._flat == {}
    assert opt.skip_state.skipped_total == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, torch.float32])
def test_zero_size_wide_leaves_in_norm_clip_and_skip(dtype):
    # A zero-size float64/complex128 leaf (an empty bias, a pruned head) has
    # norm 0 and is finite: its max-|x| finiteness pass must not fail
    # (torch's inf-norm of an empty tensor raises).
    w, empty = (
        torch.nn.Parameter(torch.ones(4, dtype=dtype)),
        torch.nn.Parameter(torch.zeros(0, 3, dtype=dtype)),
    )
    w.grad, empty.grad = (
        torch.full((4,), 2.0, dtype=dtype),
        torch.zeros(0, 3, dtype=dtype),
    )
    assert float(tr.global_norm([w.grad, empty.grad])) == 4.0
    assert float(tr.global_norm([empty.grad])) == 0.0
    assert float(tr.clip_by_global_norm(1.0)([w, empty])) == 4.0
    opt = tr.skip_non_finite(torch.optim.Adam([w, empty], lr=0.1))
    opt.step()
    w.grad = torch.full((4,), math.nan, dtype=dtype)
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w, before) and opt.skip_state.skipped_total == 1


class _AssignsData(torch.optim.Optimizer):
    """Old-style SGD that assigns ``p.data`` (new storage) instead of
    writing in place."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = p.data - group["lr"] * p.grad


@pytest.mark.parametrize("check_update", [False, True])
def test_a_step_that_assigns_param_data_is_selected_back(check_update):
    # The select writes the copy back into the storage it took; a step that
    # gave the parameter new storage must be selected back there.
    w = torch.nn.Parameter(torch.ones(2))
    opt = tr.skip_non_finite(_AssignsData([w], lr=0.5), check_update=check_update)
    w.grad = torch.tensor([1.0, math.nan])
    opt.step()
    assert w.tolist() == [1.0, 1.0] and opt.skip_state.skipped_total == 1
    w.grad = torch.tensor([1.0, 1.0])
    opt.step()
    assert w.tolist() == [0.5, 0.5]


def test_update_check_on_sharded_parameters_is_refused_by_name(monkeypatch):
    # FSDP2 (DTensor) parameters: each rank would check its own shard only.
    # Both ways into the update check (step() and step(closure)) say so and
    # name the fix; the parameters are taken as DTensors here (no process
    # group needed).
    from torchref._src import update_check as impl

    w = torch.nn.Parameter(torch.ones(2))
    monkeypatch.setattr(impl, "is_dtensor", lambda t: t is w)
    opt = tr.skip_non_finite(torch.optim.SGD([w], lr=0.1))
    w.grad = torch.ones(2)
    with pytest.raises(NotImplementedError, match="check_update=False"):
        opt.step()
    with pytest.raises(NotImplementedError, match="check_update=False"):
        opt.step(lambda: (w * w).sum())
    assert w.tolist() == [1.0, 1.0]
