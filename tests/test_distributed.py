"""cbopt under torch.distributed, 2 gloo processes on CPU (`distributed.py`): each mode equals one process on the
global batch, and its checkpoints load back by name."""
import io
import subprocess
import sys

import pytest
import torch
from torch import nn

import cbopt
import distributed as D
from conftest import assert_tensor_close

STEPS = 5


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
            assert_tensor_close(r['ddp'][n], ref[n], f'ddp {n}')
            assert_tensor_close(r['zero'][n], ref[n], f'zero {n}')
            assert_tensor_close(r['torch_zero'][n], ref[n], f"torch's zero {n}")  # the compatibility path trains
    ref_state = opt.named_state_dict()['state']
    for n, s in ranks[0]['ddp_state']['state'].items():
        for k, v in s.items():
            if torch.is_tensor(v): assert_tensor_close(v, ref_state[n][k], f'{n} {k}')
    # ZeRO's consolidated state_dict: global ids, cbopt's state names and chain, global positions as names (its params
    # were given unnamed); readable with weights_only; loads into a named optimizer by position
    buf = io.BytesIO()
    torch.save(ranks[0]['zero_sd'], buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert sorted(sd['state']) == [0, 1, 2, 3] and all(set(s) == {'grad_avg', 'sqr_avg', 'step'} for s in sd['state'].values())
    assert sd['param_groups'][0]['param_names'] == ['0', '1', '2', '3'] and sd['param_groups'][0]['chain'] == opt.state_dict()['param_groups'][0]['chain']
    assert set(sd['param_groups'][0]) == set(opt.state_dict()['param_groups'][0])  # cbopt's own layout, entry for entry
    fresh = cbopt.Adam(D.make_model().named_parameters(), lr=0.5)
    fresh.load_state_dict(sd)
    assert fresh.hypers[0]['lr'] == 1e-2 and fresh.hypers[0]['wd'] == 0.1
    for n, p in fresh.named_params().items():
        for k in ('grad_avg', 'sqr_avg'): assert_tensor_close(fresh.state[p][k], ref_state[n][k], f'zero sd {n} {k}')
        assert fresh.state[p]['step'] == STEPS


def test_zero_checkpoint_of_named_ranks_loads_by_name_and_back(tmp_path):
    """Ranks that name their params (`zero.optim.name_params(model)`) give ZeRO's checkpoint the model's names in its
    global order: it loads into a plain optimizer of another grouping and order by name, and back into ZeRO (each rank
    keeps its own names), which trains on as the uninterrupted process."""
    path = str(tmp_path / 'zero.pt')
    ranks = D.spawn(D.zero_named_resume, STEPS, 3, path)
    model, opt = reference()
    sd = torch.load(path, weights_only=True)
    assert sd['param_groups'][0]['param_names'] == opt.param_names
    split = cbopt.Adam([{'params': [(n, p) for n, p in D.make_model().named_parameters() if n.endswith('bias')][::-1]},
                        {'params': [(n, p) for n, p in D.make_model().named_parameters() if n.endswith('weight')]}], lr=0.5)
    split.load_state_dict(sd)
    want = opt.named_state_dict()['state']
    got = split.named_state_dict()
    assert [h['lr'] for h in split.hypers] == [1e-2, 1e-2] and [h['wd'] for h in split.hypers] == [0.1, 0.1]
    for n, s in want.items():
        for k in ('grad_avg', 'sqr_avg'): assert_tensor_close(got['state'][n][k], s[k], f'{n} {k}')
        assert got['state'][n]['step'] == STEPS
    assert sorted(n for r in ranks for n in r['names']) == sorted(opt.param_names)  # each rank names its own share
    D.train(model, opt, 3, start=STEPS)
    for r in ranks:
        assert r['refused'].startswith('param group 0 (') and 'was saved by the chain [average_grad,momentum_step]' in r['refused']
        assert "param '0.weight'" in r['refused_names'] or "param '0.bias'" in r['refused_names'], r['refused_names']
        assert 'names another param' in r['refused_names']
        assert r['names_after_load'] == r['names']
        assert sorted(r['loaded']['state']) == sorted(r['names'])
        for n in r['names']: assert_tensor_close(r['loaded']['state'][n]['sqr_avg'], want[n]['sqr_avg'], f'loaded {n}')
        for n, p in D.params(model).items(): assert_tensor_close(r['final'][n], p, f'resumed {n}')


def test_zero_refuses_torch_optimizers_and_overlap():
    "A torch optimizer class (torch's own ZeRO is for those) and overlap_with_ddp (torch's functional optimizers only)."
    for r in D.spawn(D.zero_refuses_what_it_cannot_run):
        assert r['torch class'].startswith('TypeError: ') and 'not a cbopt optimizer' in r['torch class']
        assert 'torch.distributed.optim.ZeroRedundancyOptimizer' in r['torch class']
        assert r['overlap'].startswith('ValueError: ') and 'overlap_with_ddp=True' in r['overlap']


def test_import_cbopt_does_not_import_zero():
    "`cbopt.ZeroRedundancyOptimizer` imports torch.distributed's optim on first use, not at `import cbopt`."
    code = ("import sys, cbopt; assert 'torch.distributed.optim' not in sys.modules; "
            "assert 'ZeroRedundancyOptimizer' in dir(cbopt); from torch.distributed.optim import ZeroRedundancyOptimizer; "
            "assert issubclass(cbopt.ZeroRedundancyOptimizer, ZeroRedundancyOptimizer)")
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_zero_add_param_group_names_the_new_params_by_global_position():
    "A group added on every rank: each rank's share of it is named by its global position, with the group's own lr."
    ranks = D.spawn(D.zero_add_param_group)
    assert sorted(n for r in ranks for n in r['names']) == ['0', '1', '2', '3']
    for r in ranks:
        assert r['names'] == r['positions'] and r['stepped']
        assert r['lrs'] == [1e-2, 1e-3]


def test_zero_with_an_empty_partition():
    "One param on two ranks: rank 1's cbopt.Adam owns nothing and steps nothing; the run equals one process."
    ranks = D.spawn(D.zero_empty_partition, 3)
    torch.manual_seed(0)
    lin = nn.Linear(6, 3, bias=False)
    opt = cbopt.Adam(lin.parameters(), lr=1e-2)
    D.train(lin, opt, 3)
    assert sorted(r['local_params'] for r in ranks) == [0, 1]
    for r in ranks: assert_tensor_close(r['weight'], lin.weight.detach(), 'weight')


@pytest.mark.parametrize('built_with', ['momentum', 'mom'])
def test_zero_steps_with_the_momentum_last_written_under_either_name(built_with):
    """ZeRO's own groups are plain dicts that can hold `momentum` and `mom` at once: a write under either name (a
    torch scheduler's, fastai's) is what every rank's optimizer steps with next, never the other name's stale value."""
    for seen in D.spawn(D.zero_momentum_writes, built_with): assert seen == [0.5, 0.3, 0.7, 0.2]


@pytest.mark.parametrize('built_with', ['momentum', 'mom'])
def test_zero_under_one_cycle_lr_steps_as_one_process(built_with):
    """torch's OneCycleLR on cbopt's ZeRO, built with either name of momentum (OneCycleLR needs `momentum` in the
    optimizer's defaults): every rank steps with the momentum it cycles, as one process's cbopt.SGD does."""
    model = D.make_model()
    want = D.one_cycle_run(cbopt.SGD(model.parameters(), lr=1e-2, **{built_with: 0.9}), model, 6)
    assert len(set(want)) > 2  # it cycles
    for r in D.spawn(D.zero_one_cycle, built_with, 6):
        assert r['moms'] == pytest.approx(want, rel=1e-12)
        for n, p in D.params(model).items(): assert_tensor_close(r['params'][n], p, n)


def test_zero_load_of_a_bad_checkpoint_changes_nothing_on_any_rank():
    """A ZeRO checkpoint with one thing wrong late in the order (a param's state of another dtype or shape, a missing
    state entry or param state, an invalid hyper, another chain, an unknown whole-model entry, a param too many) is
    refused on every rank, naming the culprit (the refusing rank on the others), and changes nothing: each rank's state
    and hypers and ZeRO's groups are as they were, and the next step is bit for bit that of a twin never given it."""
    ranks = D.spawn(D.zero_refuses_bad_checkpoints, 3, 2)
    for rank, r in enumerate(ranks):
        for what, (_, culprit) in D.BAD_ZERO_CHECKPOINTS.items():
            assert r['errors'][what] is not None and culprit in r['errors'][what], (rank, what, r['errors'][what])
        assert_same_state(r['after']['local'], r['before']['local'], f'rank {rank}')
        assert r['after']['zero_groups'] == r['before']['zero_groups'], rank
        for n, p in r['b'].items(): assert torch.equal(r['a'][n], p), (rank, n)
        assert_same_state(r['state_a'], r['state_b'], f'rank {rank} after a step')
    for what in ('dtype', 'shape', 'missing entry', 'no state'):  # only rank 1 holds param 3: rank 0 refuses with it
        assert ranks[0]['errors'][what].split(': ', 1)[1].startswith('rank 1 refused the state_dict: '), what
        assert ranks[1]['errors'][what].split(': ', 1)[0] == ranks[0]['errors'][what].split(': ', 1)[0], what


# -- distributed checkpoints: saved by 2 ranks, loaded by 1, and the reverse ---------------------------------------
DCP_STEPS, DCP_MORE = 5, 4  # 5 steps of a 3-step accumulation: saved mid-cycle, 2 micro-batches summed


def assert_same_state(got: dict, want: dict, what: str) -> None:
    "Two named_state_dicts hold the same values, bit for bit: every param's state and every group entry."
    assert got['param_groups'] == want['param_groups'], what
    assert list(got['state']) == list(want['state']), what
    for n, s in want['state'].items():
        assert set(got['state'][n]) == set(s), f'{what} {n}'
        for k, v in s.items():
            if torch.is_tensor(v): assert torch.equal(got['state'][n][k], v), f'{what} {n} {k}'
            else: assert got['state'][n][k] == v, f'{what} {n} {k}'


def continued(state: dict, weights: dict, steps: int, start: int, lowbit: str | None = None) -> dict:
    "One process from the given params and optimizer state (loaded without DCP), `steps` steps on the global batch."
    model = D.perturbed_model(lowbit)
    model.load_state_dict(weights)
    opt = D.make_dcp_opt(model, lowbit)
    opt.load_state_dict(state)
    D.train(model, opt, steps, start=start)
    return D.params(model)


@pytest.mark.parametrize('kind, flat', [('ddp', False), ('fsdp', False), ('fsdp', True)])
@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')  # DCP without a process group: one process
def test_dcp_checkpoint_of_2_ranks_resumes_in_1_process(tmp_path, kind, flat):
    """get_state_dict + dcp.save on 2 ranks (DDP: each rank holds everything; FSDP2: each its shards; `flat`: with
    `flatten_optimizer_state_dict=True`, as torchtitan saves), dcp.load + set_state_dict in 1 process: the state is
    loaded bit for bit (the warmup and accumulation counts and the grad sums of the micro-batches so far included), and
    the run goes on as the uninterrupted one."""
    ranks = D.spawn(D.dcp_save, kind, str(tmp_path), DCP_STEPS, DCP_MORE, flat)
    saved = ranks[0]
    assert saved['state']['param_groups'][0]['accumulate_grads.micro_step'] == 2
    assert saved['state']['param_groups'][0]['warmup.iter'] == 1  # one real step so far (after 3 micro-batches)
    model = D.perturbed_model()
    opt = D.make_dcp_opt(model)
    D.dcp_save_and_load(model, opt, str(tmp_path), load=True, flat=flat)
    assert_same_state(opt.named_state_dict(), saved['state'], 'loaded state')
    for n, p in D.params(model).items(): assert torch.equal(p, saved['params'][n]), n
    D.train(model, opt, DCP_MORE, start=DCP_STEPS)
    # exactly as a process that loads the same params and state without DCP; as the 2 ranks within their rounding
    same = continued(saved['state'], saved['params'], DCP_MORE, DCP_STEPS)
    for n, p in D.params(model).items():
        assert torch.equal(p, same[n]), n
        for r in ranks: assert_tensor_close(p, r['final'][n], f'uninterrupted {n}')


@pytest.mark.parametrize('lowbit, flat', [('8bit', False), ('4bit', True)])
@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_dcp_low_bit_checkpoint_of_2_fsdp_ranks_resumes_in_1_process(tmp_path, lowbit, flat):
    """Low-bit state (`state_precision=`) on FSDP2: each rank quantizes its shard, and its checkpoint holds each entry
    as one process stores the whole tensor (codes and absmax DTensors of the whole tensor's sizes), so dcp.load in 1
    process loads it bit for bit (the codes the 2 ranks held, concatenated) and goes on as the uninterrupted run."""
    ranks = D.spawn(D.dcp_save, 'fsdp', str(tmp_path), DCP_STEPS, DCP_MORE, flat, lowbit)
    saved = ranks[0]
    assert {'grad_avg.codes', 'grad_avg.absmax', 'sqr_avg.codes', 'sqr_avg.absmax'} <= set(saved['state']['state']['2.weight'])
    assert 'grad_avg' in saved['state']['state']['2.bias']  # (3 elements: under min_quantize_size, fp32)
    model = D.perturbed_model(lowbit)
    opt = D.make_dcp_opt(model, lowbit)
    D.dcp_save_and_load(model, opt, str(tmp_path), load=True, flat=flat)
    assert_same_state(opt.named_state_dict(), saved['state'], 'loaded state')
    for n, p in D.params(model).items(): assert torch.equal(p, saved['params'][n]), n
    D.train(model, opt, DCP_MORE, start=DCP_STEPS)
    same = continued(saved['state'], saved['params'], DCP_MORE, DCP_STEPS, lowbit)
    for n, p in D.params(model).items():
        assert torch.equal(p, same[n]), n
        for r in ranks: assert_tensor_close(p, r['final'][n], f'uninterrupted {n}')


@pytest.mark.parametrize('kind, lowbit', [('ddp', None), ('fsdp', None), ('fsdp', 'fp8')])
@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_dcp_checkpoint_of_1_process_resumes_on_2_ranks(tmp_path, kind, lowbit):
    """The reverse: 1 process saves with get_state_dict + dcp.save, 2 ranks (DDP, or FSDP2 resharding it) load it and
    go on: each loads the state bit for bit and ends where the uninterrupted process does. With fp8 state (`lowbit`),
    each rank takes its shard's blocks of the whole tensor's codes (the head's rows split 2 + 1; float8 codes, which
    gloo cannot gather, are gathered as bytes)."""
    model = D.lowbit_model() if lowbit else D.make_model()
    opt = D.make_dcp_opt(model, lowbit)
    D.train(model, opt, DCP_STEPS)
    saved = opt.named_state_dict()
    D.dcp_save_and_load(model, opt, str(tmp_path), load=False)
    weights = D.params(model)
    D.train(model, opt, DCP_MORE, start=DCP_STEPS)
    ranks = D.spawn(D.dcp_load, kind, str(tmp_path), DCP_STEPS, DCP_MORE, lowbit)
    for r in ranks:
        assert_same_state(r['state'], saved, 'loaded state')
        for n, p in weights.items(): assert torch.equal(r['params'][n], p), n
        for n, p in D.params(model).items():
            assert_tensor_close(r['final'][n], p, f'uninterrupted {n}')
            assert torch.equal(r['final'][n], ranks[0]['final'][n]), n


def test_bench_state_bytes_per_rank_are_the_state_each_mode_keeps():
    """`python -m cbopt bench --only memory` counts what each rank holds after a cbopt.Adam step: under DDP both fp32
    moments of every param, under ZeRO those of the params it owns (together: every param once), under FSDP2 those of
    its dim-0 shard of every param (torch.chunk's split)."""
    from math import prod
    from cbopt.cli.bench.params import param_sets
    shapes = param_sets(True)['gpt2']
    ranks = D.spawn(D.state_bytes_per_rank, shapes)
    moments = 2 * 4  # grad_avg and sqr_avg, fp32; the step count is a Python number
    full = moments * sum(prod(s) for _, s in shapes)
    assert [r['DDP'] for r in ranks] == [full] * D.WORLD
    zero = [r['ZeRO'] for r in ranks]
    assert sum(zero) == full and 0 < min(zero) and max(zero) < full
    def shard_rows(rows: int, rank: int) -> int:
        chunk = -(-rows // D.WORLD)
        return max(0, min(chunk, rows - rank * chunk))
    assert [r['FSDP2'] for r in ranks] == [moments * sum(shard_rows(s[0], r) * prod(s[1:]) for _, s in shapes)
                                           for r in range(D.WORLD)]
