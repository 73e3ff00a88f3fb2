"""`cbopt._torch`, the private torch APIs: each one taken away (as a torch that lacks or renamed it would) degrades to
its documented fallback with one warning, stepping what the loop backend steps; never an import error or a crash in
the middle of a step. Also: an unknown dynamo setting or inductor option falls back to foreach inside the compiled
runner's `try`."""
import collections
import contextlib
import sys
import warnings

import pytest
import torch

import cbopt
from cbopt import _torch
from cbopt.engine import compiled, scalars
from conftest import assert_rel_close, assert_same_params, batch_loss, make_model, train

pytestmark = pytest.mark.usefixtures('one_thread', 'fresh_warnings')

STEPS = 4


@pytest.fixture
def fresh_warnings(monkeypatch):
    "Each test sees `_torch`'s once-per-process warnings afresh."
    monkeypatch.setattr(_torch, '_WARNED', set())


def stepped(make_opt, steps: int = STEPS, record: bool = True):
    "A fresh model trained `steps` steps by `make_opt(params)`, and the warnings raised on the way."
    m = make_model()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        train(make_opt(m.parameters()), m, steps)
    return m, [str(w.message) for w in ws]


def loop_twin(make, steps: int = STEPS):
    return stepped(lambda ps: make(ps, 'loop'), steps)[0]


def only(ws: list, text: str) -> list:
    return [w for w in ws if text in w]


def adamw(ps, backend): return cbopt.Adam(ps, lr=1e-2, wd=0.1, backend=backend)


@pytest.mark.parametrize('backend', ['auto', cbopt.Backend('fused', compiler='aot_eager')])
def test_missing_fused_kernel_steps_the_chain(monkeypatch, backend):
    """Without `torch._fused_adamw_`, AdamW's `auto` backend runs foreach/loop and `fused` the compiled chain: one
    warning naming the kernel, the loop's params."""
    monkeypatch.delattr(torch, '_fused_adamw_')
    m, ws = stepped(lambda ps: adamw(ps, backend))
    assert len(only(ws, 'torch._fused_adamw_')) == 1, ws
    assert not only(ws, 'could not be compiled'), ws
    if backend == 'auto': assert_same_params(m, loop_twin(adamw))
    else: assert_rel_close(m, loop_twin(adamw), rtol=1e-6)  # (compiled: the loop's ops, fused, within rounding)


@pytest.mark.parametrize('names', [('addcmul_', 'addcdiv_'), ('mul_', 'sqrt_')])
def test_missing_foreach_ops_run_per_tensor(monkeypatch, names):
    "Without some `torch._foreach_*` ops, the foreach backend runs each once per tensor: one warning each, the loop's."
    for n in names: monkeypatch.delattr(torch, f'_foreach_{n}')
    m, ws = stepped(lambda ps: adamw(ps, 'foreach'))
    for n in names: assert len(only(ws, f'torch._foreach_{n}')) == 1, ws
    assert_same_params(m, loop_twin(adamw))


@pytest.mark.parametrize('name, args, kwargs', [
    ('add_', lambda ts: (ts, [t * 2 for t in ts]), dict(alpha=0.5)),
    ('mul', lambda ts: (ts, 3.0), {}),
    ('addcmul_', lambda ts: (ts, ts, [t + 1 for t in ts]), dict(value=0.25)),
    ('addcdiv', lambda ts: (ts, ts, [t.abs() + 1 for t in ts], [0.5, -1.0, 2.0]), {}),
    ('lerp_', lambda ts: (ts, [t * 0 + 1 for t in ts], 0.3), {}),
    ('norm', lambda ts: (ts, 2), dict(dtype=torch.float64)),
    ('pow', lambda ts: (2.0, ts), {}),
    ('copy_', lambda ts: (ts, [t.flip(0) for t in ts]), {}),
    ('zero_', lambda ts: (ts,), {}),
    ('clone', lambda ts: (ts,), {}),
])
def test_per_tensor_fallback_is_the_foreach_op(name, args, kwargs):
    "The per-tensor stand-in of a foreach op gives what torch's op gives (in-place ones: the same writes), exactly."
    make = lambda: [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ours, theirs = make(), make()
    a, b = args(ours), args(theirs)
    got = _torch._per_tensor(name)(*a, **kwargs)
    want = getattr(torch, f'_foreach_{name}')(*b, **kwargs)
    if name.endswith('_'): assert got is None and all(torch.equal(x, y) for x, y in zip(ours, theirs))
    else: assert all(torch.equal(x, y) for x, y in zip(got, want))


def lion(ps, backend): return cbopt.Lion(ps, lr=1e-3, wd=0.1, backend=backend)  # (no torch kernel: the fused
# backend compiles its chain)


def assert_fell_back_to_foreach(make_opt) -> None:
    "The fused runner fell back to foreach with its one warning, and stepped what the loop steps."
    m, ws = stepped(make_opt)
    assert len(only(ws, 'could not be compiled')) == 1, ws
    assert_same_params(m, loop_twin(lion))


@pytest.mark.parametrize('setting', ['dynamo', 'shapes'])
def test_unknown_dynamo_setting_falls_back_to_foreach(monkeypatch, setting):
    """A dynamo setting this torch does not know (torch raises AttributeError as its patch is entered) is caught
    inside the compiled runner's fallback: the bucket runs foreach, with the one-time warning; nothing compiles."""
    if setting == 'dynamo': monkeypatch.setattr(_torch, 'DYNAMO_CONFIG', {**_torch.DYNAMO_CONFIG, 'no_such_key': False})
    else: monkeypatch.setattr(_torch, 'SHAPE_CONFIG', 'no_such_key')
    monkeypatch.setattr(torch, 'compile', lambda *a, **k: pytest.fail('compiled despite the unknown setting'))
    assert_fell_back_to_foreach(lambda ps: lion(ps, 'fused'))


def test_unknown_inductor_option_falls_back_to_foreach(monkeypatch):
    """An inductor option this torch does not know (`torch.compile` raises RuntimeError) is caught inside the
    fallback too."""
    monkeypatch.setattr(_torch, 'INDUCTOR_OPTIONS', {**_torch.INDUCTOR_OPTIONS, 'no_such_option': True})
    monkeypatch.setattr(compiled, '_COMPILED', {})  # (so the chain is compiled, with the options, again)
    assert_fell_back_to_foreach(lambda ps: lion(ps, 'fused'))


def test_without_the_graph_pass_api_compiles_without_scalars_once(monkeypatch):
    """Where torch lacks part of the graph-pass API (`get_hash_for_files` renamed, say), the compiled chain is
    compiled without the `ScalarsOnce` pass: one warning, no fallback to foreach, the loop's params."""
    import torch._inductor.custom_graph_pass as api
    monkeypatch.delattr(api, 'get_hash_for_files')  # (importing it fails)
    monkeypatch.setattr(scalars, '_CLASS', {})
    monkeypatch.setattr(compiled, '_COMPILED', {})
    passes = []
    real = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda *a, **k: passes.append(k['options']) or real(*a, **k))
    m, ws = stepped(lambda ps: lion(ps, 'fused'), steps=3)
    assert len(only(ws, 'ScalarsOnce')) == 1 and not only(ws, 'could not be compiled'), ws
    assert passes and all('post_grad_custom_post_pass' not in o for o in passes), passes
    assert_rel_close(m, loop_twin(lion, steps=3), rtol=1e-6)


def test_missing_strong_wolfe_is_a_clear_error_only_when_asked_for(monkeypatch):
    """Without torch's `_strong_wolfe`, `line_search_fn='strong_wolfe'` is refused when the optimizer is built, and by
    a step before it changes anything; L-BFGS without a line search steps as before."""
    monkeypatch.delattr(sys.modules['torch.optim.lbfgs'], '_strong_wolfe')
    m = make_model()
    with pytest.raises(ValueError, match='_strong_wolfe'): cbopt.LBFGS(m.parameters(), line_search_fn='strong_wolfe')
    opt, ref = make_model(), make_model()
    ours, theirs = cbopt.LBFGS(opt.parameters(), lr=0.5), torch.optim.LBFGS(ref.parameters(), lr=0.5)
    for model, o in ((opt, ours), (ref, theirs)):
        def closure(model=model, o=o):
            o.zero_grad()
            loss = batch_loss(model, 0)
            loss.backward()
            return loss
        o.step(closure)
    assert_same_params(opt, ref)
    before = [p.detach().clone() for p in opt.parameters()]
    ours.param_groups[0]['line_search_fn'] = 'strong_wolfe'
    with pytest.raises(ValueError, match='_strong_wolfe'): ours.step(closure=lambda: batch_loss(opt, 1))
    assert all(torch.equal(a, b) for a, b in zip(opt.parameters(), before))


def test_constant_result_marks_as_torch_does(monkeypatch):
    """`constant_result` without dynamo imported sets what `torch.compiler.assume_constant_result` sets (so dynamo,
    once imported, reads the mark it knows)."""
    def ours(): return 1
    def torchs(): return 1
    monkeypatch.setattr(_torch, 'dynamo_loaded', lambda: False)
    _torch.constant_result(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) != {}


def test_without_torchs_metadata_guard_the_plan_is_rebuilt(monkeypatch):
    "Without dynamo's C++ `TensorGuards`, the bucket plan is made at every step: the loop's params still."
    monkeypatch.setitem(sys.modules, 'torch._C._dynamo.guards', None)
    assert _torch.metadata_guard([torch.ones(2)]) is None
    m, ws = stepped(lambda ps: adamw(ps, 'foreach'))
    assert_same_params(m, loop_twin(adamw))


def test_flatten_and_leaves_fallbacks_are_torchs(monkeypatch):
    "`flatten_dense` and `tree_leaves` without torch's private helpers give what those give."
    ts = [torch.randn(2, 3), torch.randn(4), torch.randn(())]
    tree = {'a': [ts[0], (ts[1], 3)], 'b': {'c': ts[2]}}
    want_flat, want_leaves = _torch.flatten_dense(ts), _torch.tree_leaves(tree)
    monkeypatch.delattr(torch._utils, '_flatten_dense_tensors')
    monkeypatch.setitem(sys.modules, 'torch.utils._pytree', None)
    assert torch.equal(_torch.flatten_dense(ts), want_flat)
    got = _torch.tree_leaves(tree)
    assert len(got) == len(want_leaves) and all(a is b for a, b in zip(got, want_leaves))


def test_tree_paths_fallback_is_torchs(monkeypatch):
    "`tree_paths` without torch's pytree gives the same paths and leaves, and rebuilds the same containers."
    Pair = collections.namedtuple('Pair', 'weight bias')
    ts = [torch.randn(2), torch.randn(3), torch.randn(()), torch.randn(1)]
    tree = {'a': [Pair(ts[0], ts[1]), (ts[2],)], 'b': {'c': ts[3]}}
    paths, leaves, rebuild = _torch.tree_paths(tree)
    assert paths == [('a', 0, 'weight'), ('a', 0, 'bias'), ('a', 1, 0), ('b', 'c')]
    want = rebuild([t * 2 for t in leaves])
    monkeypatch.setitem(sys.modules, 'torch.utils._pytree', None)
    got_paths, got_leaves, got_rebuild = _torch.tree_paths(tree)
    assert got_paths == paths and all(a is b for a, b in zip(got_leaves, leaves))
    got = got_rebuild([t * 2 for t in got_leaves])
    assert type(got['a'][0]) is Pair and type(got['a'][1]) is tuple
    assert all(torch.equal(_torch.tree_get(got, p), _torch.tree_get(want, p)) for p in paths)


@contextlib.contextmanager
def _cpu_chain_settings():
    "The compiled chain's settings on the CPU (`_torch.chain_settings`), entered for the block as the runner enters them."
    leave = _torch.chain_settings(True)()
    try: yield
    finally: leave()


def test_the_chains_cpu_settings_skip_the_isa_probes_and_leave_no_trace(monkeypatch):
    """Inside the compiled chain's CPU settings, inductor takes the ISAs the CPU reports (`cpp.vec_isa_ok`): no test
    program is built. The list it makes there is dropped after (with each ISA class's kept answer), so the process's
    other compiles probe as they would have; a list made before is kept, and a user's own `vec_isa_ok` is never
    overridden."""
    import functools
    import torch._inductor.config as config
    from torch._inductor import cpu_vec_isa
    seen = []

    @functools.cache
    def listed():  # a stand-in for inductor's list: what `vec_isa_ok` it was made with
        seen.append(config.cpp.vec_isa_ok)
        return []

    class KeptAnswer:
        @functools.cache
        def __bool__(self): return True

    monkeypatch.setattr(cpu_vec_isa, 'valid_vec_isa_list', listed)
    monkeypatch.setattr(cpu_vec_isa, 'KeptAnswer', KeptAnswer, raising=False)
    # (inductor's settings through its own `patch`: monkeypatch would undo one by deleting it, which hides the
    # setting from inductor for the rest of the process)
    with config.patch({'cpp.vec_isa_ok': None}):
        with _cpu_chain_settings():
            listed(), bool(KeptAnswer())
            assert config.cpp.vec_isa_ok is True
        assert seen == [True] and config.cpp.vec_isa_ok is None
        assert listed.cache_info().currsize == 0 and KeptAnswer.__bool__.cache_info().currsize == 0  # dropped
        listed()  # made outside: kept through the block
        with _cpu_chain_settings(): listed()
        assert seen == [True, None] and listed.cache_info().currsize == 1
    with config.patch({'cpp.vec_isa_ok': False}):  # the user's (TORCHINDUCTOR_VEC_ISA_OK=0)
        with _cpu_chain_settings(): assert config.cpp.vec_isa_ok is False


def _assert_follows_the_loop(m) -> None:
    "`m`, stepped STEPS times by a compiled `cbopt.Adam` on the test's inputs, is within 1e-6 of the loop backend's run."
    ref = make_model()
    loop = cbopt.Adam(ref.parameters(), lr=torch.tensor(1e-2), backend='loop')
    for i in range(STEPS):
        ref(torch.full((2, ref[0].in_features), float(i + 1))).sum().backward()
        loop.step()
        loop.zero_grad()
    assert_rel_close(m, ref, rtol=1e-6)


def test_missing_static_address_compiles_the_step_with_its_tensors_as_inputs(monkeypatch):
    """Without `torch._dynamo.mark_static_address`, a step compiled by an outer torch.compile keeps its params and
    state as graph inputs (guarded by their metadata): one warning, the loop's params, one graph over 4 steps."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    monkeypatch.delattr(torch._dynamo, 'mark_static_address')
    torch._dynamo.reset()
    counters.clear()
    m = make_model()
    opt = cbopt.Adam(m.parameters(), lr=torch.tensor(1e-2))
    step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        for i in range(STEPS):
            m(torch.full((2, m[0].in_features), float(i + 1))).sum().backward()
            step()
            opt.zero_grad()
    msgs = [str(w.message) for w in ws if 'mark_static_address' in str(w.message)]
    assert len(msgs) == 1, msgs
    assert counters['stats']['unique_graphs'] == 1
    _assert_follows_the_loop(m)


def test_without_dynamos_init_group_handling_grads_are_guarded_as_tensors(monkeypatch):
    """Where dynamo traces `_init_group` as any method (a torch without its optimizer handling), the grad reader's call
    is traced and the grads are guarded by their metadata: the same single graph over 4 steps (a new grad tensor each
    step), the loop's params."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._dynamo.variables.optimizer import OptimizerVariable
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable
    monkeypatch.setattr(OptimizerVariable, 'call_method', UserDefinedObjectVariable.call_method)
    torch._dynamo.reset()
    counters.clear()
    seen = make_model()
    for p in seen.parameters(): p.grad = torch.ones_like(p)
    explained = cbopt.Adam(seen.parameters(), lr=torch.tensor(1e-2))
    guards = torch._dynamo.explain(lambda: explained.step())().out_guards
    kinds = {g.create_fn_name() for g in guards if g.name.endswith('.grad')}
    assert 'TENSOR_MATCH' in kinds and 'NOT_NONE_MATCH' not in kinds, kinds
    torch._dynamo.reset()
    counters.clear()
    m = make_model()
    opt = cbopt.Adam(m.parameters(), lr=torch.tensor(1e-2))
    step = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    for i in range(STEPS):
        m(torch.full((2, m[0].in_features), float(i + 1))).sum().backward()
        step()
        opt.zero_grad()
    assert counters['stats']['unique_graphs'] == 1
    _assert_follows_the_loop(m)
