"""torch's compiled-optimizer recipe, `@torch.compile def step(): opt.step()`, on cbopt optimizers: the step traces into
the caller's graph (`fullgraph=True`, one frame), in every backend setting, as torch's own optimizers do; it steps as
the same optimizer does in eager mode (within the compiler's rounding, 1e-6 of each tensor's scale over 12 steps) and as
torch's compiled optimizer where cbopt.optim's class is torch's; it never recompiles as the step count grows or a tensor
lr changes (a new Python float lr may: torch's recompiles too). Where the step cannot be traced (see
`cbopt.engine.traced`) it runs eagerly, one graph break, with the same results. The graphs run with dynamo's `eager`
backend, and with `aot_eager` (functionalized, as inductor gets them, without its code generation: minutes on a busy
CPU) where in-place writes to params and state are checked against eager mode."""
import copy
import operator
import pickle
import warnings

import pytest

import torch
from torch._dynamo.utils import counters

import cbopt
from cbopt.core.chain import zeros
from cbopt.engine.traced import TRACED_BUCKET_PARAMS
from conftest import assert_tensors_close, NO_COMPILE_FALLBACK, sharded

pytestmark = NO_COMPILE_FALLBACK

BACKENDS = {'loop': 'loop', 'foreach': 'foreach', 'auto': 'auto',
            'fused': cbopt.Backend('fused', compiler='aot_eager')}  # aot_eager: tracing without inductor's codegen
OPTIMIZERS = {  # name: (cbopt factory, torch's class and arguments where cbopt.optim's class is torch's)
    'SGD': (lambda ps, lr: cbopt.SGD(ps, lr=lr, mom=0.9, wd=0.01), None),
    'Adam': (lambda ps, lr: cbopt.Adam(ps, lr=lr, wd=0.01), None),
    'RMSProp': (lambda ps, lr: cbopt.RMSProp(ps, lr=lr, mom=0.9), None),
    'Lion': (lambda ps, lr: cbopt.Lion(ps, lr=lr, wd=0.1), None),
    'optim.SGD': (cbopt.optim.SGD, (torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.01))),
    'optim.Adam': (cbopt.optim.Adam, (torch.optim.Adam, dict(weight_decay=0.01, amsgrad=True))),
    'optim.AdamW': (cbopt.optim.AdamW, (torch.optim.AdamW, dict(weight_decay=0.1))),
    'optim.RMSprop': (cbopt.optim.RMSprop, (torch.optim.RMSprop, dict(momentum=0.9, centered=True))),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _set_lr(opt, lr):
    for g in opt.param_groups:
        if isinstance(g['lr'], torch.Tensor): g['lr'].fill_(lr)
        else: g['lr'] = lr


def graphs() -> int:
    "The graphs dynamo compiled since its last reset (a restarted analysis of one frame counts once)."
    return counters['stats']['unique_graphs']


def run(make, lr, steps=12, compiled=True, fullgraph=True, new_lr_at=4, compiler='aot_eager'):
    """Train a small model `steps` steps with the optimizer `make(params, lr)`, its step compiled (torch's recipe) or
    eager; the lr changes at step `new_lr_at`, in place for a tensor, as a scheduler does. Returns the model and
    optimizer; `graphs()` counts the graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = make(model.parameters(), copy.deepcopy(lr))
    step = torch.compile(lambda: opt.step(), backend=compiler, fullgraph=fullgraph) if compiled else opt.step
    data = torch.Generator().manual_seed(1)
    for i in range(steps):
        model(torch.randn(8, 5, generator=data)).pow(2).mean().backward()
        step()
        opt.zero_grad()
        if i == new_lr_at: _set_lr(opt, lr / 2)
    return model, opt


@pytest.mark.parametrize('backend,lr_kind', [(b, 'tensor') for b in BACKENDS] + [('auto', 'float')])
def test_compiled_step_one_graph_every_backend(backend, lr_kind):
    """Adam's step in every backend setting: one graph with fullgraph, one frame over 12 steps (none for a new tensor
    lr; a new float lr is a new constant, as in torch's: at most one more), and the eager optimizer's numbers."""
    lr = 1e-2 if lr_kind == 'float' else torch.tensor(1e-2)
    def make(ps, lr): return cbopt.Adam(ps, lr=lr, wd=0.01, backend=BACKENDS[backend])
    model, opt = run(make, lr, compiler='eager')
    assert graphs() == (1 if lr_kind == 'tensor' else 2), graphs()
    ref, _ = run(make, lr, compiled=False)
    assert_tensors_close(list(model.parameters()), list(ref.parameters()), msg=backend)
    assert opt.state_dict()['state'][0]['step'] == 12 and isinstance(opt.state_dict()['state'][0]['step'], int)


@pytest.mark.parametrize('name', list(OPTIMIZERS))
def test_compiled_step_matches_eager_and_torch(name):
    """Each optimizer's compiled step (tensor lr): one frame, no warning (dynamo warns at what it traces through
    unchecked, such as an `lru_cache`), the eager optimizer's numbers, and where cbopt.optim's class is torch's, the
    numbers of torch's class compiled the same way, in no more graphs."""
    make, twin = OPTIMIZERS[name]
    if twin is not None: make = (lambda cls, kw: lambda ps, lr: cls(ps, lr=lr, **kw))(make, twin[1])
    lr = torch.tensor(1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        model, _ = run(make, lr, compiler='eager')
    assert not caught, [f'{w.filename}:{w.lineno}: {w.message}' for w in caught]
    ours = graphs()
    assert ours == 1
    ref, _ = run(make, lr, compiled=False)
    assert_tensors_close(list(model.parameters()), list(ref.parameters()), msg=name)
    if twin is not None:
        def theirs(ps, lr): return twin[0](ps, lr=lr, foreach=False, **twin[1])
        compiled, _ = run(theirs, lr, fullgraph=False, compiler='eager')
        assert ours <= graphs()  # (torch's SGD compiles again once its momentum buffers exist; cbopt's exist before)
        eager, _ = run(theirs, lr, compiled=False)
        assert_tensors_close(list(model.parameters()), list(eager.parameters()), msg=f'{name} vs torch')
        # torch's compiled step keeps its count as a float32 tensor (its bias corrections in float32): 3e-6 from its
        # eager step here, where cbopt computes its bias corrections in float64 (from float32 counts, as eager mode)
        assert_tensors_close(list(model.parameters()), list(compiled.parameters()), rtol=1e-5, msg=f'{name} vs torch compiled')


def test_no_graph_break_inside_a_function():
    "The step is part of the caller's graph: what comes before and after it too (torch's optimizers break there)."
    model = _model()
    opt = cbopt.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    for p in model.parameters(): p.grad = torch.ones_like(p)

    def step(x):
        y = x * 2
        opt.step()
        return y + 1
    explained = torch._dynamo.explain(step)(torch.ones(3))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_step_count_and_grads_under_compile():
    """A compiled step keeps the counts as torch keeps its `step`: 0-d float32 tensors it adds 1 to in place (the same
    tensor after the step), saves them as numbers, leaves the user's grads as they were (L2 decay rebinds the grad the chain sees), and alternates with eager steps
    without a recompile; a checkpoint loads both ways."""
    torch._dynamo.reset()
    counters.clear()
    model, ref_model = _model(), _model()
    opt = cbopt.optim.Adam(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    ref = cbopt.optim.Adam(ref_model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    step = torch.compile(lambda: opt.step(), backend='aot_eager', fullgraph=True)
    counts = None
    for i in range(9):
        x = torch.randn(8, 5)
        for m in (model, ref_model): m(x).pow(2).mean().backward()
        grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
        (opt.step if i % 3 == 2 else step)()  # every third step eager
        ref.step()
        for p, (g, before) in zip(model.parameters(), grads): assert p.grad is g and torch.equal(g, before)
        for o in (opt, ref): o.zero_grad()
        now = [cbopt.core.runtime.param_states(opt)[p]['step'] for p in model.parameters()]
        if counts is not None: assert all(a is b for a, b in zip(now, counts))  # (updated in place, as torch's)
        counts = now
    assert graphs() == 1
    assert_tensors_close(list(model.parameters()), list(ref_model.parameters()))
    count = cbopt.core.runtime.param_states(opt)[model[0].weight]['step']  # (the engine's count: opt.state shows torch's)
    theirs = torch.optim.Adam(_model().parameters())
    for p in theirs.param_groups[0]['params']: p.grad = torch.ones_like(p)
    torch.compile(theirs.step, backend='eager')()
    torch_count = theirs.state[theirs.param_groups[0]['params'][0]]['step']
    assert isinstance(count, torch.Tensor) and count.dtype == torch_count.dtype == torch.float32 and count.item() == 9
    assert count.ndim == torch_count.ndim == 0 and count.device == torch_count.device
    shown = opt.state[model[0].weight]['step']
    assert shown.dtype == torch.float32 and shown.device.type == 'cpu' and shown.item() == 9
    sd = opt.state_dict(format='cbopt')
    assert all(type(s['step']) is int and s['step'] == 9 for s in sd['state'].values())
    assert opt.state_dict()['state'][0]['step'] == 9.0  # (torch's format: a 0-d float32 tensor, as torch.optim.Adam's)
    ref.load_state_dict(sd)
    opt.load_state_dict(ref.state_dict())
    assert opt.state[model[0].weight]['step'].item() == 9


def _grad_guards(opt) -> list[str]:
    "The kinds of guard dynamo puts on the grads when it traces `opt.step()`."
    return sorted(g.create_fn_name() for g in torch._dynamo.explain(lambda: opt.step())().out_guards
                  if g.name.endswith('.grad'))


def test_grads_guarded_as_torchs_and_copies_read_their_own():
    """The compiled step reads its grads as torch's compiled optimizers read theirs (through `_init_group`: see
    `cbopt._torch.GradReader`): dynamo guards each grad as present, as it guards torch's AdamW's, not by its metadata
    at every call; a pickled, deep-copied or `cbopt.optim` optimizer reads its own params' grads (a new reader, left
    out of pickles), and steps as its eager twin."""
    torch._dynamo.reset()
    model = _model()
    for p in model.parameters(): p.grad = torch.ones_like(p)
    ours = _grad_guards(cbopt.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3)))
    theirs = _grad_guards(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    assert ours == theirs == ['NOT_NONE_MATCH'] * 4, (ours, theirs)
    opt = cbopt.Adam(model.parameters(), lr=torch.tensor(1e-3))
    assert '_optimizer_grads' not in opt.__getstate__()
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        params = [p for g in copied.param_groups for p in g['params']]
        assert copied.__dict__['_optimizer_grads'].param_groups[0]['params'] is copied.param_groups[0]['params']
        twin = copy.deepcopy(copied)
        for p in [*params, *(q for g in twin.param_groups for q in g['params'])]: p.grad = torch.full_like(p, 0.5)
        torch._dynamo.reset()
        step = torch.compile(lambda: copied.step(), backend='eager', fullgraph=True)
        for _ in range(3): step(); twin.step()
        assert_tensors_close(params, [p for g in twin.param_groups for p in g['params']])
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())  # (the original's untouched)
        assert not any(torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize('case', ['radam', 'clipping', 'closure'])
def test_untraceable_step_is_one_graph_break(case):
    """RAdam's rectification (`if r > 5` on a tensor count) and a whole-model callback (clipping) run the step eagerly:
    one graph break, which fullgraph refuses naming it, and the eager numbers. So does a closure (whose own call
    breaks the graph once more, as with torch's optimizers)."""
    make = {'radam': lambda ps, lr: cbopt.RAdam(ps, lr=lr),
            'clipping': lambda ps, lr: cbopt.GradientClippingOptimizer(cbopt.Adam(ps, lr=lr), cbopt.GradientClipping.NORM,
                                                                       max_gradient=0.1),
            'closure': lambda ps, lr: cbopt.Adam(ps, lr=lr)}[case]
    torch._dynamo.reset()
    model = _model()
    opt = make(model.parameters(), torch.tensor(1e-2))
    loss = lambda: model(torch.ones(2, 5)).sum()
    for p in model.parameters(): p.grad = torch.ones_like(p)

    def step(x):
        y = x * 2
        if case == 'closure': opt.step(lambda: loss())
        else: opt.step()
        return y + 1
    explained = torch._dynamo.explain(step)(torch.ones(3))
    assert explained.graph_break_count == (2 if case == 'closure' else 1), explained.break_reasons
    assert "cbopt's step runs eagerly" in ' '.join(str(r.reason) for r in explained.break_reasons)
    if case != 'closure':
        with pytest.raises(torch._dynamo.exc.Unsupported, match="cbopt's step runs eagerly"):
            torch.compile(step, backend='eager', fullgraph=True)(torch.ones(3))
        model, _ = run(make, torch.tensor(1e-2), fullgraph=False, compiler='eager')
        ref, _ = run(make, torch.tensor(1e-2), compiled=False)
        assert_tensors_close(list(model.parameters()), list(ref.parameters()), rtol=0)


def test_state_created_in_a_later_step_and_none_grads():
    "A param whose first grad comes in a later compiled step gets its state then (a new trace), and steps as eager."
    torch._dynamo.reset()
    results = []
    for compiled in (True, False):
        model = _model()
        opt = cbopt.Adam(model.parameters(), lr=1e-2)
        step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True) if compiled else opt.step
        for i in range(6):
            model(torch.ones(2, 5)).sum().backward()
            if i < 3: model[2].bias.grad = None
            step()
            opt.zero_grad()
        results.append(list(model.parameters()))
        assert opt.state_dict()['state'][3]['step'] == 3 and opt.state_dict()['state'][0]['step'] == 6
    assert_tensors_close(results[0], results[1])


def _two_groups(make, lrs=(0.01, 0.02), seed=4) -> tuple[list, object]:
    "Two groups of two params each (the second group's last param never gets a grad), made from one seed."
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((3, 2), (4,), (5,), (2,))]
    return ps, make([{'params': ps[:2], 'lr': lrs[0]}, {'params': ps[2:], 'lr': lrs[1]}])


def _set_grads(ps: list, i: int) -> None:
    for j, p in enumerate(ps[:3]): p.grad = torch.linspace(-1., 2., p.numel()).view(p.shape) * (i + 1) + j


def _refusing(case: str, mesh=None):
    if case == 'radam': return _two_groups(lambda gs: cbopt.RAdam(gs, backend='loop'))  # `if r > 5` on the count
    if case == 'clip':  # a whole-model callback
        return _two_groups(lambda gs: cbopt.Optimizer(gs, [cbopt.clip_grad_norm, cbopt.sgd_step], max_norm=1.))
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, backend='loop'))
    if case == 'found_inf': opt.found_inf = torch.zeros(())
    if case == 'grad_scale': opt.grad_scale = torch.ones(())
    if case == 'eval': opt.param_groups[1]['train_mode'] = False
    return ps, opt


def test_the_traced_step_run_eagerly_steps_as_torch() -> None:
    """What dynamo traces (`can_trace`, then `traced_step`), run eagerly: per param, each group with its own lr, as
    torch's Adam over 4 steps (a param without a grad left alone); the counts become 0-d float32 tensors, as torch's, and an
    eager step after it goes on from them."""
    from cbopt.engine import traced
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, sqr_mom=0.999, eps=1e-8, wd=0.1, decouple_wd=False, backend='loop'))
    qs, ref = _two_groups(lambda gs: torch.optim.Adam(gs, weight_decay=0.1))
    untouched = ps[3].detach().clone()
    for i in range(5):
        _set_grads(ps, i)
        _set_grads(qs, i)
        if i < 4:
            assert traced.can_trace(opt)
            traced.traced_step(opt)
            assert opt.step_stats == {'lr': [0.01, 0.02], 'skipped': False}
        else: opt.step()
        ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')
        if i < 4:
            steps = [opt.state[p]['step'] for p in ps[:3]]
            assert all(s.dtype == torch.float32 and s.ndim == 0 and s.item() == i + 1 for s in steps), steps
    assert torch.equal(ps[3], untouched) and not opt.state[ps[3]]
    assert_tensors_close([opt.state[p]['sqr_avg'] for p in ps[:3]], [ref.state[q]['exp_avg_sq'] for q in qs[:3]])


@pytest.mark.parametrize('case', ['radam', 'clip', 'found_inf', 'grad_scale', 'eval', 'dtensor', 'adam'])
def test_can_trace_refuses_what_only_the_eager_step_does_and_changes_nothing(case, one_rank_mesh) -> None:
    """`can_trace` (run as dynamo traces a step) refuses a chain reading a Python value of a tensor, a whole-model
    callback, GradScaler's flags, a group in eval mode and DTensor params, and then changes nothing (no state, no
    param moved); it accepts Adam and creates its state, the count a 0-d float32 tensor (as torch's), without stepping."""
    from cbopt.engine import traced
    if case == 'dtensor':
        ps = [torch.nn.Parameter(sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))]
        opt = cbopt.Adam(ps, backend='loop')
        ps[0].grad = sharded(one_rank_mesh, torch.ones(6))
    else:
        ps, opt = _refusing(case)
        _set_grads(ps, 0)
    before = [p.detach().clone() for p in ps]
    assert traced.can_trace(opt) is (case == 'adam')
    for p, b in zip(ps, before): assert torch.equal(p.detach(), b)
    if case != 'adam': assert not any(opt.state[p] for p in ps)
    else:
        assert [sorted(opt.state[p]) for p in ps] == [['grad_avg', 'sqr_avg', 'step']] * 3 + [[]]
        assert all(torch.equal(opt.state[p]['step'], torch.zeros((), dtype=torch.float32)) for p in ps[:3])


def test_number_tensor_is_a_float64_count_on_the_params_device() -> None:
    from cbopt.engine.traced import number_tensor
    t = number_tensor(2 ** 53, torch.zeros(2, device='meta'))
    assert (t.dtype, t.device, t.shape) == (torch.float64, torch.device('meta'), torch.Size([]))
    assert number_tensor(2 ** 53, torch.zeros(2)).item() == 2 ** 53
    x = torch.ones(())
    assert number_tensor(x, torch.zeros(2)) is x


def test_count_tensor_is_torchs_step_on_the_params_device() -> None:
    "A count as torch's compiled optimizers keep `step`: a 0-d float32 tensor on the param's device (a tensor kept)."
    from cbopt.engine.traced import count_tensor
    t = count_tensor(7, torch.zeros(2, device='meta'))
    assert (t.dtype, t.device, t.shape) == (torch.float32, torch.device('meta'), torch.Size([]))
    assert count_tensor(2 ** 24, torch.zeros(2)).item() == 2 ** 24
    x = torch.ones((), dtype=torch.float64)
    assert count_tensor(x, torch.zeros(2)) is x


def test_an_outer_compiled_step_is_traced_whole_and_a_closure_runs_eagerly() -> None:
    """torch's compiled-optimizer recipe with dynamo's `eager` backend: the step traced into the caller's graph
    (fullgraph: no break) as torch's Adam steps; with a closure the step runs eagerly (one graph break), the closure
    called once a step and its loss returned."""
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, sqr_mom=0.999, eps=1e-8, wd=0., backend='loop'))
    qs, ref = _two_groups(lambda gs: torch.optim.Adam(gs))
    whole = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    calls = []
    def closure():
        calls.append(1)
        return torch.tensor(float(len(calls)))
    with_closure = torch.compile(lambda: opt.step(closure), backend='eager')
    for i in range(4):
        _set_grads(ps, i)
        _set_grads(qs, i)
        if i % 2: assert with_closure().item() == len(calls) == (i + 1) // 2
        else: whole()
        ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')


def _graph_ops(make, layers: int) -> int:
    "The ops of the graph dynamo traces for `make`'s step on an MLP of `layers` Linear layers, beside indexing."
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    opt = make(model.parameters())
    for p in model.parameters(): p.grad = torch.ones_like(p)
    ops = []
    def count(gm, example_inputs):
        ops.append(sum(n.op in ('call_function', 'call_method') and n.target is not operator.getitem
                       for n in gm.graph.nodes))
        return gm.forward
    torch.compile(lambda: opt.step(), backend=count, fullgraph=True)()
    assert len(ops) == 1
    return ops[0]


@pytest.mark.parametrize('name', ['Adam', 'Lion', 'optim.RMSprop'])
def test_the_graph_holds_one_chain_per_bucket_whatever_the_params(name):
    """The traced step runs each bucket's chain once, as foreach ops over its params (as torch's compiled optimizers):
    the graph of a 12-layer MLP's step (24 params) has the ops of a 2-layer one's, but for at most two per added param
    where a 0-d tensor meets the bucket's tensors (dynamo's `full_like` per param where a 0-d count meets a foreach
    op, as in torch's compiled RMSprop's graph; a product and a quotient per param with Adam's bias corrections,
    computed once per bucket: `core.tensorlist._OPERATORS`), where a chain traced per param has 6x."""
    make, twin = OPTIMIZERS[name]
    if twin is not None: make = (lambda cls, kw: lambda ps, lr: cls(ps, lr=lr, **kw))(make, twin[1])
    small, large = (_graph_ops(lambda ps: make(ps, torch.tensor(1e-2)), n) for n in (2, 12))
    assert large - small <= 2 * 20, (small, large)


def shaped_sgd(p, lr, **kwargs):
    "SGD written with the param's shape, which a whole bucket has none of: it cannot run bucket-wise."
    p.data.sub_(p.grad.reshape(p.shape) * lr)
shaped_sgd.defaults, shaped_sgd.state = {}, {}


def test_a_chain_that_cannot_run_bucket_wise_is_traced_per_param_with_a_warning():
    """A callback that cannot run on a whole bucket (it reads `p.shape`) is traced once per param, with one warning
    naming it; still one graph, no break, and the eager loop's numbers."""
    def make(ps, lr): return cbopt.Optimizer(ps, [cbopt.weight_decay, shaped_sgd], lr=lr, wd=0.01)
    with pytest.warns(UserWarning, match="callback 'shaped_sgd' cannot run on a whole bucket"):
        model, _ = run(make, torch.tensor(1e-2), compiler='eager')
    assert graphs() == 1
    ref, _ = run(lambda ps, lr: cbopt.Optimizer(ps, [cbopt.weight_decay, shaped_sgd], lr=lr, wd=0.01, backend='loop'),
                 torch.tensor(1e-2), compiled=False)
    assert_tensors_close(list(model.parameters()), list(ref.parameters()))
    with pytest.warns(UserWarning, match="'shaped_sgd'"):
        small, large = [_graph_ops(lambda ps: make(ps, torch.tensor(1e-2)), n) for n in (2, 12)]
    assert large > 5 * small, (small, large)  # (6x the params)


CATALOGUE = ['sgd-mom', 'sgd-nesterov', 'adam', 'adam-l2', 'adam-amsgrad', 'rmsprop', 'rmsprop-mom', 'qhadam', 'lamb',
             'stableadamw', 'nadam', 'adamax', 'lion-prebuilt']


def test_optimizers_compiled_in_one_process_compile_as_alone():
    """dynamo keeps its caches per code object for the whole process (8 entries each, then eager, or an error under
    fullgraph): each optimizer's `opt.step` has a code object of its own (`cbopt.engine.own_step`), so 13 catalogue
    optimizers compiled one after the other in one process (no `torch._dynamo.reset()`) each compile once, with
    fullgraph, and never again over 3 steps; torch's hook wrapper, which every optimizer's step would be, hits the
    limit at the ninth."""
    from cases import CASES
    cases = {str(c): c for c in CASES}
    compiles = {}
    for name in CATALOGUE:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
        opt = cases[name].build(ps, torch.tensor(1e-2), 'loop')
        compiles[name] = 0
        def count(gm, example_inputs, name=name):
            compiles[name] += 1
            return gm.forward
        step = torch.compile(opt.step, backend=count, fullgraph=True)
        for i in range(3):
            for p in ps: p.grad = torch.full_like(p, i + 1.)
            step()
    assert compiles == {name: 1 for name in CATALOGUE}
    assert opt.step.__code__ is not type(opt).step.hooked_fn.__code__  # (the last one's: its own code)



def test_an_eager_step_between_compiled_ones_does_not_recompile():
    """A process whose first step of a group's keys is compiled, then one eager step, then compiled steps again: one
    graph. (The hyper keys of a group are cached per process after an eager step; had the traced step read that cache,
    dynamo would have guarded that the group's keys were missing from it, and recompiled once they were added.)"""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = cbopt.Adam(model.parameters(), lr=torch.tensor(1e-2))
    opt.param_groups[0]['a_key_no_other_test_uses'] = 1.0  # (a set of group keys new to this process)
    ref = _model()
    eager = cbopt.Adam(ref.parameters(), lr=torch.tensor(1e-2), backend='loop')
    step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    for i in range(4):
        for m in (model, ref): m(torch.full((2, 5), i + 1.)).pow(2).mean().backward()
        (opt.step if i == 1 else step)()
        eager.step()
        opt.zero_grad()
        eager.zero_grad()
    assert graphs() == 1
    assert_tensors_close(list(model.parameters()), list(ref.parameters()), rtol=1e-6)


def rebinding_momentum(p, lr, mom, buf=None, **kwargs):
    "Momentum SGD whose callback returns a new buffer each step (no in-place update): a user's chain may."
    buf = (torch.zeros_like(p.grad.data) if buf is None else buf) * mom + p.grad.data
    p.data.sub_(buf * lr)
    return {'buf': buf}
rebinding_momentum.defaults, rebinding_momentum.state = dict(mom=0.9), dict(buf=zeros)


def test_state_stays_the_same_tensors_and_a_rebound_entry_compiles_once():
    """The traced step's params and state are kept static, guarded by identity, as torch's compiled optimizers keep
    theirs: a callback returning a new buffer each step has it copied into the old one, so the step compiles once over
    6 steps (fullgraph) and steps as the eager loop; every state tensor is the one the first step made."""
    make = lambda ps, lr: cbopt.Optimizer(ps, [rebinding_momentum], lr=lr)
    model, opt = run(make, torch.tensor(1e-2), steps=6, compiler='aot_eager')
    assert graphs() == 1
    ref, _ = run(lambda ps, lr: cbopt.Optimizer(ps, [rebinding_momentum], lr=lr, backend='loop'), torch.tensor(1e-2),
                 steps=6, compiled=False)
    assert_tensors_close(list(model.parameters()), list(ref.parameters()))
    torch._dynamo.reset()
    model, opt = _model(), None
    opt = cbopt.Adam(model.parameters(), lr=torch.tensor(1e-2))
    step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    for p in model.parameters(): p.grad = torch.ones_like(p)
    step()
    first = {id(p): dict(opt.state[p]) for p in model.parameters()}
    for _ in range(3): step()
    assert all(opt.state[p][k] is v for p in model.parameters() for k, v in first[id(p)].items())


def _in_element_loops(code: str, needle: str) -> int:
    "How many lines of inductor's C++ `code` hold `needle` inside a `for` loop (a loop over a param's elements)."
    depth, loops, pending, found = 0, [], False, 0
    for line in code.splitlines():
        if needle in line and loops: found += 1
        if 'for(' in line: pending = True
        for ch in line:
            if ch == '{':
                depth += 1
                if pending: loops.append(depth)
                pending = False
            elif ch == '}':
                if loops and loops[-1] == depth: loops.pop()
                depth -= 1
    return found


def test_inductor_computes_the_bias_corrections_once_and_steps_as_eager():
    """With inductor (torch.compile's default), the traced Adam step computes its float64 bias corrections once per
    bucket, from the bucket's one count (`_share_counts`), before the loops over its params' elements
    (`_torch.computed_once`), not for each vector of them: two 0-d buffers for the model's one bucket, none per param;
    and it still steps within 1e-6 of the eager step over 12 steps."""
    from torch._inductor.utils import run_and_get_code
    def make(ps, lr): return cbopt.Adam(ps, lr=lr, wd=0.01)
    (model, opt), codes = run_and_get_code(run, make, torch.tensor(1e-2), compiler='inductor')
    assert graphs() == 1
    ref, _ = run(make, torch.tensor(1e-2), compiled=False)
    assert_tensors_close(list(model.parameters()), list(ref.parameters()))
    code = '\n'.join(codes)
    assert code.count('std::pow') >= 2 and _in_element_loops(code, 'std::pow') == 0, code
    assert code.count('empty_strided_cpu((), ()') == 2, code
    assert opt.state_dict()['state'][0]['step'] == 12


def test_a_bucket_steps_one_count_tensor_and_an_eager_step_between_keeps_them_right():
    """40 params with equal counts step in two traced buckets (`TRACED_BUCKET_PARAMS`, 32, then 8), each holding one
    count (`_share_counts`: 40 tensors, two storages), which the compiled step reads once and writes back once: one
    `pow` per bias correction per bucket in the whole C++, none in an element loop. After 3 compiled steps, one eager
    step in which one param has no grad (its count stays, the others' advance) and 3 compiled steps again, every param
    is within 1e-6 of the eager optimizer's, each count is its param's own number of steps, and the params with equal
    counts share a storage again, 32 to a storage, the other one a storage of its own."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(20)])
    def train(m, step, steps, skip=None):
        for i in range(steps):
            for p in m.parameters(): p.grad = torch.full_like(p, 0.1 * (i + 1)) + p.detach()
            if skip is not None: list(m.parameters())[skip].grad = None
            step()
    ours, ref = model(), model()
    opt = cbopt.Adam(ours.parameters(), lr=torch.tensor(1e-2), wd=0.01)
    eager = cbopt.Adam(ref.parameters(), lr=torch.tensor(1e-2), wd=0.01)
    compiled = torch.compile(lambda: opt.step(), fullgraph=True)
    _, codes = run_and_get_code(train, ours, compiled, 3)
    train(ref, eager.step, 3)
    code = '\n'.join(codes)
    assert TRACED_BUCKET_PARAMS == 32
    assert code.count('std::pow') == 4 and _in_element_loops(code, 'std::pow') == 0, code
    raw = cbopt.core.runtime.param_states(opt)
    counts = [raw[p]['step'] for p in ours.parameters()]
    assert len({id(t) for t in counts}) == 40  # (each guarded: see `_same_count`)
    assert _storages(counts) == [list(range(32)), list(range(32, 40))]
    for m, step in ((ours, opt.step), (ref, eager.step)): train(m, step, 1, skip=5)
    train(ours, compiled, 3)
    train(ref, eager.step, 3)
    assert_tensors_close(list(ours.parameters()), list(ref.parameters()))
    steps = [opt.state_dict()['state'][i]['step'] for i in range(40)]
    assert steps == [6 if i == 5 else 7 for i in range(40)], steps
    others = [i for i in range(40) if i != 5]
    assert _storages([raw[p]['step'] for p in ours.parameters()]) == [others[:32], [5], others[32:]]


def _storages(ts: list) -> list:
    "The indices of `ts` grouped by the storage they hold, in order of first appearance."
    by_ptr: dict = {}
    for i, t in enumerate(ts): by_ptr.setdefault(t.data_ptr(), []).append(i)
    return list(by_ptr.values())


def test_a_count_set_for_one_param_between_compiled_steps_traces_again():
    """Setting one param's step count through torch's names (`opt.state[p]['step'] = 0`, cbopt.optim) gives it a new
    count tensor, never a write into its bucket's shared one: the compiled step traces again, buckets that param apart,
    and steps every param as the eager optimizer with the same change, over 6 steps."""
    results, raw = [], cbopt.core.runtime.param_states
    for compiled in (True, False):
        torch._dynamo.reset()
        model = _model()
        opt = cbopt.optim.Adam(model.parameters(), lr=1e-2)
        step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True) if compiled else opt.step
        ps = list(model.parameters())
        for i in range(6):
            model(torch.ones(2, 5)).sum().backward()
            if i == 3: opt.state[ps[1]]['step'] = torch.tensor(0.)
            step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in ps])
        assert [float(raw(opt)[p]['step']) for p in ps] == [6., 3., 6., 6.]
    assert_tensors_close(results[0], results[1])


def _signed_sgd(p, lr, sign=1.0, **kwargs):
    "A user's SGD step with a Python number in its state (`sign`), which the state's owner may change between steps."
    p.data.add_(p.grad, alpha=-lr * sign)
    return {'sign': sign}


def test_a_state_changed_between_compiled_steps_traces_again_and_steps_as_eager():
    """The traced step buckets params by their state's keys and Python values, which dynamo guards: an entry added to
    one param's state between compiled steps, or a Python value in it changed, fails the guards, and the step traces
    again and steps as the eager one does with the changed state."""
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (True, False):
        model = _model()
        opt = cbopt.Optimizer(model.parameters(), [_signed_sgd], lr=1e-2)
        step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True) if compiled else opt.step
        ps = list(model.parameters())
        for i in range(6):
            model(torch.ones(2, 5)).sum().backward()
            if i == 2: opt.state[ps[0]]['sign'] = -1.0
            if i == 4: opt.state[ps[1]]['extra'] = torch.zeros(())
            step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in ps])
        assert opt.state[ps[0]]['sign'] == -1.0 and 'extra' in opt.state[ps[1]]
    assert_tensors_close(results[0], results[1])
    # traces: the first; the second step's, with the state the first step made (the callback declares none); one after
    # the sign changed; one after the entry was added
    assert graphs() == 4


def test_float32_and_float64_params_in_one_group_compile_once_and_step_as_eager():
    """NAdam keeps `mu_product` as a 0-d tensor of its param's precision. The traced step hands the chain copies of the
    0-d float64 entries alone, so a float32 param's `mu_product` stays the static tensor it is: over 6 steps of a group
    holding a float32 and a float64 param, one graph, and the eager step's numbers."""
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (True, False):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
        opt = cbopt.NAdam(ps, lr=1e-2)
        step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True) if compiled else opt.step
        for i in range(6):
            for p in ps: p.grad = torch.linspace(-1., 2., p.numel(), dtype=p.dtype).view(p.shape) * (i + 1)
            step()
        results.append([p.detach().clone() for p in ps])
        assert [opt.state[p]['mu_product'].dtype for p in ps] == [torch.float32, torch.float64]
    assert_tensors_close(results[0], results[1])
    assert graphs() == 1
