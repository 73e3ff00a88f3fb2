"""The engine's bucket plan (`cbopt.engine.buckets.BucketPlan`): the last step's buckets, kept and checked at each step
instead of made again. A kept plan must give exactly what `buckets(opt)` would (the same params, in the same order,
with the same state dicts, in the same buckets), and whatever changes them must make it again: a grad that comes, goes
or turns sparse, a param given another dtype, shape or strides, state loaded or edited, a new group. Steps are checked
against the loop backend (and torch's fused kernels) over many steps with such changes midway."""
import copy

import pytest
import torch

import cbopt
from cbopt.core.runtime import runtime
from cbopt.engine import buckets as bucketing
from cbopt.engine import Backend
from conftest import assert_rel_close, make_model, NO_COMPILE_FALLBACK, set_grads, sharded, train

pytestmark = [pytest.mark.usefixtures('one_thread'), NO_COMPILE_FALLBACK]


def plan(opt):
    return runtime(opt).bucket_plan


def assert_as_made_afresh(opt) -> list:
    "`planned_buckets` gives what `buckets` makes from scratch: the same params and state dicts, bucket by bucket."
    planned, fresh = bucketing.planned_buckets(opt), bucketing.buckets(opt)
    assert [[id(p) for p in b.params] for b in planned] == [[id(p) for p in b.params] for b in fresh]
    assert [[id(s) for s in b.states] for b in planned] == [[id(s) for s in b.states] for b in fresh]
    assert all(a.group is b.group for a, b in zip(planned, fresh))
    return planned


def test_plan_kept_while_nothing_changes() -> None:
    "New grads each step (set to None, then backward) keep the plan: the buckets are the same objects step after step."
    model = make_model()
    opt = cbopt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    train(opt, model, 3)
    kept = plan(opt)
    assert kept is not None and kept.guard is not None
    for i in range(3, 8):
        train(opt, model, 1, start=i)
        assert plan(opt) is kept
    set_grads(model, 8)
    assert assert_as_made_afresh(opt) is kept.buckets


@pytest.mark.parametrize('make, n_buckets', [(lambda ps: cbopt.Adam(ps, lr=0.01, backend='foreach'), 1),
                                             (lambda ps: cbopt.Lamb(ps, lr=0.01, backend='foreach'), 2)],
                         ids=['adam', 'lamb'])
def test_plan_kept_with_python_step_counts_and_buckets_by_rank(make, n_buckets) -> None:
    """Python state values equal within each bucket (the step counts) and a chain over whole tensors, bucketed by rank
    (LAMB: weights and biases apart): the plan is kept step after step, and gives what `buckets` makes."""
    model = make_model()
    opt = make(model.parameters())
    train(opt, model, 2)
    kept = plan(opt)
    for i in range(2, 6):
        train(opt, model, 1, start=i)
        assert plan(opt) is kept
    set_grads(model, 6)
    assert len(assert_as_made_afresh(opt)) == n_buckets


def _strides(model, opt):  # the same shape and values, transposed in memory; the grads stay contiguous
    w = model[0].weight
    w.data = w.data.t().contiguous().t()


def _requires_grad(model, opt):
    model[0].bias.requires_grad_(False)


def _state_loaded(model, opt):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _state_dict_replaced(model, opt):
    p = model[2].bias
    opt.state[p] = dict(opt.state[p])


def _flag(model, opt):  # fastai's flag, a Python value of the state: that param is bucketed apart
    opt.state[model[0].weight]['do_wd'] = False


def _step_count(model, opt):
    opt.state[model[0].bias]['step'] += 1


def _state_key_dropped(model, opt):
    del opt.state[model[2].weight]['grad_avg']


def _group_added(model, opt):
    opt.add_param_group({'params': [torch.nn.Parameter(torch.randn(4))]})


CHANGES = [_strides, _requires_grad, _state_loaded, _state_dict_replaced, _flag, _step_count,
           _state_key_dropped, _group_added]


@pytest.mark.parametrize('change', CHANGES, ids=lambda f: f.__name__[1:])
def test_plan_made_again_when_its_buckets_change(change) -> None:
    """Each change made between two steps: the next step makes its plan again, its buckets are what `buckets` makes,
    and 6 more steps match the loop backend's (given the same change), which never plans."""
    model = make_model()
    twin = copy.deepcopy(model)
    opt = cbopt.Adam(model.parameters(), lr=0.01, wd=0.1, backend='foreach')
    ref = cbopt.Adam(twin.parameters(), lr=0.01, wd=0.1, backend='loop')
    for i in range(3):
        set_grads(model, i), set_grads(twin, i)
        opt.step(), ref.step()
    before = plan(opt)
    change(model, opt), change(twin, ref)
    set_grads(model, 3), set_grads(twin, 3)
    assert_as_made_afresh(opt)
    assert plan(opt) is not before
    for i in range(3, 9):
        set_grads(model, i), set_grads(twin, i)
        opt.step(), ref.step()
        assert_rel_close(model, twin, rtol=1e-6, msg=f'{change.__name__} step {i}')


def test_plan_made_again_for_another_dtype() -> None:
    "Params given another dtype (`model.double()`), and so grads: a new plan, the buckets `buckets` makes."
    model = make_model()
    opt = cbopt.Adam(model.parameters(), lr=0.01, backend='foreach')
    train(opt, model, 3)
    before = plan(opt)
    model.double()
    set_grads(model, 3)
    assert [b.params[0].dtype for b in assert_as_made_afresh(opt)] == [torch.float64]
    assert plan(opt) is not before


def test_buckets_merged_when_their_python_values_meet() -> None:
    """Two buckets apart only by a step count (one param stepped once more) are one again when the counts are equal
    again, as `buckets` makes them."""
    model = make_model()
    opt = cbopt.Adam(model.parameters(), lr=0.01, backend='foreach')
    train(opt, model, 3)
    opt.state[model[0].bias]['step'] += 1
    set_grads(model, 3)
    assert len(assert_as_made_afresh(opt)) == 2
    opt.step()
    opt.state[model[0].bias]['step'] -= 1
    set_grads(model, 4)
    assert len(assert_as_made_afresh(opt)) == 1


def test_grad_going_and_coming_back() -> None:
    "A param without a grad for a few steps (frozen, then not): left out of the buckets, then in again."
    model = make_model()
    twin = copy.deepcopy(model)
    opt = cbopt.Adam(model.parameters(), lr=0.01, backend='foreach')
    ref = cbopt.Adam(twin.parameters(), lr=0.01, backend='loop')
    for i in range(10):
        set_grads(model, i), set_grads(twin, i)
        if 3 <= i < 6: model[0].weight.grad = twin[0].weight.grad = None
        if i in (3, 6): assert_as_made_afresh(opt)
        opt.step(), ref.step()
        assert_rel_close(model, twin, rtol=1e-6, msg=f'step {i}')
    assert ref.state[twin[0].weight]['step'] == 7 and opt.state[model[0].weight]['step'] == 7


def test_sparse_grad_after_a_kept_plan_is_rejected() -> None:
    "A grad turned sparse once the plan is kept is refused as on the first step: the error names it, nothing changes."
    model = make_model()
    opt = cbopt.optim.SGD(model.named_parameters(), lr=0.05, momentum=0.9, fused=True)
    train(opt, model, 3)
    set_grads(model, 3)
    model[2].bias.grad = model[2].bias.grad.to_sparse()
    params, state = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    with pytest.raises(RuntimeError, match=r"param '2\.bias' has a sparse gradient"): opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    after = opt.state_dict()['state']
    assert all(torch.equal(after[i]['momentum_buffer'], st['momentum_buffer']) for i, st in state['state'].items())


def count_kernel_params(monkeypatch, name: str) -> list:
    "Per call of torch's kernel `name`, the number of params it stepped."
    calls, real = [], getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda ps, *a, **k: calls.append(len(ps)) or real(ps, *a, **k))
    return calls


@pytest.mark.parametrize('cls, kernel, hypers', [
    ('SGD', '_fused_sgd_', dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    ('Adam', '_fused_adam_', dict(lr=0.01, weight_decay=0.1)),
    ('AdamW', '_fused_adamw_', dict(lr=0.01, weight_decay=0.1)),
    ('Adagrad', '_fused_adagrad_', dict(lr=0.05, weight_decay=0.1))])
def test_kernel_steps_as_torchs_fused_optimizer_through_changes(cls, kernel, hypers, monkeypatch) -> None:
    """40 steps of cbopt's twin of a torch optimizer (torch's kernel, the plan kept) against torch's own fused one, bit
    for bit, with changes midway: a param given new memory (step 10), a grad missing for 5 steps (from step 15), the
    state saved and loaded back (step 25). Every step runs the kernel once, on the params that have a grad."""
    ref = make_model()
    ref_opt = getattr(torch.optim, cls)(ref.parameters(), **hypers, fused=True)
    set_grads(ref, 0)
    ref_opt.step()
    model = copy.deepcopy(ref)
    opt = getattr(cbopt.optim, cls)(model.named_parameters(), **hypers, fused=True)
    opt.load_state_dict(ref_opt.state_dict())  # (the state exists: the kernel steps from here)
    calls = count_kernel_params(monkeypatch, kernel)
    for i in range(1, 41):
        set_grads(ref, i), set_grads(model, i)
        if i == 10:
            for m in (ref, model): m[0].weight.data = m[0].weight.data.clone()
        if 15 <= i < 20: ref[2].weight.grad = model[2].weight.grad = None
        if i == 25: opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        ref_opt.step()
        calls.clear()
        opt.step()
        assert sum(calls) == (3 if 15 <= i < 20 else 4), f'{cls} step {i}: the kernel stepped {calls} params'
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), f'{cls} step {i}: {n} differs'



def test_kernel_rejected_when_a_param_is_laid_out_again(monkeypatch) -> None:
    """A weight transposed in memory after the plan is kept (its grads stay contiguous): torch's kernel would pair the
    wrong elements, so its bucket (all four params) runs the chain from then on; the steps match torch's for-loop SGD."""
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=False)
    model = copy.deepcopy(ref)
    opt = cbopt.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    opt.backend = Backend('fused', compiler='eager')  # (the chain's fallback: no code generation in a test)
    calls = count_kernel_params(monkeypatch, '_fused_sgd_')
    for i in range(12):
        if i == 4:
            for m in (ref, model): m[0].weight.data = m[0].weight.data.t().contiguous().t()
        set_grads(ref, i), set_grads(model, i)
        for m in (ref, model): m[0].weight.grad = m[0].weight.grad.contiguous()  # (autograd's follows the param's)
        assert not model[0].weight.is_contiguous() or i < 4
        ref_opt.step(), opt.step()
        assert_rel_close(model, ref, rtol=1e-6, msg=f'step {i}')
    assert calls == [4, 4, 4]  # (steps 1 to 3: step 0 creates the momentum buffers, with the chain)


@pytest.mark.parametrize('change', ['load', 'clear_state'])
@pytest.mark.parametrize('backend', ['foreach', Backend('fused', compiler='eager')])
def test_the_old_state_is_freed_by_a_load_or_clear_state(backend, change) -> None:
    """Neither the bucket plan nor the compiled chain's flat aliases keep the old state tensors alive once the state is
    loaded or cleared (a resumed run would hold its state twice until its next step); the next step is the loop's."""
    import gc, weakref
    model, ref = make_model(), make_model()
    opt = cbopt.Lion(model.parameters(), lr=0.01, backend=backend)  # (fused: its compiled chain, flat aliases kept)
    ref_opt = cbopt.Lion(ref.parameters(), lr=0.01, backend='loop')
    train(opt, model, 3)
    train(ref_opt, ref, 3)
    old = [weakref.ref(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert len(old) == len(list(model.parameters())) and plan(opt) is not None
    if change == 'load': opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    else:
        opt.clear_state()
        ref_opt.clear_state()
    gc.collect()
    assert all(r() is None for r in old)
    train(opt, model, 2, start=3)
    train(ref_opt, ref, 2, start=3)
    assert_rel_close(model, ref)


def _bucket(*numels: int, dtype=torch.float32) -> bucketing.Bucket:
    ps = [torch.zeros(n, dtype=dtype) for n in numels]
    return bucketing.Bucket({}, ps, [{} for _ in ps])


def _count_in_a_tensor(p, n=None, **kwargs):
    "State that is a real 0-d tensor whatever the param's dtype, as torch's tensor step counts."
    return {'n': p.new_ones((), dtype=torch.float64) if n is None else n + 1}  # (per param of a bucket)


def test_cache_chunks_by_bytes() -> None:
    """float32 params of 10, 10, 30, 5 and 20 elements (40, 40, 120, 20, 80 bytes) with 100-byte chunks: 40+40 fit,
    the 120-byte param goes alone (it is larger than a chunk), then 20+80 exactly fills one."""
    b = _bucket(10, 10, 30, 5, 20)
    chunks = bucketing.cache_chunks(b, 100)
    assert [[p.numel() for p in c.params] for c in chunks] == [[10, 10], [30], [5, 20]]
    assert all(c.states == b.states[i:i + len(c.params)] for c, i in zip(chunks, (0, 2, 3)))
    assert all(c.group is b.group for c in chunks)
    big = _bucket(30, 10)                            # a first param larger than a chunk: alone, no empty chunk before it
    assert [[p.numel() for p in c.params] for c in bucketing.cache_chunks(big, 100)] == [[30], [10]]
    exact = _bucket(10, 15, 1)                       # 40 + 60 bytes fill the first chunk exactly
    assert [[p.numel() for p in c.params] for c in bucketing.cache_chunks(exact, 100)] == [[10, 15], [1]]
    whole = bucketing.cache_chunks(b, 1 << 20)
    assert len(whole) == 1 and whole[0].params == b.params


def test_python_state_that_cannot_be_hashed_gets_a_bucket_per_param() -> None:
    ps = [torch.zeros(2, requires_grad=True) for _ in range(3)]
    opt = cbopt.Optimizer(ps, [cbopt.sgd_step], lr=0.1)
    for p in ps: p.grad = torch.ones(2)
    assert [b.params for b in bucketing.buckets(opt)] == [ps]
    opt.state[ps[0]]['tag'] = ['a']  # a list: no key can hold it
    opt.state[ps[1]]['tag'] = ['a']
    opt.state[ps[2]]['tag'] = 'a'
    assert [b.params for b in bucketing.buckets(opt)] == [[ps[0]], [ps[1]], [ps[2]]]


def test_whole_model_buckets_split_dtensor_grads_and_skip_params_without_grad(one_rank_mesh) -> None:
    """A whole-model callback gets one TensorList per (device, dtypes, grad layout): a DTensor grad never shares one
    with a plain grad (foreach kernels refuse the mix); a param without a grad is left out, and the params after it
    are not."""
    none0, w, v, none1, u = (torch.nn.Parameter(torch.ones(2)) for _ in range(5))
    w.data = sharded(one_rank_mesh, torch.ones(2))
    opt = cbopt.SGD([none0, w, v, none1, u], lr=0.1, backend='loop')
    w.grad, v.grad, u.grad = sharded(one_rank_mesh, torch.ones(2)), torch.ones(2), torch.ones(2)
    got = [(list(tl), [g for g in tl.grad], states) for tl, states in bucketing.model_buckets(opt, opt.param_groups)]
    assert [[id(p) for p in ps] for ps, _, _ in got] == [[id(w)], [id(v), id(u)]]
    assert [[id(g) for g in gs] for _, gs, _ in got] == [[id(w.grad)], [id(v.grad), id(u.grad)]]
    assert [[id(s) for s in states] for _, _, states in got] == [[id(opt.state[w])], [id(opt.state[v]), id(opt.state[u])]]


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_complex_params_step_as_torchs_on_their_real_views(backend) -> None:
    """torch.optim's Adam steps a complex param as the real param of its pairs (`|g|^2` would be the complex math);
    cbopt's chains the same way, whatever the backend, and the state stays complex, as torch's."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, dtype=torch.complex128, generator=g)
    grads = [torch.randn(3, dtype=torch.complex128, generator=g) for _ in range(4)]
    p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    kw = dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    foreach = backend == 'foreach'
    opt, torch_opt = cbopt.optim.Adam([p], **kw, foreach=foreach), torch.optim.Adam([ref], **kw)
    real = torch.nn.Parameter(torch.view_as_real(start.clone()))   # the same steps on the real pairs
    real_opt = cbopt.optim.Adam([real], **kw, foreach=foreach)
    for gr in grads:
        p.grad, ref.grad, real.grad = gr.clone(), gr.clone(), torch.view_as_real(gr.clone())
        opt.step(); torch_opt.step(); real_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.view_as_real(p.detach()), real.detach(), rtol=0, atol=0)
    assert opt.state[p]['grad_avg'].dtype == opt.state[p]['sqr_avg'].dtype == torch.complex128
    torch.testing.assert_close(opt.state[p]['sqr_avg'], torch_opt.state[ref]['exp_avg_sq'], rtol=1e-12, atol=0)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_real_state_of_a_complex_param_is_kept_as_it_is(backend) -> None:
    "Only tensors of the param's complex dtype are viewed as real pairs; a real state tensor (a count) is left alone."
    p, ref = torch.nn.Parameter(torch.tensor([1 + 2j, -1j])), torch.nn.Parameter(torch.tensor([1 + 2j, -1j]))
    opt = cbopt.Optimizer([p], [_count_in_a_tensor, cbopt.sgd_step], lr=0.1, backend=backend)
    torch_opt = torch.optim.SGD([ref], lr=0.1)
    for i in range(3):
        p.grad, ref.grad = torch.tensor([1j * i, 2. + i]), torch.tensor([1j * i, 2. + i])
        opt.step(); torch_opt.step()
    assert opt.state[p]['n'].dtype == torch.float64 and opt.state[p]['n'].item() == 3
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0)


# -- param groups alike share buckets ----------------------------------------------------------------------------------
def _one_group_each(model, **hypers) -> list[dict]:
    return [{'params': [p], **hypers} for p in model.parameters()]


@pytest.mark.parametrize('backend', ['foreach', 'fused', 'auto'])
def test_groups_alike_share_a_bucket_and_split_where_their_hypers_differ(backend, monkeypatch) -> None:
    """One group per param, all with the same chain and hypers: their params share buckets (one kernel call per step
    where torch's optimizers make one per group), and step as the loop steps them. When a scheduler gives one group
    another lr, the next steps run each group's own bucket (with its own lr), and still follow the loop; equal lrs
    again: one call again, the plan unchanged throughout."""
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: calls.append(len(a[0])) or kernel(*a, **k))
    model, twin = make_model(), make_model()
    opt = cbopt.Adam(_one_group_each(model), lr=0.01, wd=0.1, backend=backend)
    ref = cbopt.Adam(_one_group_each(twin), lr=0.01, wd=0.1, backend='loop')
    for i in range(3):
        set_grads(model, i), set_grads(twin, i)
        opt.step(), ref.step()
        assert_rel_close(model, twin, rtol=1e-6, msg=f'step {i}')
    bs = assert_as_made_afresh(opt)
    assert [len(b.params) for b in bs] == [4] and [[id(q.group) for q in b.parts] for b in bs] == \
        [[id(g) for g in opt.param_groups]]
    kept = plan(opt)
    if backend != 'foreach': assert calls == [4, 4]  # (the first step creates the state: the chain runs it)
    for lrs in ([0.01, 0.02, 0.01, 0.01], [0.01] * 4):
        calls.clear()
        for o in (opt, ref):
            for g, lr in zip(o.param_groups, lrs): g['lr'] = lr
        for i in range(3, 6):
            set_grads(model, i), set_grads(twin, i)
            opt.step(), ref.step()
            assert_rel_close(model, twin, rtol=1e-6, msg=f'lrs {lrs} step {i}')
        assert plan(opt) is kept
        if backend != 'foreach': assert calls == ([1, 1, 1, 1] if len(set(lrs)) > 1 else [4]) * 3


def test_groups_share_buckets_only_with_the_same_chain_and_entries() -> None:
    """Groups share buckets when they hold the same callbacks and equal entries: another lr, another chain, a tensor
    lr of their own (tensors are the same only as one object: their values change in place) keep theirs apart."""
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(6)]
    lr = torch.tensor(0.01)
    opt = cbopt.Adam([{'params': ps[:1]}, {'params': ps[1:2]}, {'params': ps[2:3], 'lr': 0.02},
                      {'params': ps[3:4], 'lr': lr}, {'params': ps[4:5], 'lr': lr},
                      {'params': ps[5:], 'lr': torch.tensor(0.01)}], lr=0.01)
    for p in ps: p.grad = torch.ones(3)
    assert [b.params for b in bucketing.buckets(opt)] == [ps[:2], ps[2:3], ps[3:5], ps[5:]]
    same = cbopt.Optimizer([{'params': ps[:1]}, {'params': ps[1:2], 'cbs': [cbopt.sgd_step]}], [cbopt.sgd_step], lr=0.1)
    assert len(bucketing.buckets(same)) == 1  # (the same callbacks, listed by another list)
    other = cbopt.Optimizer([{'params': ps[:1]}, {'params': ps[1:2], 'cbs': [cbopt.weight_decay, cbopt.sgd_step]}],
                            [cbopt.sgd_step], lr=0.1)
    assert len(bucketing.buckets(other)) == 2
    g0, g1 = opt.param_groups[:2]
    shared = bucketing.buckets(opt)[0]
    snaps = {id(g): cbopt.core.hypers.Hypers(g).snapshot() for g in opt.param_groups}
    assert bucketing.runs(shared, snaps) == (shared,)
    scale, other_scale = torch.tensor(0.5), torch.tensor(0.5)
    assert bucketing.runs(shared, snaps, {id(g0): (scale, False), id(g1): (scale, False)}) == (shared,)
    assert bucketing.runs(shared, snaps, {id(g0): (scale, False), id(g1): (other_scale, False)}) == shared.parts
    assert bucketing.runs(shared, snaps, {id(g0): (scale, False)}) == shared.parts  # (one group clipped alone)
