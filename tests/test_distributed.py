"""cbopt under torch.distributed, 2 gloo processes on CPU (`distributed.py`): each mode equals one process on the
global batch, and its checkpoints load back by name."""
import pytest
import torch
from torch import nn

import cbopt
import distributed as D

STEPS = 5


def assert_close_at_scale(a: torch.Tensor, b: torch.Tensor, name: str, rtol: float = 1e-6) -> None:
    "Equal within `rtol` of the tensor's own scale."
    assert (a - b).abs().max() <= rtol * b.abs().max() + 1e-12, name


def reference(steps: int = STEPS):
    "One process, the global batch: what every distributed run must equal."
    model = D.make_model()
    opt = cbopt.Adam(model.named_parameters(), lr=1e-2, wd=0.1)
    D.train(model, opt, steps)
    return model, opt


def test_ddp_and_zero_equal_one_process_and_zero_checkpoint_loads_by_position():
    ranks = D.spawn(D.ddp_and_zero, STEPS)
    model, opt = reference()
    ref = D.params(model)
    for r in ranks:
        assert r['names'] == list(ref)  # DDP's `module.` prefix is not part of the names
        for n in ref:
            assert_close_at_scale(r['ddp'][n], ref[n], f'ddp {n}')
            assert_close_at_scale(r['zero'][n], ref[n], f'zero {n}')
    ref_state = opt.named_state_dict()['state']
    for n, s in ranks[0]['ddp_state']['state'].items():
        for k, v in s.items():
            if torch.is_tensor(v): assert_close_at_scale(v, ref_state[n][k], f'{n} {k}')
    # ZeRO's consolidated state_dict: global ids, cbopt's state names; loads into a named optimizer by position
    sd = ranks[0]['zero_sd']
    assert sorted(sd['state']) == [0, 1, 2, 3] and all(set(s) == {'grad_avg', 'sqr_avg', 'step'} for s in sd['state'].values())
    fresh = cbopt.Adam(D.make_model().named_parameters(), lr=0.5)
    fresh.load_state_dict(sd)
    assert fresh.hypers[0]['lr'] == 1e-2 and fresh.hypers[0]['wd'] == 0.1
    for n, p in fresh.named_params().items():
        for k in ('grad_avg', 'sqr_avg'): assert_close_at_scale(fresh.state[p][k], ref_state[n][k], f'zero sd {n} {k}')
        assert fresh.state[p]['step'] == STEPS


def test_zero_with_an_empty_partition():
    "One param on two ranks: rank 1's cbopt.Adam owns nothing and steps nothing; the run equals one process."
    ranks = D.spawn(D.zero_empty_partition, 3)
    torch.manual_seed(0)
    lin = nn.Linear(6, 3, bias=False)
    opt = cbopt.Adam(lin.parameters(), lr=1e-2)
    D.train(lin, opt, 3)
    assert sorted(r['local_params'] for r in ranks) == [0, 1]
    for r in ranks: assert_close_at_scale(r['weight'], lin.weight.detach(), 'weight')
