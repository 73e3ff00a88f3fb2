"""cbopt on FSDP2 (`fully_shard`: params, grads and state are DTensors), 2 gloo processes on CPU (`dist_fsdp.py`):
every backend, over the registry's cases, equals one process on the global batch; callbacks reducing over a whole
param (norms, Muon's orthogonalisation) are reduced or gathered across ranks; global-norm clipping equals torch's
`clip_grad_norm_` on the same sharded model; a NaN in one rank's shard skips the step on every rank; a callback
reading a Python number of a shard's norm is refused, naming it."""
import pytest
import torch

import cbopt
from cbopt.core import quant
import dist_fsdp as F
import distributed as D
from cases import CASES, case
from conftest import assert_tensor_close

STEPS = 5  # lookahead-sgd (k=5) syncs its slow weights once: a copy into DTensors
LR = 3e-2
# (a case's known gap, `Case.gap`, holds here too: L-BFGS steps only with a closure)
ELEMENTWISE = [c.id for c in CASES if not c.tensor_scope and not c.gap('test_elementwise_cases_equal_one_process')]
TENSOR_SCOPE = [c.id for c in CASES if c.tensor_scope and not c.gap('test_tensor_scope_callbacks_reduce_across_ranks')]


def one_process(cid: str, backend, steps: int = STEPS) -> dict:
    "The case trained in one process on the global batch, with the same backend."
    model = D.make_model()
    opt = case(cid).build(list(model.named_parameters()), LR, backend)
    D.train(model, opt, steps)
    return D.params(model)


def check_cases(ids: list, backends: list, reference: dict | None = None) -> dict:
    """Run the cases on FSDP2 and check both ranks' params against one process with the same backend (or the one
    `reference` maps it to); the results of rank 0."""
    ranks = D.spawn(F.train_cases, ids, backends, STEPS, LR)
    for cid in ids:
        for be in backends:
            ref = one_process(cid, (reference or {}).get(be, be))
            for r, res in enumerate(ranks):
                got = res[(cid, str(be))]
                assert got['dtensor_state'], f"{cid} {be}: its state is not sharded as its params"
                for n, p in ref.items(): assert_tensor_close(got['params'][n], p, f"{cid} {be} rank {r} {n}")
    return ranks[0]


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_elementwise_cases_equal_one_process(backend):
    "Every elementwise case of the registry, on sharded params, steps as one process on the global batch."
    check_cases(ELEMENTWISE, [backend])


def test_fused_kernel_compiled_and_auto_equal_one_process():
    """`fused`: torch's AdamW and Adam kernels on DTensors, and an elementwise chain compiled on each rank's shards
    (without falling back to foreach: no warning); `auto` on DTensors (foreach, alike on every rank)."""
    aot = cbopt.Backend('fused', compiler='aot_eager')
    # torch's SGD and Adagrad kernels have no DTensor rule: on DTensors, cbopt runs their chains instead
    kernels = [c.id for c in CASES if c.has_torch_kernel and not c.tensor_scope and c.id.startswith('adam')]
    assert kernels == ['adam', 'adam-l2', 'adam-amsgrad', 'adam-maximize']  # AdamW's kernel; L2 Adam's (_fused_adam_)
    # Adan: a declared chain, copying into its state; compiled with aot_eager it equals foreach (test_backends)
    res = check_cases(kernels + ['adan'], [aot, 'auto'], reference={aot: 'foreach'})
    assert not any('compiled' in w for w in res[('adan', str(aot))]['warnings']), res[('adan', str(aot))]['warnings']


def test_tensor_scope_callbacks_reduce_across_ranks():
    """Lamb's and Larc's norms, StableAdamW's RMS, Adafactor's factored moments and Muon's Newton-Schulz on sharded
    params equal one process: reduced across ranks by DTensor's ops, or (Muon) computed on the gathered matrix. The
    fused backend runs them with foreach on the DTensors (the README's rule), so foreach is its reference here."""
    assert set(TENSOR_SCOPE) == {'larc', 'lars', 'lamb', 'adafactor', 'muon', 'muon-torch', 'stableadamw'}
    check_cases(TENSOR_SCOPE, ['loop', 'foreach', 'fused'], reference={'fused': 'foreach'})


MAX_NORM, NAN_STEP = 0.1, 2


def test_clipping_and_skipping_across_ranks():
    ranks = D.spawn(F.clipping, STEPS, MAX_NORM, 1e-2, NAN_STEP)
    for norm_type in (2.0, float('inf')):
        # one process: cbopt clipping on the global batch's grads
        model = D.make_model()
        opt = cbopt.GradientClippingOptimizer(cbopt.Adam(model.named_parameters(), lr=1e-2),
                                              cbopt.GradientClipping.NORM, max_gradient=MAX_NORM, norm_type=norm_type)
        norms = []
        for i in range(STEPS):
            D.train(model, opt, 1, start=i)
            norms.append(opt.last_total_grad_norm.item())
        assert min(norms) > 2 * MAX_NORM  # every step clips
        for r, res in enumerate(ranks):
            torch_ref = res[('torch', norm_type)]
            torch.testing.assert_close(torch_ref['norms'], norms, rtol=1e-6, atol=0)
            for be in ('loop', 'foreach', 'fused'):
                got = res[(be, norm_type)]
                assert got['plain_norms'] and got['grads_kept'], (be, norm_type)
                torch.testing.assert_close(got['norms'], torch_ref['norms'], rtol=1e-6, atol=0)
                for n, p in torch_ref['params'].items():
                    assert_tensor_close(got['params'][n], p, f"{be} norm {norm_type} rank {r} {n}")
                for n, p in D.params(model).items():
                    assert_tensor_close(got['params'][n], p, f"{be} norm {norm_type} rank {r} {n} (one process)")
    # sharded body and replicated head: the norm counts each once
    model = D.make_model()
    opt = cbopt.GradientClippingOptimizer(cbopt.Adam(model.named_parameters(), lr=1e-2), cbopt.GradientClipping.NORM,
                                          max_gradient=MAX_NORM)
    norms = []
    for i in range(STEPS):
        D.train(model, opt, 1, start=i)
        norms.append(opt.last_total_grad_norm.item())
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res['mixed']['norms'], norms, rtol=1e-6, atol=0)
        for n, p in D.params(model).items(): assert_tensor_close(res['mixed']['params'][n], p, f"mixed rank {r} {n}")
    # a NaN in rank 1's shard only: both ranks skip that step, and the run equals one process without that batch
    model = D.make_model()
    opt = cbopt.Adam(model.named_parameters(), lr=1e-2)
    for i in range(STEPS):
        if i != NAN_STEP: D.train(model, opt, 1, start=i)
    for r, res in enumerate(ranks):
        skip = res['skip']
        assert skip['skipped'] == [i == NAN_STEP for i in range(STEPS)] and skip['total'] == 1, (r, skip)
        for n, p in D.params(model).items(): assert_tensor_close(skip['params'][n], p, f"skip rank {r} {n}")
    # a callback reading a Python number of a shard's norm is refused by name, on every rank, with nothing changed
    for r, res in enumerate(ranks):
        for be, got in res['refused'].items():
            assert got['error'] and "callback 'step_by_grad_norm' read a Python number" in got['error'], (r, be, got)
            assert got['unchanged'], (r, be)
    # a rank whose shards of a param are empty (a 1-row head on 2 ranks): torch's inf norm has no value there
    for k, make in F.EMPTY_SHARD_OPTS.items():
        ref = F.train_one_row_head(make, steps=STEPS, sharded=False)
        for r, res in enumerate(ranks):
            for n, p in ref.items(): assert_tensor_close(res['empty_shard'][k][n], p, f"{k} rank {r} {n}")


def one_process_lowbit(prec: str, backend, split: tuple = (), steps: int = STEPS) -> tuple[dict, cbopt.Optimizer]:
    """`lowbit_model` with `dist_fsdp.make_lowbit_opt` in one process, given `dist_fsdp.lowbit_grads`: the params and
    the optimizer. The params named in `split` are stepped as their 2 FSDP2 shards would be alone, each its own param
    (so each quantized in blocks of its own): Adam is elementwise, so this is what 2 ranks compute for them."""
    model = D.lowbit_model()
    pieces = {n: [torch.nn.Parameter(t.detach().clone()) for t in (p.chunk(2) if n in split else [p])]
              for n, p in model.named_parameters()}
    opt = F.make_lowbit_opt([(f'{n}#{i}' if n in split else n, t) for n, ts in pieces.items() for i, t in enumerate(ts)],
                            prec, backend, LR)
    for i in range(steps):
        for n, g in F.lowbit_grads(i, {n: p.shape for n, p in model.named_parameters()}).items():
            for t, gt in zip(pieces[n], g.chunk(len(pieces[n]))): t.grad = gt.clone()
        opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters(): p.copy_(torch.cat(pieces[n]))
    return D.params(model), opt


def test_low_bit_state_on_shards_equals_one_process():
    """8-bit, 4-bit and fp8 Adam on FSDP2 (2 ranks), given the same grads as one process: each rank quantizes its shard in
    blocks of its own, which are the whole tensor's blocks where shards start on a block boundary (both weights: their
    rows of 6 x 128 and of 256), so there the params, codes and absmax are one process's, bit for bit. Whether a param
    is quantized is decided on the whole tensor: the head's weight (768 elements, `min_quantize_size=768`) is, though
    its shards (512 and 256) are smaller. The first bias in 8-bit and fp8 (its 2 shards of 128: half a block each) is
    quantized in each shard's blocks, so it steps as one process stepping its 2 halves as params of their own. The
    same on HSDP's 2-D mesh (its params `(Replicate(), Shard(0))`). A checkpoint (`state_dict()`: the whole tensors'
    parts) loaded back gives each rank the same blocks where they line up, and elsewhere its part of the whole entry
    quantized anew in its own blocks."""
    runs = [('8bit', 'foreach', False), ('4bit', 'loop', False), ('fp8', 'foreach', False), ('8bit', 'loop', True)]
    ranks = D.spawn(F.train_lowbit, runs, STEPS, LR)
    for prec, be, hsdp in runs:
        f = cbopt.state.lowbit.FORMATS[prec]
        split = (F.MISALIGNED,) if f.block == 256 else ()  # (8-bit and fp8; 4-bit's blocks are 128)
        ref, ref_opt = one_process_lowbit(prec, be, split)
        ref_state = ref_opt.named_state_dict()['state']
        ref_deq = ref_opt.named_state_dict(dequantize=True)['state']
        for r, res in enumerate(ranks):
            got = res[(prec, be, hsdp)]
            assert got['placements'] == ('(Replicate(), Shard(dim=0))' if hsdp else '(Shard(dim=0),)')
            assert {n: got['line_up'][n] for n in ('0.weight', '0.bias', '2.weight')} == {
                '0.weight': True, '0.bias': not split, '2.weight': True}, got['line_up']
            rows = [128, 2 if r == 0 else 1]  # this rank's rows of 0.weight and 2.weight
            for n, numel in (('0.weight', rows[0] * 6), ('2.weight', rows[1] * 256), ('0.bias', 128)):
                stored = {k: v.numel() for k, v in got['stored'][n].items()}  # this rank's shard, in whole blocks of its own
                assert stored[f'grad_avg.{f.scale_key}'] == -(-numel // f.block), (prec, r, n, stored)
                assert stored['grad_avg.codes'] == stored[f'grad_avg.{f.scale_key}'] * f.block // f.per_byte
            assert 'grad_avg' in got['state']['state']['2.bias']  # (3 elements: fp32)
            for n, p in ref.items(): assert torch.equal(got['params'][n], p), (prec, r, n)
            for n, s in ref_state.items():
                if n.split('#')[0] in split: continue
                for k, v in s.items():  # the checkpoint's whole-tensor parts: one process's
                    if torch.is_tensor(v): assert torch.equal(got['state']['state'][n][k], v), (prec, r, n, k)
            for n in split:  # its 2 halves' states, end to end
                for k in ('grad_avg', 'sqr_avg'):
                    assert torch.equal(got['dequantized']['state'][n][k], torch.cat([ref_deq[f'{n}#{i}'][k] for i in range(2)]))
            # its checkpoint loaded back: the same blocks where they line up; elsewhere (the split bias) the checkpoint
            # holds the fp32 entry quantized in the whole tensor's blocks, and each rank quantizes its part of that anew
            for n, parts in got['reloaded'].items():
                if n not in split:
                    assert all(torch.equal(v, got['stored'][n][k]) for k, v in parts.items()) and parts.keys() == got['stored'][n].keys(), (prec, r, n)
                    continue
                whole, full_state = got['dequantized']['state'][n], got['state']['state'][n]
                for k, signed in (('grad_avg', True), ('sqr_avg', False)):
                    saved = quant.quantize(whole[k], prec, signed)
                    assert torch.equal(full_state[f'{k}.codes'].view(torch.uint8), saved[0].view(torch.uint8))
                    assert torch.equal(full_state[f'{k}.{f.scale_key}'], saved[1])
                    mine = quant.quantize(quant.dequantize(*saved, prec, signed, whole[k].numel())[r * 128:(r + 1) * 128], prec, signed)
                    assert torch.equal(parts[f'{k}.codes'].view(torch.uint8), mine[0].view(torch.uint8)), (prec, r, n, k)
                    assert torch.equal(parts[f'{k}.{f.scale_key}'], mine[1]), (prec, r, n, k)
