"""`cbopt.functional`: the pure init/update form of every chain, tried the way the optax maintainers asked: "try to
break it with vmap, grad and jit".

- every case of the registry (`cases.py`): `update` follows the Optimizer step for step, with the same state names
  and values (converted both ways), under vmap (or a FunctionalError naming the callback that cannot batch), and
  differentiably (autograd and finite differences agree, with respect to the params and to the lr);
- vmap over a `stack_module_state` ensemble equals N separate `cbopt.Adam` runs; `vmap(init)`;
- `torch.compile(update, fullgraph=True)`: no graph break, equal to eager, no recompile as the lr and step change;
- hypergradient descent and meta-learning unrolls, through `torch.autograd.grad` and `torch.func.grad`;
- purity: inputs unchanged; bad input raises an error naming the culprit.
"""
import collections
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import cbopt
from cbopt.core.chain import cb_name, is_model_cb
from cases import CASES, case, clip_by_norm
from conftest import assert_tensor_close, make_model

pytestmark = pytest.mark.usefixtures('one_thread')
F64 = torch.float64
SLOW = bool(os.environ.get('CBOPT_SLOW'))


TEACHER = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))


def batch(step: int, dtype=torch.float32, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    "Batch `step` of a fixed regression task for `make_model`'s 6-8-3 MLP (a tanh teacher, a little noise)."
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 6, generator=g)
    return x.to(dtype), (torch.tanh(x @ TEACHER) + 0.1 * torch.randn(n, 3, generator=g)).to(dtype)


def loss_fn(model: nn.Module):
    "`loss(params, step)`: the MSE of `model` run with `params` on batch `step`."
    dtype = next(model.parameters()).dtype
    def loss(params, step):
        x, y = batch(step, dtype)
        return F.mse_loss(functional_call(model, params, (x,)), y)
    return loss


def detached(model: nn.Module) -> dict: return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_close(actual: dict, expected: dict, rtol: float, msg: str = '', floor: float = 1e-30) -> None:
    """Every tensor within `rtol` of its reference's own largest magnitude, or of `floor` where that is larger (the
    param's scale, for state that is rounding noise itself: a Kahan compensation buffer)."""
    assert actual.keys() == expected.keys(), msg
    for k, e in expected.items(): assert_tensor_close(actual[k], e, f'{msg} {k}', rtol, atol=rtol * floor)


def ensemble(n: int, dtype=torch.float32) -> list[nn.Module]:
    return [make_model(seed=s, dtype=dtype) for s in range(n)]


def functional_of(c, lr: float = 1e-2) -> cbopt.FunctionalOptimizer:
    return cbopt.functional(lambda ps: c.build(ps, lr, 'loop'))


def groups_differ(c) -> bool:
    "The case's factory gives the test model's params several groups of different chains or hypers (Muon)."
    opt = c.build(make_model(dtype=F64).named_parameters(), 1e-2, 'loop')
    return len({(cbopt.chain_name(g['cbs']), repr(sorted(cbopt.Hypers(g).snapshot().items()))) for g in opt.param_groups}) > 1


def model_cbs(c) -> list[str]:
    opt = c.build([torch.zeros(1, requires_grad=True)], 1e-2, 'loop')
    return [cb_name(cb) for cb in opt.param_groups[0]['cbs'] if is_model_cb(cb)]


# -- every case of the registry ------------------------------------------------------------------------------------
@pytest.mark.parametrize('c', CASES, ids=str)
def test_update_is_the_optimizer(c):
    """12 steps of `update` against the Optimizer (loop) in float64 on real, param-dependent grads: the same params,
    and the same state (names, step counts as numbers, tensors) through `to_state_dict`; `from_state_dict` gives the
    state back; an Optimizer loading `to_state_dict` continues as `update` does."""
    if names := model_cbs(c):
        with pytest.raises(cbopt.FunctionalError, match=names[0]): functional_of(c)
        return
    model = make_model(dtype=F64)
    ref = copy.deepcopy(model)
    opt = c.build(ref.named_parameters(), 1e-2, 'loop')
    fopt, loss = functional_of(c), loss_fn(model)
    params = detached(model)
    state = fopt.init(params)
    for i in range(12):
        params, state = fopt.update(params, grad(loss)(params, i), state)
        opt.zero_grad()
        loss(dict(ref.named_parameters()), i).backward()
        opt.step()
        assert_close(params, dict(ref.named_parameters()), 1e-12, f"{c} step {i}:")
    theirs, ours = opt.named_state_dict(), fopt.to_state_dict(state)
    assert ours['state'].keys() == theirs['state'].keys()
    for n, st in theirs['state'].items():
        assert st.keys() == ours['state'][n].keys(), n
        for k, v in st.items():
            scale = params[n].abs().max().item()
            if isinstance(v, torch.Tensor): assert_close({k: ours['state'][n][k]}, {k: v}, 1e-12, f"{c} {n}", scale)
            else: assert type(ours['state'][n][k]) is type(v) and ours['state'][n][k] == v, (n, k)
    back = fopt.from_state_dict(theirs, params)
    assert back.keys() == state.keys()
    again = fopt.to_state_dict(back)
    assert again['param_groups'] == ours['param_groups'] and again['state'].keys() == ours['state'].keys()
    for n, st in ours['state'].items():
        scale = params[n].abs().max().item()
        for k, v in st.items():
            if isinstance(v, torch.Tensor): assert_close({k: again['state'][n][k]}, {k: v}, 1e-12, f"{c} back {n}", scale)
            else: assert again['state'][n][k] == v, (n, k)
    other = copy.deepcopy(ref)
    opt2 = c.build(other.named_parameters(), 1e-2, 'loop')
    opt2.load_state_dict(ours)
    for i in range(12, 15):
        params, state = fopt.update(params, grad(loss)(params, i), state)
        opt2.zero_grad()
        loss(dict(other.named_parameters()), i).backward()
        opt2.step()
    assert_close(params, dict(other.named_parameters()), 1e-12, f"{c} after loading to_state_dict:")


def mse(model: nn.Module):
    "`mse(params, x, y)` of `model`'s architecture (a meta copy: only its structure is used)."
    base = copy.deepcopy(model).to('meta')
    return lambda p, x, y: F.mse_loss(functional_call(base, p, (x,)), y)


def vmap_vs_optimizers(fopt, models: list, build, steps: int, rtol: float) -> dict:
    """`steps` of vmap(update) over the stacked `models`, member j on batches `j, n + j, 2n + j...`, next to one
    Optimizer per model (`build(named_params)`) on the same batches; checks every member's params at the end."""
    n, dtype = len(models), next(models[0].parameters()).dtype
    refs = [copy.deepcopy(m) for m in models]
    opts = [build(r.named_parameters()) for r in refs]
    loss = mse(models[0])
    params = {k: v.detach() for k, v in stack_module_state(models)[0].items()}
    state = vmap(fopt.init)(params)
    for i in range(steps):
        xs, ys = zip(*(batch(n * i + j, dtype) for j in range(n)))
        x, y = torch.stack(xs), torch.stack(ys)
        params, state = vmap(fopt.update)(params, vmap(grad(loss))(params, x, y), state)
        for j, (r, o) in enumerate(zip(refs, opts)):
            o.zero_grad()
            loss(dict(r.named_parameters()), x[j], y[j]).backward()
            o.step()
    for j, r in enumerate(refs):
        assert_close({k: v[j] for k, v in params.items()}, dict(r.named_parameters()), rtol, f"member {j}:")
    return state


@pytest.mark.parametrize('c', CASES, ids=str)
def test_vmap_every_case(c):
    """`vmap(init)` and `vmap(update)` over an ensemble of 3 models equal 3 Optimizers, each on its own batches; or
    the error names a callback of the chain that cannot batch (Python control flow on the step count, a tensor here)."""
    if model_cbs(c): return  # refused: test_update_is_the_optimizer
    if groups_differ(c): return  # Muon: Newton-Schulz in bfloat16, which a batched matmul rounds otherwise (see test_partition_vmap)
    fopt = functional_of(c)
    try: vmap_vs_optimizers(fopt, ensemble(3, F64), lambda ps: c.build(ps, 1e-2, 'loop'), 8, 1e-12)
    except cbopt.FunctionalError as e:
        assert any(f"callback {cb_name(cb)!r}" in str(e) for cb in fopt.cbs), str(e)


def unroll(fopt, loss, params: dict, lr, steps: int, backprop: str) -> torch.Tensor:
    """`steps` updates, each on the grads of the loss at the current params (so the grads depend on the lr and the
    start), then the loss on a held-out batch: the objective of hypergradient descent and of meta-learning."""
    state = fopt.init(params)
    for i in range(steps):
        if backprop == 'autograd':
            g = dict(zip(params, torch.autograd.grad(loss(params, i), list(params.values()), create_graph=True)))
        else: g = grad(loss)(params, i)
        params, state = fopt.update(params, g, state, lr=lr)
    return loss(params, 99)


@pytest.mark.parametrize('c', CASES, ids=str)
def test_differentiable_every_case(c):
    """d(held-out loss after 5 updates) / d(start params) along a random direction, and / d(lr), by autograd through
    `update` (float64) equal central finite differences of the whole unroll."""
    if model_cbs(c) or groups_differ(c): return  # refused: test_update_is_the_optimizer
    model = make_model(dtype=F64)
    fopt, loss, p0 = functional_of(c), loss_fn(model), detached(model)
    lr0 = fopt.defaults['lr']
    gen = torch.Generator().manual_seed(0)
    v = {k: torch.randn(p.shape, generator=gen, dtype=F64) for k, p in p0.items()}
    start = lambda s: {k: (p + s * v[k]).requires_grad_() for k, p in p0.items()}
    f = lambda s, lr: unroll(fopt, loss, start(s), lr, 5, 'autograd')
    lr = torch.tensor(lr0, dtype=F64, requires_grad=True)
    ps = start(0.)
    out = unroll(fopt, loss, ps, lr, 5, 'autograd')
    # the differentiable (functionalized) update computes what the plain one does
    assert out.item() == pytest.approx(unroll(fopt, loss, p0, lr0, 5, 'func').item(), rel=1e-12)
    *gp, glr = torch.autograd.grad(out, [*ps.values(), lr])
    along = sum((g * v[k]).sum() for g, k in zip(gp, ps)).item()
    scale = sum((g * v[k]).abs().sum() for g, k in zip(gp, ps)).item()  # the terms' size: the sum may cancel
    h = 1e-7  # small: Lion's sign() jumps where an element crosses 0, which happens within 1e-6 of this start
    fd_params = ((f(h, lr0) - f(-h, lr0)) / (2 * h)).item()
    fd_lr = ((f(0., lr0 * (1 + h)) - f(0., lr0 * (1 - h))) / (2 * h * lr0)).item()
    assert abs(along - fd_params) <= 1e-6 * scale, (along, fd_params, scale)
    assert glr.item() == pytest.approx(fd_lr, rel=1e-6)


# -- vmap --------------------------------------------------------------------------------------------------------
def test_vmap_ensemble_is_n_adams():
    """`vmap(update)` over a `stack_module_state` ensemble of 5 MLPs (float32), each on its own data, equals 5
    separate `cbopt.Adam` runs (default backend: torch's fused kernel) within 1e-6 over 30 steps."""
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2, wd=0.1)
    state = vmap_vs_optimizers(fopt, ensemble(5), lambda ps: cbopt.Adam(ps, lr=1e-2, wd=0.1), 30, 1e-6)
    assert state['0.weight']['step'].tolist() == [30.] * 5


def test_vmap_init_is_each_init():
    "vmap(init) stacks each member's init: Lookahead's slow weights are each member's own params."
    fopt = cbopt.functional(lambda ps: cbopt.Lookahead(cbopt.Adam(ps)))
    models = ensemble(3)
    params = {k: v.detach() for k, v in stack_module_state(models)[0].items()}
    state = vmap(fopt.init)(params)
    for j, m in enumerate(models):
        one = fopt.init(detached(m))
        for n in one:
            for k, v in one[n].items(): assert torch.equal(state[n][k][j], v), (n, k)


def test_vmap_lr_per_member():
    "The dynamic lr in the vmapped state is one per member: a sweep of lrs in one call equals separate runs."
    models = ensemble(3)
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2)
    params = {k: v.detach() for k, v in stack_module_state(models)[0].items()}
    state = vmap(fopt.init)(params)
    lrs = torch.tensor([1e-3, 1e-2, 1e-1], dtype=F64)
    state['hypers']['lr'] = lrs
    singles = [(detached(m), fopt.init(detached(m))) for m in models]
    loss = mse(models[0])
    for i in range(5):
        x, y = batch(i)
        params, state = vmap(fopt.update)(params, vmap(grad(loss), in_dims=(0, None, None))(params, x, y), state)
        singles = [fopt.update(p, grad(loss)(p, x, y), s, lr=lr.item()) for (p, s), lr in zip(singles, lrs)]
    for j, (p, _) in enumerate(singles): assert_close({k: v[j] for k, v in params.items()}, p, 1e-6, f"member {j}:")
    assert torch.equal(state['hypers']['lr'], lrs)


def test_vmap_names_the_branching_callback():
    "RAdam's `if r > 5` on the (tensor) step count, and a user's `if` on a grad, cannot batch: the error names them."
    def skip_if_small(p, lr, **kwargs):
        if p.grad.abs().max() > 1: p.data.sub_(p.grad, alpha=lr)
    params = {k: v.detach() for k, v in stack_module_state(ensemble(2))[0].items()}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    for fopt, name in ((cbopt.functional(cbopt.RAdam), 'radam_step'), (cbopt.functional([skip_if_small], lr=0.1), 'skip_if_small')):
        with pytest.raises(cbopt.FunctionalError, match=f"callback '{name}'"):
            vmap(fopt.update)(params, grads, vmap(fopt.init)(params))
        p = {k: v[0] for k, v in params.items()}  # without vmap it runs
        fopt.update(p, {k: v[0] for k, v in grads.items()}, fopt.init(p))


# -- torch.compile -----------------------------------------------------------------------------------------------
def compiled_steps(fopt, compiler: str, steps: int, rtol: float):
    "`steps` updates compiled with fullgraph next to eager ones, lr a tensor that changes every step."
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    model = make_model()
    loss = loss_fn(model)
    update = torch.compile(fopt.update, fullgraph=True, backend=compiler)
    eager = compiled = detached(model)
    s_eager = s_compiled = fopt.init(eager)
    before = counters['stats']['unique_graphs']
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            lr = torch.tensor(1e-2 / (1 + i), dtype=F64)
            g = grad(loss)(eager, i)
            eager, s_eager = fopt.update(eager, g, s_eager, lr=lr)
            compiled, s_compiled = update(compiled, g, s_compiled, lr=lr)
            assert_close(compiled, eager, rtol, f"step {i}:")
    assert counters['stats']['unique_graphs'] - before == 1
    assert s_compiled['0.weight']['step'].item() == steps and s_compiled['hypers']['lr'].item() == lr.item()


def test_compiled_update_one_graph():
    """`torch.compile(update, fullgraph=True)` traces Adam in one graph (no break), runs it as eager does, and never
    recompiles as the lr (a tensor) and the step count change (dynamo's error_on_recompile). aot_eager: dynamo's
    graph and AOTAutograd's functionalization without inductor's slow C++ codegen (CBOPT_SLOW=1 adds inductor)."""
    compiled_steps(cbopt.functional(cbopt.Adam, wd=0.1), 'aot_eager', 6, 1e-6)


def test_compile_names_the_branching_callback():
    "RAdam's `if r > 5` on the step count (a tensor here) is a graph break: dynamo's fullgraph error names radam_step."
    torch._dynamo.reset()
    fopt = cbopt.functional(cbopt.RAdam)
    params = detached(make_model())
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(torch._dynamo.exc.Unsupported, match='(?s)ata-dependent.*radam_step'):
        torch.compile(fopt.update, fullgraph=True, backend='aot_eager')(params, grads, fopt.init(params))


@pytest.mark.skipif(not SLOW, reason='inductor compiles for a minute on a busy CPU: CBOPT_SLOW=1')
def test_compiled_update_inductor():
    compiled_steps(cbopt.functional(cbopt.Adam, wd=0.1), 'inductor', 6, 1e-6)


# -- differentiable ------------------------------------------------------------------------------------------------
def test_hypergradient_autograd_and_func_grad():
    """d(held-out loss after 4 Adam updates)/d(lr), the lr a 0-d tensor hyper: torch.autograd.grad (create_graph
    grads) and torch.func.grad agree with each other and with finite differences (float64)."""
    model = make_model(dtype=F64)
    fopt, loss, p0 = cbopt.functional(cbopt.Adam, wd=0.1), loss_fn(model), detached(model)
    lr = torch.tensor(3e-2, dtype=F64, requires_grad=True)
    leaf = {k: v.clone().requires_grad_() for k, v in p0.items()}
    (by_autograd,) = torch.autograd.grad(unroll(fopt, loss, leaf, lr, 4, 'autograd'), lr)
    by_func = grad(lambda lr: unroll(fopt, loss, p0, lr, 4, 'func'))(lr.detach())
    h = 1e-7
    fd = (unroll(fopt, loss, p0, 3e-2 + h, 4, 'func') - unroll(fopt, loss, p0, 3e-2 - h, 4, 'func')) / (2 * h)
    assert by_func.item() == pytest.approx(by_autograd.item(), rel=1e-10)
    assert by_autograd.item() == pytest.approx(fd.item(), rel=1e-6)


def test_meta_gradient_wrt_params():
    """The gradient of an unrolled inner loop (MAML-style: 3 updates, each on the grads at the current params) with
    respect to the start params, by torch.func.grad, equals finite differences element by element (float64): so the
    second-order path through the grads is there too (a detached `p.grad.data` would cut it)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 2)).to(F64)  # 14 params: finite differences on each
    fopt, p0 = cbopt.functional(cbopt.Adam, lr=5e-2), detached(model)
    def loss(params, step):
        x, y = batch(step, F64)
        return F.mse_loss(functional_call(model, params, (x,)), y[:, :2])
    meta = grad(lambda p: unroll(fopt, loss, p, 5e-2, 3, 'func'))(p0)
    h, scale = 1e-7, max(g.abs().max().item() for g in meta.values())
    for k, p in p0.items():
        for idx in range(p.numel()):
            e = torch.zeros(p.numel(), dtype=F64)
            e[idx] = h
            up = {**p0, k: p + e.view_as(p)}
            down = {**p0, k: p - e.view_as(p)}
            fd = (unroll(fopt, loss, up, 5e-2, 3, 'func') - unroll(fopt, loss, down, 5e-2, 3, 'func')) / (2 * h)
            assert abs(meta[k].flatten()[idx].item() - fd.item()) <= 1e-6 * scale, (k, idx, meta[k].flatten()[idx], fd)


def test_hypergradient_descent_learns_the_lr():
    """Hypergradient descent: the lr follows d(loss after the update)/d(lr); from a lr far too small it grows, and
    the run ends with a lower loss than the same steps at the start lr."""
    model = make_model()
    fopt, loss = cbopt.functional(cbopt.Adam), loss_fn(model)
    params, log_lr = detached(model), torch.tensor(-8.)
    state = fopt.init(params)
    fixed, fixed_state = detached(model), fopt.init(params)
    for i in range(40):
        g = grad(loss)(params, i)
        hyper = grad(lambda log_lr: loss(fopt.update(params, g, state, lr=log_lr.exp())[0], i + 1))(log_lr)
        log_lr = log_lr - 0.5 * hyper.sign()
        params, state = fopt.update(params, g, state, lr=log_lr.exp())
        fixed, fixed_state = fopt.update(fixed, grad(loss)(fixed, i), fixed_state, lr=torch.tensor(-8.).exp())
    assert log_lr.item() > -6
    assert loss(params, 100).item() < loss(fixed, 100).item()


# -- purity, hypers in the state, converters -------------------------------------------------------------------------
def halve_grad_in_place(p, **kwargs):
    "A callback breaking the grad contract: it writes into `p.grad`."
    p.grad.data.mul_(0.5)
halve_grad_in_place.state = {}


def test_update_leaves_its_inputs_unchanged():
    "update is pure: params, grads and state are as they were, even after a callback that writes into p.grad."
    fopt = cbopt.functional([halve_grad_in_place, clip_by_norm, cbopt.average_grad, cbopt.momentum_step], lr=0.1,
                            max_norm=0.01)
    params = detached(make_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = fopt.init(params)
    copies = copy.deepcopy((params, grads, state))
    new, new_state = fopt.update(params, grads, state)
    for before, after in zip(copies, (params, grads, state)):
        assert torch.equal(torch.cat([t.flatten() for t in _leaves(before)]), torch.cat([t.flatten() for t in _leaves(after)]))
    assert not any(torch.equal(new[k], params[k]) for k in params)


def _leaves(tree) -> list: return torch.utils._pytree.tree_leaves(tree)


def test_dynamic_hypers_live_in_the_state():
    """The lr in effect is in the state; an update without `lr=` uses the state's; a number or tensor given per call
    replaces it in the returned state; fixed hypers stay the functional optimizer's."""
    fopt = cbopt.functional(cbopt.Adam, lr=1e-3, wd=0.1)
    assert fopt.dynamic == ('lr',) and fopt.hypers['wd'] == 0.1 and 'lr' not in fopt.hypers
    params = detached(make_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = fopt.init(params)
    assert state['hypers']['lr'].item() == 1e-3
    a, sa = fopt.update(params, grads, state, lr=0.05)
    assert sa['hypers']['lr'].item() == 0.05
    b, _ = fopt.update(a, grads, sa)
    c, _ = fopt.update(a, grads, sa, lr=torch.tensor(0.05))
    assert_close(b, c, 1e-7)
    both = cbopt.functional(cbopt.Adam, dynamic=('lr', 'mom'), lr=1e-3)
    assert set(both.init(params)['hypers']) == {'lr', 'mom'}


def test_from_torch_adamw_continues_as_torch():
    "A torch.optim.AdamW state_dict becomes the functional state (read as Optimizer.load_state_dict reads it): the updates continue as torch's."
    model = make_model(dtype=F64)
    ref = copy.deepcopy(model)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.1)
    loss = loss_fn(model)
    for i in range(5):
        topt.zero_grad()
        loss(dict(ref.named_parameters()), i).backward()
        topt.step()
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2, wd=0.1)
    params = detached(ref)
    state = fopt.from_state_dict(topt.state_dict(), params)
    assert state['0.weight']['step'].item() == 5
    for i in range(5, 15):
        params, state = fopt.update(params, grad(loss)(params, i), state)
        topt.zero_grad()
        loss(dict(ref.named_parameters()), i).backward()
        topt.step()
    assert_close(params, dict(ref.named_parameters()), 1e-12)


# -- bad input --------------------------------------------------------------------------------------------------------
def rescale_grads(params, **kwargs):
    "A user's whole-model callback, with no pure form: the functional form refuses it by name."
    for tl in params: tl.grad = tl.grad * 0.5
rescale_grads.scope = 'model'
rescale_grads.state = {}


def test_errors_name_the_culprit():
    params = detached(make_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    fopt = cbopt.functional(cbopt.Adam)
    state = fopt.init(params)
    with pytest.raises(cbopt.FunctionalError, match="whole-model callback 'rescale_grads' .*no pure form"):
        cbopt.functional([rescale_grads, cbopt.sgd_step])
    with pytest.raises(cbopt.FunctionalError, match="whole-model callback 'clip_grad_norm' runs after"):
        cbopt.functional([cbopt.sgd_step, cbopt.clip_grad_norm])
    with pytest.raises(cbopt.FunctionalError, match="'skip_nonfinite' with max_consecutive"):
        cbopt.functional(lambda ps: cbopt.SkipNonFinite(cbopt.Adam(ps), max_consecutive=3))
    with pytest.raises(TypeError, match="did you mean 'lr'"): fopt.update(params, grads, state, lrr=0.1)
    with pytest.raises(ValueError, match='Invalid learning rate'): fopt.update(params, grads, state, lr=-1.)
    with pytest.raises(TypeError, match="hyper 'lr' .* shape \\(2,\\)"): fopt.update(params, grads, state, lr=torch.ones(2))
    with pytest.raises(KeyError, match="'nope'"): fopt.update(params, {**grads, 'nope': grads['0.bias']}, state)
    with pytest.raises(ValueError, match="grad '0.bias'"): fopt.update(params, {**grads, '0.bias': torch.ones(2)}, state)
    with pytest.raises(KeyError, match="'2.bias' has no state"):
        fopt.update(params, grads, {k: v for k, v in state.items() if k != '2.bias'})
    with pytest.raises(TypeError, match="state 'step' of param '0.bias' is a int"):
        fopt.update(params, grads, {**state, '0.bias': {**state['0.bias'], 'step': 3}})
    with pytest.raises(ValueError, match="named 'hypers'"): fopt.init({'hypers': torch.zeros(2)})
    with pytest.raises(KeyError, match="dynamic hyper 'lrr'"): cbopt.functional(cbopt.Adam, dynamic=('lrr',))
    with pytest.raises(TypeError, match=r'a callback, not a factory: .*\[sgd_step\]'): cbopt.functional(cbopt.sgd_step)
    with pytest.raises(TypeError, match='expected a factory'): cbopt.functional(lambda ps: None)
    with pytest.raises(ValueError, match='wd=0.5.*fixed at 0.01'):
        fopt.from_state_dict(cbopt.Adam(make_model().named_parameters(), wd=0.5).state_dict(), params)


# -- whole-model callbacks, partitions, nested pytrees ----------------------------------------------------------------
# optax's three most common optimizers, as cbopt twins (tests/test_optax.py: the same numbers as optax's)
def clip_adamw() -> cbopt.FunctionalOptimizer:
    return cbopt.functional([cbopt.clip_by_global_norm, *cbopt.adam_chain()], max_norm=0.5, lr=1e-2, wd=0.01)


def multi_steps_adamw() -> cbopt.FunctionalOptimizer:
    return cbopt.functional([cbopt.skip_nonfinite, cbopt.accumulate_grads, cbopt.clip_grad_norm, *cbopt.adam_chain()],
                            every=3, max_norm=0.5, lr=1e-2, wd=0.01)


def adamw_and_sgd() -> cbopt.functional.Partition:
    return cbopt.functional.partition({'adamw': clip_adamw(), 'sgd': cbopt.functional(cbopt.SGD, lr=0.05, mom=0.9)},
                                      lambda fqn, p: 'adamw' if p.ndim == 2 else 'sgd')


def twin_optimizer(params, twin: str) -> cbopt.Optimizer:
    "The Optimizer of each twin (one group, or the partition's two groups), over `params` (named)."
    if twin == 'partition':
        f = adamw_and_sgd()
        return cbopt.Optimizer([{'params': [p for n, p in params if p.ndim == 2], 'param_names': [n for n, p in params if p.ndim == 2],
                                 'cbs': f.transforms['adamw'].cbs, **f.transforms['adamw'].defaults},
                                {'params': [p for n, p in params if p.ndim != 2], 'param_names': [n for n, p in params if p.ndim != 2],
                                 'cbs': f.transforms['sgd'].cbs, **f.transforms['sgd'].defaults}], [])
    f = TWINS[twin]()
    return cbopt.Optimizer(params, f.cbs, **f.defaults)


TWINS = {'clip_adamw': clip_adamw, 'multi_steps': multi_steps_adamw, 'partition': adamw_and_sgd}


def grads_at(loss, params, i: int, twin: str) -> dict:
    "The grads of batch i, scaled to be clipped at some steps; for a twin skipping them, a NaN at steps 4 and 9."
    g = {k: v * (3. if i % 2 else 0.2) for k, v in grad(loss)(params, i).items()}
    if i in (4, 9) and twin == 'multi_steps': g['0.bias'] = torch.full_like(g['0.bias'], float('nan'))
    return g


@pytest.mark.parametrize('twin', TWINS)
def test_twins_are_the_optimizer(twin):
    """Each twin follows its Optimizer (whole-model callbacks run by the engine, each group its chain) step for step
    in float64 (clipped, skipped and accumulated steps among them), with the same state_dict (the whole-model
    callbacks' counts in the groups); `from_state_dict` of the Optimizer's gives the state back, and an Optimizer
    loading `to_state_dict` continues as the twin does."""
    model = make_model(dtype=F64)
    ref = copy.deepcopy(model)
    fopt, loss, params = TWINS[twin](), loss_fn(model), detached(model)
    opt = twin_optimizer(list(ref.named_parameters()), twin)
    state = fopt.init(params)
    for i in range(12):
        g = grads_at(loss, params, i, twin)
        params, state = fopt.update(params, g, state)
        for n, p in ref.named_parameters(): p.grad = g[n].clone()
        opt.step()
        assert_close(params, dict(ref.named_parameters()), 1e-12, f"{twin} step {i}:")
    ours, theirs = fopt.to_state_dict(state), opt.named_state_dict()
    assert [{k: v for k, v in g.items() if k != 'lr'} for g in ours['param_groups']] == \
        [{k: v for k, v in g.items() if k != 'lr'} for g in theirs['param_groups']]
    for n, st in theirs['state'].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor): assert_tensor_close(ours['state'][n][k], v, f"{n} {k}", 1e-12)
            else: assert ours['state'][n][k] == v, (n, k)
    back = fopt.to_state_dict(fopt.from_state_dict(opt.state_dict(), params))
    assert back['param_groups'] == ours['param_groups']
    other = copy.deepcopy(ref)
    opt2 = twin_optimizer(list(other.named_parameters()), twin)
    opt2.load_state_dict(ours)
    for i in range(12, 15):
        g = grads_at(loss, params, i, twin)
        params, state = fopt.update(params, g, state)
        for n, p in other.named_parameters(): p.grad = g[n].clone()
        opt2.step()
    assert_close(params, dict(other.named_parameters()), 1e-12, f"{twin} after loading to_state_dict:")
    if twin == 'multi_steps':
        assert state['skip_nonfinite']['skipped_total'].item() == 2 and state['0.weight']['step'].item() == 4


@pytest.mark.parametrize('twin', TWINS)
def test_twins_vmap(twin):
    """vmap over 3 members, each clipping, skipping and accumulating on its own grads (member 1's step 4 holds a NaN:
    it alone skips), equals each member's own updates."""
    models = ensemble(3, F64)
    fopt, loss = TWINS[twin](), mse(models[0])
    params = {k: v.detach() for k, v in stack_module_state(models)[0].items()}
    state = vmap(fopt.init)(params)
    singles = [(detached(m), fopt.init(detached(m))) for m in models]
    for i in range(7):
        xs, ys = zip(*(batch(3 * i + j, F64) for j in range(3)))
        x, y = torch.stack(xs), torch.stack(ys)
        g = vmap(grad(loss))(params, x, y)
        g = {k: v * (3. if i % 2 else 0.2) for k, v in g.items()}
        if i == 4 and twin == 'multi_steps': g['0.bias'][1] = float('nan')
        params, state = vmap(fopt.update)(params, g, state)
        singles = [fopt.update(p, {k: v[j] for k, v in g.items()}, s) for j, (p, s) in enumerate(singles)]
    for j, (p, _) in enumerate(singles): assert_close({k: v[j] for k, v in params.items()}, p, 1e-12, f"member {j}:")
    if twin == 'multi_steps': assert state['skip_nonfinite']['skipped_total'].tolist() == [0., 1., 0.]


@pytest.mark.parametrize('twin', TWINS)
def test_twins_compile_and_grad(twin):
    """torch.compile(update, fullgraph=True) runs each twin in one graph (a skip is a torch.where), as eager does,
    with no recompile as the lr, the counts and the skips change; torch.func.grad through 3 updates with respect to
    the start params equals finite differences along a direction (float64)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    model = make_model(dtype=F64)
    fopt, loss = TWINS[twin](), loss_fn(model)
    update = torch.compile(fopt.update, fullgraph=True, backend='aot_eager')
    eager = compiled = detached(model)
    s_eager = s_compiled = fopt.init(eager)
    before = counters['stats']['unique_graphs']
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(6):
            g = grads_at(loss, eager, i, twin)
            lr = torch.tensor(1e-2 / (1 + i), dtype=F64)
            eager, s_eager = fopt.update(eager, g, s_eager, lr=lr)
            compiled, s_compiled = update(compiled, g, s_compiled, lr=lr)
            assert_close(compiled, eager, 1e-12, f"step {i}:")
    assert counters['stats']['unique_graphs'] - before == 1
    p0 = detached(model)
    v = {k: torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=F64) for k, p in p0.items()}
    def unrolled(p):
        state = fopt.init(p)
        for i in range(3): p, state = fopt.update(p, {k: g * (3. if i % 2 else 0.2) for k, g in grad(loss)(p, i).items()}, state)
        return loss(p, 99)
    meta = grad(unrolled)(p0)
    along = sum((meta[k] * v[k]).sum() for k in p0).item()
    h = 1e-6
    fd = (unrolled({k: p + h * v[k] for k, p in p0.items()}) - unrolled({k: p - h * v[k] for k, p in p0.items()})) / (2 * h)
    assert along == pytest.approx(fd.item(), rel=1e-5)


def nested(flat: dict):
    "`make_model`'s params as nested containers: a dict of a list and a namedtuple."
    Layer = collections.namedtuple('Layer', 'weight bias')
    return {'layers': [Layer(flat['0.weight'], flat['0.bias'])], 'head': {'weight': flat['2.weight'], 'bias': flat['2.bias']}}


def renamed(flat: dict) -> dict:
    "The flat form of `nested`: its dotted paths."
    names = {'0.weight': 'layers.0.weight', '0.bias': 'layers.0.bias', '2.weight': 'head.weight', '2.bias': 'head.bias'}
    return {names[k]: v for k, v in flat.items()}


@pytest.mark.parametrize('twin', TWINS)
def test_nested_is_flat(twin):
    """init and update over nested containers (a dict of a list of namedtuples and a dict) give what the flat dict of
    their dotted paths gives, bit for bit, and the same to_state_dict; the state mirrors the nesting; grads may come
    nested or flat."""
    model = make_model(dtype=F64)
    fopt, loss = TWINS[twin](), loss_fn(model)
    flat = detached(model)
    tree = nested(flat)
    s_flat, s_tree = fopt.init(renamed(flat)), fopt.init(tree)
    for i in range(5):
        g = grads_at(loss, flat, i, twin)
        flat_new, s_flat = fopt.update(renamed(flat), renamed(g), s_flat)
        tree, s_tree = fopt.update(tree, nested(g) if i % 2 else renamed(g), s_tree)
        flat = dict(zip(flat, flat_new.values()))
    assert type(tree['layers'][0]).__name__ == 'Layer' and torch.equal(tree['layers'][0].weight, flat['0.weight'])
    assert _same_state_dicts(fopt.to_state_dict(s_tree), fopt.to_state_dict(s_flat))
    if twin != 'partition':
        assert isinstance(s_tree['layers'][0], tuple) and set(s_tree['head']['bias']) >= {'step', 'grad_avg'}
    back = fopt.from_state_dict(fopt.to_state_dict(s_tree), tree)
    assert _same_state_dicts(fopt.to_state_dict(back), fopt.to_state_dict(s_tree))


def _same_state_dicts(a: dict, b: dict) -> bool:
    assert a['param_groups'] == b['param_groups'] and a['state'].keys() == b['state'].keys()
    for n, st in a['state'].items():
        assert st.keys() == b['state'][n].keys()
        for k, v in st.items(): assert torch.equal(v, b['state'][n][k]) if isinstance(v, torch.Tensor) else v == b['state'][n][k]
    return True


def test_list_params_state_under_params():
    "Params as a list: the state's per-param part is the list, under 'params', beside 'hypers'; FQNs are the indices."
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2)
    params = [torch.randn(3, dtype=F64), torch.randn(2, 2, dtype=F64)]
    state = fopt.init(params)
    assert isinstance(state['params'], list) and state['params'][1]['grad_avg'].shape == (2, 2)
    new, state = fopt.update(params, [torch.ones(3, dtype=F64), None], state)
    assert isinstance(new, list) and torch.equal(new[1], params[1]) and not torch.equal(new[0], params[0])
    assert list(fopt.to_state_dict(state)['state']) == ['0', '1']


def test_muon_is_a_partition():
    """cbopt.functional(cbopt.Muon) is a partition: Muon's matrices in one label, AdamW's params in the other; so is
    the functional form of a Muon optimizer (its params by name), and both step as it does."""
    model = make_model(dtype=F64)
    fopt = cbopt.functional(cbopt.Muon, lr=1e-2)
    params = detached(model)
    state = fopt.init(params)
    assert isinstance(fopt, cbopt.functional.Partition)
    assert set(state) == {'group0', 'group1'} and '0.weight' in state['group0'] and '0.bias' in state['group1']
    opt = cbopt.Muon(model.named_parameters(), lr=1e-2)
    of_opt = cbopt.functional(opt)
    assert isinstance(of_opt, cbopt.functional.Partition) and of_opt.labels['0.bias'] == 'group1'
    loss = loss_fn(model)
    s2 = of_opt.init(params)
    p1 = p2 = params
    for i in range(3):
        g = grad(loss)(p1, i)
        p1, state = fopt.update(p1, g, state)
        p2, s2 = of_opt.update(p2, g, s2)
        for n, p in model.named_parameters(): p.grad = g[n].clone()
        opt.step()
    assert_close(p1, dict(model.named_parameters()), 1e-12)
    assert_close(p2, p1, 0.)


def test_partition_errors():
    params = detached(make_model())
    adam = cbopt.functional(cbopt.Adam)
    with pytest.raises(KeyError, match="no label for param '2.bias'"):
        cbopt.functional.partition({'a': adam}, {'0.weight': 'a', '0.bias': 'a', '2.weight': 'a'}).init(params)
    with pytest.raises(ValueError, match="'0.bias' has the label 'b', which has no transform"):
        cbopt.functional.partition({'a': adam}, lambda n, p: 'a' if p.ndim == 2 else 'b').init(params)
    with pytest.raises(TypeError, match="transforms\\['a'\\] is a Optimizer"):
        cbopt.functional.partition({'a': cbopt.Adam(make_model().parameters())}, {})
    p = cbopt.functional.partition({'a': adam}, lambda n, p: 'a')
    with pytest.raises(TypeError, match="did you mean 'lr'"):
        p.update(params, params, p.init(params), lrr=0.1)


def test_functional_of_a_drop_in_class():
    "A class of cbopt.optim (torch's signature) is a factory too: functional(cbopt.optim.SGD, ...) steps as torch's SGD."
    model = make_model(dtype=F64)
    ref = copy.deepcopy(model)
    fopt, loss, params = cbopt.functional(cbopt.optim.SGD, lr=0.1, momentum=0.9, nesterov=True), loss_fn(model), detached(model)
    topt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    state = fopt.init(params)
    for i in range(4):
        params, state = fopt.update(params, grad(loss)(params, i), state)
        topt.zero_grad()
        loss(dict(ref.named_parameters()), i).backward()
        topt.step()
    assert_close(params, dict(ref.named_parameters()), 1e-12)
