"""`cbopt.engine.foreach`: the dry run (`probe`) of undeclared chains: once per group, shared with the loop, only
for chains with a user's callback."""
from __future__ import annotations

import torch

import cbopt
from conftest import NO_COMPILE_FALLBACK

pytestmark = NO_COMPILE_FALLBACK


def test_an_undeclared_chain_is_dry_run_once_per_group() -> None:
    """The loop runs an undeclared chain once on a copy (refusing two callbacks creating one entry) the first time
    it steps a group, not at every step: a callback's calls are then one more than its params' steps."""
    calls = []
    def counted(p, **kwargs): calls.append(p.numel())
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = cbopt.Optimizer([[a], [b]], [counted, cbopt.sgd_step], lr=0.1, backend='loop')
    for _ in range(3):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        opt.step()
    assert calls == [2, 2, 3, 3] + [2, 3] * 2     # step 1: each group's copy, then the group
    torch.testing.assert_close(a.detach(), torch.full((2,), -0.3))


def test_a_group_probed_by_foreach_is_not_dry_run_again_by_the_loop() -> None:
    """foreach's probe (a run on a copy of one param) checks an undeclared chain as the loop's dry run does: a group
    it probed is checked, and the loop, switched to later, runs no dry run of its own."""
    calls = []
    def counted(p, **kwargs): calls.append(1)
    a = torch.nn.Parameter(torch.zeros(2))
    opt = cbopt.Optimizer([a], [counted, cbopt.sgd_step], lr=0.1, backend='foreach')
    a.grad = torch.ones(2)
    opt.step()
    assert len(calls) == 2  # the probe's copy, then the bucket
    opt.backend = 'loop'
    opt.step()
    assert len(calls) == 3  # the param alone
    torch.testing.assert_close(a.detach(), torch.full((2,), -0.2))


def test_only_chains_with_a_users_callback_are_probed(monkeypatch) -> None:
    """foreach probes a bucket (a run of the chain on a copy) at every step only where the chain lists a callback of
    the user's, which may branch on a tensor's value at any step; cbopt's own run bucket-wise by construction
    (`test_backends.test_foreach_is_loop` runs each), under partials and `kahan` too, so they are never probed."""
    from functools import partial
    from cbopt.core.chain import is_cbopts
    from cbopt.engine import foreach as foreach_runner
    probed = []
    real = foreach_runner.probe
    monkeypatch.setattr(foreach_runner, 'probe', lambda cbs, *a: probed.append(len(cbs)) or real(cbs, *a))
    def mine(p, **kwargs): pass
    mine.state = {}
    def additive(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)
    additive.state, additive.additive = {}, True
    assert is_cbopts(cbopt.adam_step) and is_cbopts(partial(cbopt.weight_decay, wd=0.1)) and is_cbopts(cbopt.kahan(cbopt.sgd_step))
    assert not any(map(is_cbopts, [mine, cbopt.kahan(additive), lambda p, **kw: None]))
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = cbopt.Optimizer([{'params': ps[:1]}, {'params': ps[1:], 'cbs': [mine, cbopt.sgd_step]}], [cbopt.sgd_step],
                          lr=0.1, backend='foreach')
    for _ in range(3):
        for p in ps: p.grad = torch.ones(3)
        opt.step()
    assert probed == [2, 2, 2]  # the second group's, at each step
    for p in ps: torch.testing.assert_close(p.detach(), torch.full((3,), 0.7))
