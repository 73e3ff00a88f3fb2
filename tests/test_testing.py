"""`cbopt.testing.check_callback`, the public conformance helper: every registry case passes it, and it says in words
what a broken callback breaks."""
import collections

import pytest
import torch

import cbopt
from cbopt.core.tensorlist import TensorList
from cbopt.testing import check_callback
from cases import CASES


@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_every_case_passes_check_callback(case):
    "foreach bit-exact, declared state as created, weights_only checkpoint, bit-exact resume (fused: the quick cases)."
    backends = ('foreach', 'fused') if case.compiles else ('foreach',)
    report = check_callback(opt_func=lambda ps: case.build(ps, 1e-2, 'loop'), backends=backends)
    assert report.ok and not any('cannot run on a whole bucket' in n for n in report.notes), str(report)


def test_a_user_chain_passes():
    def lion_step(p, lr, mom, grad_avg=None, **kwargs):
        if grad_avg is None: grad_avg = torch.zeros_like(p.grad)
        p.data.sub_(grad_avg.lerp(p.grad, 1 - mom).sign_() * lr)
        return {'grad_avg': grad_avg}
    lion_step.defaults, lion_step.state = dict(mom=0.9), dict(grad_avg=cbopt.core.chain.zeros)
    report = check_callback([cbopt.weight_decay, lion_step], lr=1e-3, wd=0.1)
    assert report.ok and str(report).startswith('check_callback: all checks passed')


def differs_per_bucket(p, lr, **kwargs):
    "A broken callback: a different op when it is given a bucket."
    p.data.add_(p.grad, alpha=-lr * (1.001 if isinstance(p, TensorList) else 1.))
differs_per_bucket.state = {}


def declares_wrong(p, lr, buf=None, **kwargs):
    "A broken declaration: says it creates `avg`, creates `buf`."
    if buf is None: buf = torch.zeros_like(p.grad)
    buf.add_(p.grad)
    p.data.add_(buf, alpha=-lr)
    return {'buf': buf}
declares_wrong.state = dict(avg=cbopt.core.chain.zeros)


def keeps_a_python_object(p, lr, history=None, **kwargs):
    "State that torch.load(weights_only=True) cannot read."
    history = history if history is not None else collections.deque(maxlen=3)
    history.append(1)
    p.data.add_(p.grad, alpha=-lr)
    return {'history': history}


def branches(p, lr, **kwargs):
    "Python control flow on a tensor value: runs per param under foreach (a note, not a failure)."
    if p.grad.abs().max() > 0: p.data.add_(p.grad, alpha=-lr)
branches.state = {}


@pytest.mark.parametrize('cb,words', [
    (differs_per_bucket, "the foreach backend is not bit-exact with the loop"),
    (declares_wrong, r"declares the state \['avg'\] but creates \['buf'\]"),
    (keeps_a_python_object, "does not read back with torch.load\\(weights_only=True\\)"),
])
def test_broken_callbacks_are_reported_in_words(cb, words):
    report = check_callback([cb], lr=1e-2, backends=('foreach',), raise_on_failure=False)
    assert not report.ok
    assert any(__import__('re').search(words, f) for f in report.failures), str(report)
    with pytest.raises(AssertionError, match=r'check_callback: \d+ check\(s\) failed'):
        check_callback([cb], lr=1e-2, backends=('foreach',))


def test_a_callback_that_cannot_run_bucketwise_is_a_note():
    report = check_callback([branches], lr=1e-2, backends=('foreach',))
    assert report.ok and any("callback 'branches' cannot run on a whole bucket" in n for n in report.notes)
