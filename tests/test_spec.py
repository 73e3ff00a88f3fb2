"""The callback contract read in one place (`cbopt.core.spec`): every built-in callback's declarations read; a
misspelt or mistyped declaration refused with a message naming the callback and the attribute, wherever it surfaces
(`spec`, building an optimizer, `check_callback`); undeclared fastai callbacks running in every backend as fastai's
own optimizer; partials and `kahan` wrappers reading their step's declarations."""
import dataclasses
import functools
import inspect

import fastai.optimizer as fo
import pytest
import torch

import cbopt
import cbopt.callbacks
from cbopt.core.chain import declared_state, is_model_cb, scope, transient_keys
from cbopt.core.spec import DECLARATIONS, SCOPES, CallbackSpec, CallbackSpecError, spec
from cbopt.testing import check_callback
from conftest import assert_rel_close, make_model, train, two_groups


def step_callbacks() -> list:
    "Every callback `cbopt.callbacks` exports: its functions whose first argument is the param (`p`) or params."
    out = []
    for name in cbopt.callbacks.__all__:
        f = getattr(cbopt.callbacks, name)
        if inspect.isfunction(f) and next(iter(inspect.signature(f).parameters), None) in ('p', 'params'): out.append(f)
    return out


CALLBACKS = step_callbacks()


def test_the_registry_of_callbacks_is_complete():
    "(So that the next test sees them all: the helpers `cbopt.callbacks` exports beside them are not callbacks.)"
    names = {f.__name__ for f in CALLBACKS}
    assert {'adam_step', 'sgd_step', 'lbfgs', 'warmup', 'clip_grad_norm', 'schedule_free_step'} <= names
    assert not names & {'kahan', 'kahan_chain', 'debias', 'newton_schulz'}
    assert len(names) > 50


@pytest.mark.parametrize('cb', CALLBACKS, ids=lambda f: f.__name__)
def test_every_builtin_callback_has_a_valid_spec(cb):
    s = spec(cb)
    assert isinstance(s, CallbackSpec) and s.name == cb.__name__
    cbopt.core.chain.check_chain([cb])
    # every built-in declares the state it creates (no dry run): torch's SGD momentum too, created by its first step
    assert s.declared and s.scope in SCOPES
    # what each declares is what cbopt reads: the attributes, as they are
    for field in DECLARATIONS:
        if field in ('_defaults', 'scope') or not hasattr(cb, field): continue
        v = getattr(cb, field)
        assert getattr(s, field) == (tuple(v) if isinstance(v, list) else v), field
    # whole-model callbacks are the only ones with `param_state`, `flat_state`, `uses_closure`, `torch_model_state`
    if s.scope != 'model': assert not (s.param_state or s.flat_state or s.uses_closure or s.torch_model_state)


def test_an_undeclared_callback_has_an_undeclared_spec():
    def mine(p, lr, **kwargs): p.data.sub_(p.grad, alpha=lr)
    s = spec(mine)
    assert (s.declared, s.scope, s.state, s.transient, s.defaults) == (False, None, None, (), {})
    assert declared_state(mine) is None and scope(mine) is None
    mine.state = {}
    assert spec(mine).declared and spec(mine).scope == 'element'


# -- misspelt and mistyped declarations ---------------------------------------------------------------------------
def _with(**attrs):
    "A per-param SGD step (correct) with the attributes `attrs` set on it."
    def my_step(p, lr, **kwargs): p.data.sub_(p.grad, alpha=lr)
    my_step.state = {}
    for k, v in attrs.items(): setattr(my_step, k, v)
    return my_step


BAD = {  # attribute -> (value, what the message says)
    'trasient': (('local_lr',), "has the attribute 'trasient', which cbopt does not read: did you mean 'transient'?"),
    'default': (dict(lr=0.1), "did you mean 'defaults'?"),
    'torch_stat': (dict(exp_avg='grad_avg'), "did you mean 'torch_state'?"),
    'addtive': (True, "did you mean 'additive'?"),
    'scope': ('elementwise', "declares scope 'elementwise': expected one of ('element', 'tensor', 'model')"),
    'state': (['grad_avg'], "declares state = ['grad_avg']: expected a dict, got list"),
    'transient': ('local_lr', "expected a tuple or list of entry names (str): ('local_lr',) for one entry"),
    'shared': ((1,), "declares shared = (1,): expected a tuple or list of entry names"),
    'additive': (1, "declares additive = 1: expected True or False, got int"),
    'supports_complex': ('no', "expected True or False"),
    'defaults': ({1: 0.9}, "its keys must be names (str), got 1"),
    'torch_state': (dict(exp_avg=3), "its entry 'exp_avg' must be a state entry name, got 3"),
    'torch_names': (dict(betas=['mom', 'sqr_mom']), "its entry 'betas' must be a hyper name or a tuple of them"),
    'torch_flag': (True, "expected the name of a torch flag (str), got bool"),
    'on_train': (3, "declares on_train = 3: expected a function, got int"),
    'group_hypers': (dict(initial_lr=1), "its entry 'initial_lr' must be the name of a hyper, got 1"),
    'flat_state': (('d',), "only a whole-model callback (scope = 'model') declares it"),
    'uses_closure': (True, "only a whole-model callback (scope = 'model') declares it"),
}


@pytest.mark.parametrize('attr', BAD)
def test_a_bad_declaration_is_refused_naming_the_callback_and_the_attribute(attr):
    value, says = BAD[attr]
    cb = _with(**{attr: value})
    with pytest.raises(CallbackSpecError) as e: spec(cb)
    msg = str(e.value)
    assert "callback 'my_step'" in msg and repr(attr).strip("'") in msg and says in msg, msg
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)  # (what callers caught before)
    # where a user meets it: building an optimizer (`check_chain`), a partial of it, `check_callback`
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(CallbackSpecError, match="callback 'my_step'"): cbopt.Optimizer([p], [cb, cbopt.sgd_step], lr=0.1)
    with pytest.raises(CallbackSpecError, match="callback 'my_step'"):
        cbopt.Optimizer([p], [functools.partial(cb, lr=0.1)], lr=0.1)
    report = check_callback([cb], lr=0.1, raise_on_failure=False)
    assert not report.ok and any(says in f for f in report.failures), report
    with pytest.raises(AssertionError, match="callback 'my_step'"): check_callback([cb], lr=0.1)


def test_whole_model_declarations_are_checked_against_its_state():
    def my_clip(params, **kwargs): pass
    my_clip.scope, my_clip.state, my_clip.flat_state = 'model', dict(d=None), ('d', 'old_dirs')
    with pytest.raises(CallbackSpecError, match=r"callback 'my_clip' declares flat_state = .*'old_dirs' is not an "
                                                r"entry of its `state`"):
        spec(my_clip)
    my_clip.flat_state, my_clip.torch_model_state = ('d',), dict(d='d', al=None, ro='ro')
    with pytest.raises(CallbackSpecError, match="torch_model_state = .*'ro' is not an entry of its `state`"): spec(my_clip)
    my_clip.torch_model_state = dict(d='d', al=None)
    assert spec(my_clip).flat_state == ('d',) and is_model_cb(my_clip)


def test_attributes_that_are_no_declaration_are_left_alone():
    "Only names close to a declaration's are taken for misspellings: a note, `functools.wraps`'s `__wrapped__`, pass."
    cb = _with(note='mine', version=2)
    wrapped = functools.wraps(cb)(lambda p, **kw: cb(p, **kw))
    assert spec(cb).declared and spec(wrapped).declared and wrapped.__wrapped__ is cb


@dataclasses.dataclass
class Scaled:
    "A callable dataclass (unhashable: read uncached); its fields are its own, even one named like a declaration."
    factor: float
    stat: str = 'x'  # (close to `state`, but a field)
    state = {}

    def __call__(self, p, lr, **kwargs): p.data.sub_(p.grad, alpha=lr * self.factor)


def test_a_callable_instance_reads_its_class_declarations():
    cb = Scaled(2.)
    with pytest.raises(TypeError): hash(cb)
    assert spec(cb).declared and spec(cb).name == 'Scaled'
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    cbopt.Optimizer([p], [cb], lr=0.1).step()
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.8))


def test_spec_is_kept_and_read_again_when_an_attribute_is_set_anew():
    cb = _with(transient=('a',))
    assert spec(cb) is spec(cb)
    cb.transient = ('b',)
    assert spec(cb).transient == ('b',) and transient_keys([cb]) == {'b'}
    cb.scope = 'tensor'
    assert scope(cb) == 'tensor'
    del cb.scope
    assert scope(cb) == 'element'


# -- undeclared fastai-style callbacks ----------------------------------------------------------------------------
@pytest.mark.parametrize('backend', cbopt.BACKENDS)
def test_undeclared_fastai_callbacks_run_in_every_backend_as_fastai(backend):
    "fastai's own callbacks declare no state: cbopt runs them (with a dry run) in each backend as fastai's Optimizer."
    cbs = [fo.weight_decay, fo.average_grad, fo.momentum_step]
    assert not any(spec(cb).declared for cb in cbs) and spec(fo.average_grad).defaults == {'mom': 0.9}
    ours, theirs = make_model(), make_model()
    opt = cbopt.Optimizer(two_groups(ours), cbs, lr=0.05, wd=0.01, backend=backend)
    ref = fo.Optimizer(two_groups(theirs), cbs, lr=0.05, wd=0.01)
    for i in range(6):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, rtol=1e-6, msg=f"{backend}, step {i}:")
    assert sorted(opt.state[next(ours.parameters())]) == ['grad_avg']


# -- partials and kahan -------------------------------------------------------------------------------------------
def test_a_partial_reads_its_functions_spec():
    assert spec(functools.partial(cbopt.adam_step, eps=1e-3)) == spec(cbopt.adam_step)
    assert spec(functools.partial(functools.partial(cbopt.larc_layer_lr, clip=False), trust_coeff=0.1)) \
        == spec(cbopt.larc_layer_lr)
    assert spec(functools.partial(cbopt.clip_grad_norm, max_norm=[1.])).scope == 'model'  # (unhashable: read uncached)


@pytest.mark.parametrize('step', [cbopt.adam_step, cbopt.sgd_step, cbopt.lion_step, functools.partial(cbopt.adam_step, eps=1e-6)],
                         ids=lambda s: cbopt.core.chain.cb_name(s))
def test_kahan_reads_its_steps_spec(step):
    inner, outer = spec(step), spec(cbopt.kahan(step))
    assert inner.additive and not outer.additive  # it writes the param itself
    assert dict(outer.state) == {**inner.state, 'kahan_comp': cbopt.core.chain.zeros}
    for field in ('defaults', 'scope', 'transient', 'shared', 'torch_names', 'torch_state', 'torch_flag'):
        assert getattr(outer, field) == getattr(inner, field), field
    with pytest.raises(ValueError, match=f"'kahan_{inner.name}' does not declare it"): cbopt.kahan(cbopt.kahan(step))
