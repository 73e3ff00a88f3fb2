"""Low-bit optimizer state (`state_precision=`): the state kinds every callback declares, the number formats against
torchao's (bitsandbytes' recipe), the numbers of a step against torchao's AdamW8bit/AdamW4bit/AdamWFp8, every backend
agreeing, convergence of other chains, issue #33's convergence goals for AdamW (the demo's task and a char-level
transformer), checkpoints (weights_only, bit-for-bit resume, fp32 <-> low-bit, bad input)."""
import importlib
import io
import math
import pkgutil
import warnings

import pytest
import torch
from torch import nn

import cbopt
import cbopt.callbacks
from cbopt.core import quant
from cbopt.core.spec import STATE_KINDS, CallbackSpecError, spec
from cbopt.recipes.fastai import adam_chain
from cbopt.state import lowbit

BLOCK_FORMATS = ('8bit', '4bit', 'fp8')
PRECISIONS = ('bf16', *BLOCK_FORMATS)


def _torchao():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return pytest.importorskip('torchao.optim')


# -- kinds ------------------------------------------------------------------------------------------------------------
def _builtin_callbacks():
    for m in pkgutil.iter_modules(cbopt.callbacks.__path__):
        mod = importlib.import_module(f'cbopt.callbacks.{m.name}')
        for name, f in vars(mod).items():
            own = getattr(f, '__dict__', {})
            if callable(f) and getattr(f, '__module__', '') == mod.__name__ and ('state' in own or 'param_state' in own):
                yield name, f


def test_every_builtin_state_entry_has_a_kind():
    "Every state entry a built-in callback declares (a whole-model one's per-param state too) says what it is."
    seen = 0
    for name, f in _builtin_callbacks():
        s = spec(f)
        entries = s.param_state if s.scope == 'model' else (s.state or {})
        for k in entries:
            assert s.state_kinds.get(k) in STATE_KINDS, f"{name}: state {k!r} declares no kind"
            seen += 1
    assert seen > 25
    assert spec(cbopt.kahan(cbopt.callbacks.sgd_step)).state_kinds['kahan_comp'] == 'exact'
    assert spec(cbopt.callbacks.adan_avgs).state_kinds['prev_grad'] == 'signed'


def test_bad_state_kinds_refused():
    def cb(p, **kw): pass
    cb.state = dict(m=cbopt.chain.zeros)
    cb.state_kinds = dict(m='momentum')
    with pytest.raises(CallbackSpecError, match="state_kinds.*'m' must be one of"): spec(cb)
    cb.state_kinds = dict(v='signed')
    with pytest.raises(CallbackSpecError, match="'v' is not an entry of its `state`"): spec(cb)
    cb.state_kinds = dict(m='signed')
    del cb.state_kinds
    cb.state_kind = dict(m='signed')
    with pytest.raises(CallbackSpecError, match="did you mean 'state_kinds'"): spec(cb)


# -- formats ----------------------------------------------------------------------------------------------------------
def test_maps_and_codes_are_torchaos():
    "The maps are bitsandbytes'/torchao's value for value, and the codes of a tensor the ones torchao computes."
    _torchao()
    from torchao.optim import subclass_4bit
    from torchao.optim.quant_utils import (create_dynamic_map, quantize_4bit_with_qmap, quantize_8bit_with_qmap,
                                           scale_tensor)
    for args in [(True,), (False,), (True, 3, 4)]: assert quant.dynamic_map(*args) == create_dynamic_map(*args)
    assert quant.qmap('4bit', False).tolist() == list(subclass_4bit.get_qmap_unsigned())
    x = torch.distributions.StudentT(2.).sample((64 * 256,))
    for fmt, block, q in (('8bit', 256, quantize_8bit_with_qmap), ('4bit', 128, quantize_4bit_with_qmap)):
        for signed in (True, False):
            y = x if signed else x.abs()
            codes, absmax = quant.quantize(y, fmt, signed)
            scaled, scale = scale_tensor(y, block)
            theirs = q(scaled, quant.qmap(fmt, signed))
            if fmt == '4bit': theirs = (theirs[::2] << 4) | theirs[1::2]
            assert torch.equal(codes, theirs) and torch.equal(absmax, scale)
    for fmt, q in (('8bit', quantize_8bit_with_qmap), ('4bit', quantize_4bit_with_qmap)):
        for signed in (True, False):  # at the edges of rounding: each map value, each threshold, and their neighbours
            m = quant.qmap(fmt, signed)
            t = quant.thresholds(m)
            edges = torch.cat([m, t, *(torch.nextafter(v, v + d) for v in (m, t) for d in (1, -1)),
                               torch.linspace(-1, 1, 10_001)]).clamp(-1 if signed else 0, 1)
            assert torch.equal(quant.nearest_codes(edges, fmt, signed), q(edges, m))
            assert torch.equal(quant.nearest_codes(edges.clone(), fmt, signed, in_place=True), q(edges, m))
    from torchao.optim.subclass_fp8 import quantize_fp8
    codes, scale = quant.quantize(x, 'fp8')
    c2, s2 = quantize_fp8(x, 256)
    assert torch.equal(codes.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(scale, s2)
    assert quant.qmap('8bit', True) is quant.qmap('8bit', True)  # one map per format, shared


@pytest.mark.parametrize('fmt', BLOCK_FORMATS)
@pytest.mark.parametrize('signed', [True, False])
def test_round_trip_within_the_maps_error_budget(fmt, signed):
    """Heavy-tailed data (Student's t, 2 degrees of freedom), of a size that is no multiple of the block (padded):
    each element comes back within half the widest gap of the map (or its distance to the range's ends) times its
    block's absmax (round to nearest), and
    fp8 within e4m3's half ulp (2**-4 relative) or half its smallest subnormal (2**-10 of the scale)."""
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.).sample((50_000,))
    if not signed: x = x.abs()
    codes, scale = quant.quantize(x, fmt, signed)
    f = quant.FORMATS[fmt]
    assert codes.numel() == f.codes_numel(x.numel()) and scale.numel() == quant.n_blocks(x.numel(), f.block)
    y = quant.dequantize(codes, scale, fmt, signed, x.numel())
    assert y.shape == x.shape
    per = scale.repeat_interleave(f.block)[:x.numel()]
    if fmt == 'fp8':
        budget = torch.maximum(x.abs() * 2 ** -4, per * 2 ** -10)
    else:
        m = quant.qmap(fmt, signed)  # (the map need not reach the range's ends: the signed one stops short of -1)
        budget = max(m.diff().max() / 2, m[0] - (-1 if signed else 0), 1 - m[-1]) * per
    assert ((y - x).abs() <= budget + per * 1e-6).all()  # (+ fp32's rounding of values up to the block's absmax)
    assert (y - x).abs().mean() < budget.mean()  # (and not everywhere at the bound)


def test_bf16_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1 + 2 ** -10)  # between two bf16 values, 1/8 of the way up
    y = quant.bf16_stochastic(x).float()
    assert set(y.unique().tolist()) == {1.0, 1 + 2 ** -7}
    up = (y > 1).float().mean().item()  # rounded up 1/8 of the time: within 4 standard deviations of a Bernoulli(1/8)
    assert abs(up - 1 / 8) < 4 * (1 / 8 * 7 / 8 / x.numel()) ** 0.5
    exact = torch.tensor([1.5, -3.0, 0.0])
    assert torch.equal(quant.bf16_stochastic(exact).float(), exact)


# -- against torchao --------------------------------------------------------------------------------------------------
def _torchao_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 128))


@pytest.mark.parametrize('fmt,cls', [('8bit', 'AdamW8bit'), ('4bit', 'AdamW4bit'), ('fp8', 'AdamWFp8')])
def test_adamw_matches_torchao(fmt, cls):
    """cbopt's AdamW with low-bit state against torchao's on the same grads, with torchao's own test: its model,
    two steps, params within rtol=atol=1e-5 (test_optim_8bit_correctness, torchao against bitsandbytes). torchao's step
    runs eagerly (its compile takes a minute on a CPU); the state is compared too, within one code's width."""
    ao = _torchao()
    m1, m2 = _torchao_model(), _torchao_model()
    ours = cbopt.Optimizer(m1.parameters(), adam_chain(), lr=1e-3, mom=0.9, sqr_mom=0.999, eps=1e-8, wd=1e-2,
                           state_precision=fmt, backend='foreach')
    theirs = getattr(ao, cls)(m2.parameters())
    with torch.compiler.set_stance('force_eager'):
        for _ in range(2):
            x = torch.randn(4, 32)
            for m, o in ((m1, ours), (m2, theirs)):
                m(x).sum().backward()
                o.step()
                o.zero_grad()
    for p1, p2 in zip(m1.parameters(), m2.parameters()): torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-5)
    w1, w2 = m1[2].weight, m2[2].weight
    st = lowbit.dequantized_state(ours.state[w1], w1, ours.param_groups[0])
    torch.testing.assert_close(st['grad_avg'], theirs.state[w2]['exp_avg'].dequantize(), rtol=0, atol=1e-6)
    assert ours.state[w1]['grad_avg.codes'].dtype == (torch.float8_e4m3fn if fmt == 'fp8' else torch.uint8)
    assert 'grad_avg' in ours.state[m1[2].bias]  # (128 elements: under min_quantize_size, fp32 as torchao keeps it)


# -- backends, chains -------------------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 1))


def _train(opt, model, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize('fmt', ['8bit', '4bit', 'fp8'])
def test_backends_agree(fmt):
    "loop, foreach, auto and fused (compiled) step low-bit state to the same params and codes."
    out = {}
    for backend in ('loop', 'foreach', 'auto', 'fused'):
        m = _model()
        opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                              state_precision=fmt, backend=cbopt.Backend(backend, compiler='aot_eager'))
        _train(opt, m)
        out[backend] = (m, opt)
    m0, o0 = out['loop']
    for backend, (m, o) in out.items():
        for p0, p in zip(m0.parameters(), m.parameters()): torch.testing.assert_close(p, p0, rtol=1e-6, atol=1e-7)
        st0, st = o0.state[m0[0].weight], o.state[m[0].weight]
        assert list(st) == list(st0)
        for k in st0:
            if k.endswith('.codes'): assert (st[k].view(torch.uint8).int() - st0[k].view(torch.uint8).int()).abs().max() <= 1


@pytest.mark.parametrize('fmt', ['8bit', '4bit', 'fp8'])
@pytest.mark.parametrize('pieces', [False, True])
def test_fused_steps_stored_state_in_its_graph(fmt, pieces, monkeypatch):
    """After the first (eager) step, the fused backend dequantizes, steps and quantizes in its compiled graph: the
    engine never unpacks the state to fp32 eagerly, no compile falls back, and params and codes follow the loop's
    (sizes that are no multiple of the block, padded in the graph too, and one of whole blocks: its graph pads
    nothing). `pieces`: every param steps in pieces of 1024 elements (`GRAPH_PIECES`), the last of two params
    no whole number of blocks, and the same numbers come out."""
    import cbopt.engine.compiled as engine_compiled
    import cbopt.engine.lowbit as engine_lowbit
    unpacked, in_pieces = [], []
    monkeypatch.setattr(engine_lowbit, 'unpack', lambda st, p, plan: (unpacked.append(p), lowbit.unpack(st, p, plan)))
    if pieces:
        monkeypatch.setattr(engine_lowbit, 'GRAPH_PIECES', (1024, 4096))
        run = engine_compiled._in_pieces
        monkeypatch.setattr(engine_compiled, '_in_pieces', lambda fn, p, *a: (in_pieces.append(p.numel()), run(fn, p, *a))[1])
    out = {}
    for backend in ('loop', 'fused'):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 101), nn.ReLU(), nn.Linear(101, 70), nn.ReLU(), nn.Linear(70, 128))
        opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                              state_precision=fmt, backend=cbopt.Backend(backend, compiler='aot_eager'))
        assert m[4].weight.numel() % 256 == 0  # (whole blocks in every format)
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # (a chain that did not compile warns)
            _train(opt, m, 1)
            unpacked.clear()
            _train(opt, m, 3, seed=2)
        out[backend] = m, opt, len(unpacked)
    (m0, o0, n0), (m, o, n) = out['loop'], out['fused']
    assert n0 > 0 and n == 0  # (the loop unpacks at every step)
    assert sorted(set(in_pieces)) == ([64 * 101, 70 * 101, 70 * 128] if pieces else [])
    for p0, p in zip(m0.parameters(), m.parameters()): torch.testing.assert_close(p, p0, rtol=1e-6, atol=1e-7)
    for w0, w in ((m0[0].weight, m[0].weight), (m0[2].weight, m[2].weight), (m0[4].weight, m[4].weight)):
        st0, st = o0.state[w0], o.state[w]
        assert list(st) == list(st0) and all(getattr(st[k], 'shape', 0) == getattr(st0[k], 'shape', 0) for k in st0)
        for k in st0:
            if k.endswith('.codes'):
                nibbles = (lambda c: torch.stack([c >> 4, c & 15])) if fmt == '4bit' else (lambda c: c)
                a, b = (nibbles(c.view(torch.uint8)).int() for c in (st[k], st0[k]))
                assert (a - b).abs().max() <= 1


@pytest.mark.parametrize('fmt', ['bf16', '8bit', '4bit'])
def test_in_backward_steps_low_bit_state_as_the_step_after_backward(fmt):
    """`InBackward` steps each param's low-bit state in its grad hook (dequantized, stepped, stored again, one param
    at a time) to the params and stored state of the same optimizer stepped after backward, bit for bit."""
    out = []
    for wrap in (False, True):
        m = _model()
        opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                              state_precision=fmt, backend='loop')
        if wrap: opt = cbopt.InBackward(opt)
        torch.manual_seed(0)  # (bf16's stochastic rounding draws from torch's RNG: the same draws in both, one param's)
        _train(opt, m)
        out.append((m, opt))
    (m0, o0), (m1, o1) = out
    for p0, p1 in zip(m0.parameters(), m1.parameters()): assert torch.equal(p0, p1)
    st0, st1 = o0.state[m0[0].weight], o1.state[m1[0].weight]
    assert list(st0) == list(st1) and ('grad_avg' if fmt == 'bf16' else 'grad_avg.codes') in st0
    for k, v in st0.items(): assert torch.equal(v, st1[k]) if isinstance(v, torch.Tensor) else v == st1[k], k
    if fmt == 'bf16': assert st0['grad_avg'].dtype == torch.bfloat16


def test_a_bucket_is_upcast_a_chunk_at_a_time(monkeypatch):
    """Peak memory: a low-bit bucket's state is dequantized a chunk of about `CHUNK_BYTES` of fp32 state at a time
    (stored again before the next chunk's is dequantized), never the whole bucket at once; the numbers are the
    unchunked step's, bit for bit."""
    import cbopt.engine.lowbit as engine_lowbit

    def run(chunk_bytes):
        monkeypatch.setattr(engine_lowbit, 'CHUNK_BYTES', chunk_bytes)
        live, most = set(), [0]
        def unpack(st, p, plan):
            live.add(id(p))
            most[0] = max(most[0], len(live))
            lowbit.unpack(st, p, plan)
        def pack(st, p, plan, stochastic=True):
            live.discard(id(p))
            lowbit.pack(st, p, plan, stochastic)
        monkeypatch.setattr(engine_lowbit, 'unpack', unpack)
        monkeypatch.setattr(engine_lowbit, 'pack', pack)
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(6)])  # one bucket of 6 params of 4,096
        opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, state_precision='8bit', backend='foreach')
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            m(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert not live
        return m, opt, most[0]
    m0, o0, whole = run(1 << 30)
    m1, o1, chunked = run(2 * 4096 * 4 * 2)  # two params' Adam state (two fp32 entries each)
    assert whole == 6 and chunked == 2
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p0, p1)
        for k, v in o0.state[p0].items(): assert torch.equal(v, o1.state[p1][k]) if isinstance(v, torch.Tensor) else v == o1.state[p1][k]


def test_lr_scheduler_over_low_bit_fused_state_compiles_once():
    """An LR scheduler (OneCycleLR: lr and momentum change at every step) drives the fused low-bit graph with no
    recompile, and the params follow the loop's."""
    from torch._dynamo.utils import counters
    out = []
    for backend in ('loop', 'fused'):
        torch._dynamo.reset()
        counters.clear()
        m = _model()
        opt = cbopt.Adam(m.parameters(), lr=1e-2, state_precision='8bit', backend=cbopt.Backend(backend, compiler='aot_eager'))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        moms = set()
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            m(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            sched.step()
            moms.add(opt.param_groups[0]['mom'])
            opt.zero_grad()
        assert len(moms) == 6
        if backend == 'fused': assert counters['stats']['unique_graphs'] == 1
        out.append(m)
    for p0, p1 in zip(*(m.parameters() for m in out)): torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('wrap', [
    lambda o: cbopt.WarmupOptimizer(o, [cbopt.WarmupStage(cbopt.WarmupPolicy.LINEAR, max_iters=5, value=0.1)]),
    lambda o: cbopt.Lookahead(o), lambda o: cbopt.Accumulate(o, 2), lambda o: cbopt.SkipNonFinite(o),
    lambda o: cbopt.GradientClippingOptimizer(o, cbopt.GradientClipping.NORM, max_gradient=1.),
    lambda o: cbopt.InBackward(o)], ids=['warmup', 'lookahead', 'accumulate', 'skip', 'clipping', 'in_backward'])
def test_wrappers_keep_low_bit_state(wrap):
    """A wrapper over a low-bit optimizer keeps its groups' `state_precision` and `min_quantize_size`, and stores the
    chain's moments as codes (its own exact entries, Lookahead's slow weights, as they are)."""
    m = _model()
    opt = wrap(cbopt.Adam(m.parameters(), lr=1e-2, state_precision='4bit', min_quantize_size=64))
    assert [(g['state_precision'], g['min_quantize_size']) for g in opt.param_groups] == [('4bit', 64)]
    _train(opt, m, 2)
    st = opt.state[m[0].weight]
    assert {'grad_avg.codes', 'grad_avg.absmax', 'sqr_avg.codes', 'sqr_avg.absmax'} <= set(st)
    assert 'grad_avg' not in st and 'sqr_avg' not in st


def test_combined_optimizer_keeps_each_childs_state_precision():
    """`CombinedOptimizer` of an 8-bit Adam and an fp32 SGD: each group keeps its child's `state_precision` (shown in
    `param_groups`) and steps as the two children stepped apart, bit for bit, state included."""
    out = []
    for combine in (False, True):
        m = _model()
        kids = [cbopt.Adam(m[0].named_parameters(), lr=1e-2, state_precision='8bit'),
                cbopt.SGD(m[2].named_parameters(), lr=1e-2, mom=0.9)]
        opts = [cbopt.CombinedOptimizer([('enc', kids[0]), ('head', kids[1])])] if combine else kids
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            m(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
            for o in opts: o.step(), o.zero_grad()
        out.append((m, {id(p): st for o in opts for p, st in o.state.items()}, opts))
    (m0, s0, _), (m1, s1, (c,)) = out
    assert [(g['state_precision'], g['min_quantize_size']) for g in c.param_groups] == [('8bit', 4096), ('fp32', 4096)]
    assert 'grad_avg.codes' in s1[id(m1[0].weight)]
    for (p0, p1) in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p0, p1)
        a, b = s0[id(p0)], s1[id(p1)]
        assert list(a) == list(b)
        for k, v in a.items(): assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k


@pytest.mark.parametrize('backend', ['foreach', 'fused'])
def test_grad_scaler_over_low_bit_state_is_the_unscaled_run(backend):
    """`torch.amp.GradScaler` works unchanged over 8-bit state: with a scale that is a power of two (so scaling and
    unscaling are exact) moving both ways, and inf grads at two steps, the params and stored state are bit for bit
    those of the same optimizer stepped on the unscaled loss, skipping those steps (fused: the scaler hands the step
    its scale and inf flag, which the low-bit graph's bucket applies; foreach: the scaler unscales and skips)."""
    out = []
    for scaled in (False, True):
        m = _model()
        opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                              state_precision='8bit', backend=cbopt.Backend(backend, compiler='aot_eager'))
        sc = torch.amp.GradScaler('cpu', init_scale=2. ** 10, growth_interval=2)
        g, scales = torch.Generator().manual_seed(1), set()
        for i in range(8):
            loss = m(torch.randn(16, 64, generator=g)).pow(2).mean()
            if not scaled:
                loss.backward()
                if i not in (3, 4): opt.step()
            else:
                sc.scale(loss).backward()
                if i in (3, 4): m[2].bias.grad[0] = float('inf')
                sc.step(opt)
                sc.update()
                scales.add(sc.get_scale())
            opt.zero_grad()
        if scaled: assert {2. ** 9, 2. ** 11} <= scales  # (it grew, then backed off)
        out.append((m, opt))
    (m0, o0), (m1, o1) = out
    for p0, p1 in zip(m0.parameters(), m1.parameters()): assert torch.equal(p0, p1)
    st0, st1 = o0.state[m0[0].weight], o1.state[m1[0].weight]
    assert list(st0) == list(st1) and 'grad_avg.codes' in st0
    for k, v in st0.items(): assert torch.equal(v, st1[k]) if isinstance(v, torch.Tensor) else v == st1[k], k


@pytest.mark.parametrize('in_place', [False, True])
def test_fused_low_bit_under_clipping_follows_foreach(in_place):
    """Global-norm clipping (`GradientClippingOptimizer`) scales the grads of a low-bit bucket before the fused graph
    steps it, as foreach's chunks are (the user's grads left as they were, or clipped in place)."""
    out = {}
    for backend in ('foreach', 'fused'):
        m = _model()
        inner = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                                state_precision='8bit', backend=cbopt.Backend(backend, compiler='aot_eager'))
        opt = cbopt.GradientClippingOptimizer(inner, cbopt.GradientClipping.NORM, max_gradient=1e-3, in_place=in_place)
        grads = []
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            m(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            grads.append(m[0].weight.grad.clone())
            opt.zero_grad()
        out[backend] = m, grads
    (m0, g0), (m1, g1) = out['foreach'], out['fused']
    for p0, p1 in zip(m0.parameters(), m1.parameters()): torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7)
    for a, b in zip(g0, g1):  # (the grads of params that differ in their last bits)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-9)
        assert (b.norm() <= 1e-3 * 1.001) == in_place  # (clipped, or left as they were: their norm is above 1e-3)


def test_memory_and_state_bytes():
    "8-bit Adam state is about 2 bytes per param of the quantized ones (plus one fp32 absmax per 256)."
    m = _model()
    opt = cbopt.Optimizer(m.parameters(), adam_chain(), lr=1e-2, state_precision='8bit')
    _train(opt, m, 1)
    w = m[0].weight.numel()
    small = sum(p.numel() for p in m.parameters()) - w
    assert cbopt.state_bytes(opt) == 2 * w + 2 * 4 * quant.n_blocks(w, 256) + 8 * small
    fresh = cbopt.Optimizer(_model().parameters(), adam_chain(), lr=1e-2, state_precision='8bit')
    fresh.init_state()  # (the state before a first step is stored as the steps store it)
    assert cbopt.state_bytes(fresh) == 2 * w + 2 * 4 * quant.n_blocks(w, 256) + 8 * small
    fp_model = _model()
    fp = cbopt.Optimizer(fp_model.parameters(), adam_chain(), lr=1e-2)
    assert cbopt.state_bytes(fp) == 0
    _train(fp, fp_model, 1)
    assert cbopt.state_bytes(fp) == 8 * (w + small)


def _regression(make, steps=150):
    torch.manual_seed(0)
    X = torch.randn(512, 64)
    y = X @ torch.randn(64, 1) + 0.1 * torch.randn(512, 1)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1))
    opt = make(model.parameters())
    for i in range(steps):
        idx = torch.arange(i * 64, (i + 1) * 64) % 512
        nn.functional.mse_loss(model(X[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return nn.functional.mse_loss(model(X), y).item()


def _user_chain():
    "A chain a user lists: decay, a momentum they declare, and a sign step of their own (Lion-like)."
    def my_momentum(p, mom, my_avg=None, **kwargs):
        if my_avg is None: my_avg = torch.zeros_like(p.grad)
        my_avg.mul_(mom).add_(p.grad, alpha=1 - mom)
        return {'my_avg': my_avg}
    my_momentum.defaults, my_momentum.state, my_momentum.state_kinds = dict(mom=0.9), dict(my_avg=cbopt.chain.zeros), dict(my_avg='signed')

    def my_step(p, lr, my_avg, **kwargs): p.data.add_(my_avg.sign(), alpha=-lr)
    my_step.state = {}
    return [cbopt.callbacks.weight_decay, my_momentum, my_step]


@pytest.mark.parametrize('name,make', [
    ('lion', lambda prec: lambda ps: cbopt.Optimizer(ps, cbopt.Lion(nn.Linear(1, 1).parameters()).cbs, lr=3e-3, mom=0.9,
                                                      sqr_mom=0.99, wd=0., state_precision=prec)),
    ('adan', lambda prec: lambda ps: cbopt.Optimizer(ps, cbopt.Adan(nn.Linear(1, 1).parameters()).cbs, lr=3e-3, mom=0.98,
                                                      diff_mom=0.92, sqr_mom=0.99, eps=1e-8, wd=0., state_precision=prec)),
    ('user', lambda prec: lambda ps: cbopt.Optimizer(ps, _user_chain(), lr=1e-3, mom=0.9, wd=0., state_precision=prec)),
    ('sgd-dampening', lambda prec: lambda ps: cbopt.optim.SGD(ps, lr=3e-2, momentum=0.9, dampening=0.5,
                                                              state_precision=prec)),
])
def test_other_chains_converge_in_8bit_like_fp32(name, make):
    """Lion, Adan, a user's chain and torch's SGD with dampening (whose momentum buffer its first step creates: the
    grad, stored in 8-bit from then on) reach the fp32 run's loss (within 10%) with 8-bit state on a small regression,
    with no warning (every entry has a kind)."""
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fp32, q8 = _regression(make('fp32')), _regression(make('8bit'))
    start = _regression(make('fp32'), steps=0)
    assert fp32 < 0.5 * start
    assert abs(q8 - fp32) <= 0.1 * fp32 + 1e-3, (fp32, q8)


def test_undeclared_callback_keeps_fp32_with_one_warning():
    def plain_step(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)  # fastai style: declares nothing
    m = _model()
    opt = cbopt.Optimizer(m.parameters(), [cbopt.callbacks.average_grad, plain_step], lr=1e-2, mom=0.9, state_precision='8bit')
    with pytest.warns(UserWarning, match="plain_step.*no kind"): _train(opt, m, 1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _train(opt, m, 1)
    assert 'grad_avg.codes' in opt.state[m[0].weight]  # declared entries are still stored low-bit


# -- options, groups --------------------------------------------------------------------------------------------------
def test_group_override_and_settings_shown_and_checked():
    m = _model()
    opt = cbopt.Optimizer([{'params': [m[0].weight], 'state_precision': '4bit'}, {'params': [m[0].bias, *m[2].parameters()]}],
                          adam_chain(), lr=1e-2, state_precision='8bit', min_quantize_size=64)
    assert [g['state_precision'] for g in opt.param_groups] == ['4bit', '8bit']
    assert opt.param_groups[1]['min_quantize_size'] == 64
    _train(opt, m, 1)
    assert opt.state[m[0].weight]['grad_avg.codes'].numel() == m[0].weight.numel() // 2
    assert opt.state[m[0].bias]['grad_avg.codes'].numel() == 256  # (96 elements: one padded block)
    assert opt.state_dict()['param_groups'][0]['state_precision'] == '4bit'
    with pytest.raises(ValueError, match="state_precision='int8'.*expected one of"):
        cbopt.Optimizer(m.parameters(), adam_chain(), state_precision='int8')
    with pytest.raises(ValueError, match=r"state_precision='2bit' \(group 0\)"):
        cbopt.Optimizer([{'params': m.parameters(), 'state_precision': '2bit'}], adam_chain())
    fp = cbopt.Optimizer(m.parameters(), adam_chain())
    assert 'state_precision' not in fp.param_groups[0]  # an fp32 optimizer's groups are as they were


@pytest.mark.parametrize('make', [cbopt.Adam, cbopt.Lion, cbopt.optim.AdamW], ids=['Adam', 'Lion', 'optim.AdamW'])
def test_a_group_overrides_a_prebuilt_optimizers_setting(make):
    "A group dict's own 'state_precision' and 'min_quantize_size' override a prebuilt's keywords, as `Optimizer`'s."
    m = _model()
    opt = make([{'params': [m[0].weight], 'state_precision': 'fp32'}, {'params': [m[0].bias], 'min_quantize_size': 1},
                {'params': list(m[2].parameters())}], lr=1e-3, state_precision='8bit', min_quantize_size=64)
    assert [(g['state_precision'], g['min_quantize_size']) for g in opt.param_groups] == \
        [('fp32', 64), ('8bit', 1), ('8bit', 64)]
    assert opt.defaults['state_precision'] == '8bit'
    _train(opt, m, 2)
    assert not any(k.endswith('.codes') for k in opt.state[m[0].weight])  # kept fp32, as its group asks
    assert any(k.endswith('.codes') for k in opt.state[m[0].bias])  # 96 elements, quantized from 1 up
    assert any(k.endswith('.codes') for k in opt.state[m[2].weight]) == (m[2].weight.numel() >= 64)
    plain = make(m.parameters(), lr=1e-3)
    assert 'state_precision' not in plain.param_groups[0]  # (and the setting does not leak into the next one built)


# -- checkpoints ------------------------------------------------------------------------------------------------------
def _saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _make(m, prec, **kw):
    return cbopt.Optimizer(m.named_parameters(), adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                           state_precision=prec, **kw)


@pytest.mark.parametrize('prec', PRECISIONS)
def test_resume_bit_for_bit(prec):
    m1 = _model()
    o1 = _make(m1, prec)
    _train(o1, m1, 2)
    sd = _saved(o1.state_dict())
    names = {'8bit': ('codes', 'absmax'), '4bit': ('codes', 'absmax'), 'fp8': ('codes', 'scale')}.get(prec)
    st = sd['state'][0]
    if names: assert {f'grad_avg.{n}' for n in names} <= set(st) and 'grad_avg' not in st
    else: assert st['grad_avg'].dtype == torch.bfloat16
    assert sd['param_groups'][0]['state_precision'] == prec
    m2 = _model()
    m2.load_state_dict(m1.state_dict())
    o2 = _make(m2, prec)
    o2.load_state_dict(sd)
    rng = torch.get_rng_state()
    _train(o1, m1, 2, seed=5)
    torch.set_rng_state(rng)  # (bf16's stochastic rounding draws from torch's RNG)
    _train(o2, m2, 2, seed=5)
    for p1, p2 in zip(m1.parameters(), m2.parameters()): assert torch.equal(p1, p2)
    for k, v in o1.state[m1[0].weight].items():
        assert torch.equal(v, o2.state[m2[0].weight][k]) if isinstance(v, torch.Tensor) else v == o2.state[m2[0].weight][k]


@pytest.mark.parametrize('prec', PRECISIONS)
def test_fp32_and_low_bit_checkpoints_convert(prec):
    m = _model()
    q = _make(m, prec)
    _train(q, m, 2)
    deq = q.state_dict(dequantize=True)
    assert deq['state'][0]['grad_avg'].dtype == torch.float32 and deq['param_groups'][0]['state_precision'] == 'fp32'
    fp = _make(_model(), 'fp32')
    fp.load_state_dict(_saved(q.state_dict()))  # a low-bit checkpoint into fp32: dequantized
    w = fp.param_groups[0]['params'][0]
    torch.testing.assert_close(fp.state[w]['grad_avg'], deq['state'][0]['grad_avg'], rtol=0, atol=0)
    back = _make(_model(), prec)
    back.load_state_dict(fp.state_dict())  # fp32 into low-bit: quantized, to the same stored state
    w2 = back.param_groups[0]['params'][0]
    plan = lowbit.param_plan(back.param_groups[0], w2)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fp.state[w].items()}
    lowbit.pack(expected, w2, plan)  # (loading fp32 state quantizes it, as a step's end does)
    for k, v in expected.items():
        assert torch.equal(v, back.state[w2][k]) if isinstance(v, torch.Tensor) else v == back.state[w2][k], k
    torch.testing.assert_close(lowbit.dequantized_state(back.state[w2], w2, back.param_groups[0])['grad_avg'],
                               deq['state'][0]['grad_avg'], rtol=0.3 if prec == '4bit' else 0.07, atol=1e-6)
    torch_opt = torch.optim.AdamW(_model().parameters())  # torch loads the dequantized one in its own names
    torch_opt.load_state_dict(q.state_dict(format=torch.optim.AdamW, dequantize=True))
    assert torch_opt.state[next(iter(torch_opt.state))]['exp_avg'].dtype == torch.float32


def test_torch_names_for_low_bit_state():
    m = _model()
    q = _make(m, '8bit')
    _train(q, m, 1)
    sd = q.state_dict(format=torch.optim.AdamW)
    assert {'exp_avg.codes', 'exp_avg.absmax', 'exp_avg_sq.codes', 'exp_avg_sq.absmax', 'step'} == set(sd['state'][0])
    assert sd['param_groups'][0]['state_precision'] == '8bit'
    again = _make(_model(), '8bit')
    again.load_state_dict(_saved(sd))
    w = again.param_groups[0]['params'][0]
    assert torch.equal(again.state[w]['grad_avg.codes'], q.state[m[0].weight]['grad_avg.codes'])


@pytest.mark.parametrize('backend', ['loop', 'foreach', 'fused'])
def test_sgd_dampening_buffer_is_the_first_grad_then_stored_low_bit(backend):
    """torch's SGD with dampening keeps the first grad whole as its momentum buffer (`at_first_step`): in 8-bit the
    first step is torch's bit for bit (the step uses the fp32 buffer, quantized after), the buffer is then stored as
    codes under torch's names (`momentum_buffer.codes`, no other entry), dequantized within the map's error of
    torch's buffer, and its fp32 form loads into torch's SGD, which steps on from it."""
    kw = dict(lr=3e-2, momentum=0.9, dampening=0.5, weight_decay=0.01)
    m, ref_m = _model(), _model()
    ours = cbopt.optim.SGD(m.parameters(), **kw, state_precision='8bit', min_quantize_size=1)
    ours.backend = backend
    ref = torch.optim.SGD(ref_m.parameters(), **kw, foreach=False)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _train(ours, m, 1)
    _train(ref, ref_m, 1)
    for p, q in zip(m.parameters(), ref_m.parameters()): assert torch.equal(p, q)
    sd = ours.state_dict()
    for i, q in enumerate(ref_m.parameters()):
        assert set(sd['state'][i]) == {'momentum_buffer.codes', 'momentum_buffer.absmax'}
        buf = ours.state_dict(dequantize=True)['state'][i]['momentum_buffer']
        want = ref.state[q]['momentum_buffer']  # (the grad: the first step keeps it whole)
        torch.testing.assert_close(buf, want, rtol=0.02, atol=0.02 * want.abs().max().item())
        assert (buf - want).abs().max() < (buf - (1 - kw['dampening']) * want).abs().max()
    twin_m = _model()
    twin_m.load_state_dict(m.state_dict())
    twin = torch.optim.SGD(twin_m.parameters(), **kw, foreach=False)
    twin.load_state_dict(ours.state_dict(dequantize=True))
    _train(ours, m, 2, seed=2), _train(twin, twin_m, 2, seed=2)  # (the same fp32 buffer, stored anew at each step)
    for p, q in zip(m.parameters(), twin_m.parameters()): torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('corrupt,match', [
    (lambda st, g: st.update({'grad_avg.codes': st['grad_avg.codes'][:-1]}), r"'grad_avg.codes' should be a torch.uint8 tensor of shape"),
    (lambda st, g: st.pop('grad_avg.absmax'), r"has no 'grad_avg.absmax'"),
    (lambda st, g: g.update(state_precision='3bit'), r"state_precision is '3bit'.*unknown format"),
    (lambda st, g: st.update({'grad_avg.scale': st['grad_avg.absmax']}), r"has 'grad_avg.scale', which 8bit does not store"),
])
def test_bad_low_bit_checkpoints_refused_changing_nothing(corrupt, match):
    m = _model()
    q = _make(m, '8bit')
    _train(q, m, 1)
    sd = _saved(q.state_dict())
    corrupt(sd['state'][0], sd['param_groups'][0])
    mt = _model()
    target = _make(mt, '8bit')
    _train(target, mt, 1, seed=3)  # (state of its own, which a refused load must leave as it is)
    before = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} for st in target.state.values()]
    with pytest.raises(ValueError, match=match): target.load_state_dict(sd)
    after = list(target.state.values())
    assert len(after) == len(before)
    for b, a in zip(before, after):
        assert list(a) == list(b)
        assert all(torch.equal(a[k], v) if isinstance(v, torch.Tensor) else a[k] == v for k, v in b.items())
    fresh = _make(_model(), 'fp32')
    with pytest.raises(ValueError, match=match): fresh.load_state_dict(sd)
    assert not any(fresh.state.values())


# -- every optimizer --------------------------------------------------------------------------------------------------
def test_every_prebuilt_takes_state_precision():
    "Every prebuilt factory and every cbopt.optim class takes `state_precision=` (keyword) and shows it in its groups."
    import inspect
    factories = [getattr(cbopt.recipes, n) for n in cbopt.recipes.__all__
                 if n[0].isupper() and n not in ('LBFGS', 'Lookahead')] + [cbopt.ranger]
    classes = [getattr(cbopt.optim, n) for n in cbopt.optim.__all__ if n != 'LBFGS']
    for f in factories + classes:
        assert 'state_precision' in inspect.signature(f).parameters, f.__name__
    m = _model()
    assert cbopt.Lion(m.parameters(), state_precision='4bit').param_groups[0]['state_precision'] == '4bit'
    opt = cbopt.optim.AdamW(m.parameters(), state_precision='fp8')
    assert opt.param_groups[0]['state_precision'] == 'fp8'
    _train(opt, m, 1)
    assert {'exp_avg.codes', 'exp_avg.scale', 'exp_avg_sq.codes', 'exp_avg_sq.scale', 'step'} == set(opt.state[m[0].weight])
    with pytest.raises(ValueError, match='state_precision'): cbopt.Adam(m.parameters(), state_precision='16bit')


@pytest.mark.parametrize('c', [c for c in __import__('cases').CASES if not c.needs_closure], ids=lambda c: c.id)
def test_every_case_steps_and_resumes_in_8bit(c):
    """Each registry algorithm with 8-bit state (every param quantized: `min_quantize_size=1`): finite params after
    its steps, its signed and non-negative entries stored as codes, and a checkpoint resuming bit for bit."""
    from conftest import assert_same_params, make_model, train, two_groups
    lr = slice(3e-3, 3e-2)
    ref, model = make_model(), make_model()
    o_ref = c.build(two_groups(ref, True), lr)
    o_ref.set_state_precision('8bit', 1)
    torch.manual_seed(0)  # (an accumulator's bf16 stochastic rounding draws from torch's RNG: the same draws in both)
    train(o_ref, ref, 6)
    opt = c.build(two_groups(model, True), lr)
    opt.set_state_precision('8bit', 1)
    fresh = c.build(two_groups(model, True), lr)
    fresh.set_state_precision('8bit', 1)
    torch.manual_seed(0)
    train(opt, model, 3)
    for g in opt.param_groups:
        kinds = lowbit.chain_kinds(tuple(g['cbs']))
        for p in g['params']:
            for k in opt.state[p] if not isinstance(opt, cbopt.optim.TorchOptimizer) else opt.__dict__['state'][p]:
                assert kinds.get(k) not in ('signed', 'nonnegative') or p.numel() != opt.__dict__.get('state', opt.state)[p][k].numel(), (k, c.id)
    sd = _saved(opt.state_dict())
    fresh.load_state_dict(sd)
    train(fresh, model, 3, start=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_same_params(model, ref)


def test_dtensor_params_step_save_and_load_as_plain_ones(one_rank_mesh):
    """A param sharded as a DTensor (here on a mesh of this process alone: FSDP2 on 2 ranks is tests/test_fsdp.py) steps
    as the plain param does, bit for bit, in every format (and compiled: `fused`); its checkpoint holds the whole tensor's parts as DTensors
    (what DCP reshards), which load into a plain optimizer, and a plain optimizer's into it, to the same state."""
    from conftest import sharded
    torch.manual_seed(0)
    w0, grads = torch.randn(96, 64), [torch.randn(96, 64) for _ in range(3)]
    fused = cbopt.Backend('fused', compiler='aot_eager')  # (on DTensors: the chain compiled on the shard)
    for prec, backend in [(p, 'foreach') for p in PRECISIONS] + [('8bit', fused)]:
        plain, dt = nn.Parameter(w0.clone()), nn.Parameter(sharded(one_rank_mesh, w0.clone()))
        make = lambda w: cbopt.Optimizer([('w', w)], adam_chain(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                                         state_precision=prec, backend=backend)
        opts = [make(plain), make(dt)]
        for i, g in enumerate(grads):
            for w, o in zip((plain, dt), opts):
                w.grad = g.clone() if w is plain else sharded(one_rank_mesh, g.clone())
                torch.manual_seed(i)  # (bf16's stochastic rounding draws from torch's RNG)
                o.step()
        assert torch.equal(plain, dt.full_tensor()), prec
        assert cbopt.state_bytes(opts[0]) == cbopt.state_bytes(opts[1])
        sd_plain, sd_dt = (o.state_dict()['state'][0] for o in opts)
        assert set(sd_plain) == set(sd_dt) and all(type(v).__name__ == 'DTensor' for v in sd_dt.values() if torch.is_tensor(v))
        bits = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t
        for k, v in sd_plain.items():
            if torch.is_tensor(v): assert torch.equal(v.view(torch.uint8), bits(sd_dt[k]).view(torch.uint8)), (prec, k)
        # the sharded checkpoint into a plain optimizer, the plain one into a sharded optimizer: the same state
        for sd, w, like in ((opts[1].state_dict(), nn.Parameter(w0.clone()), opts[0].state[plain]),
                            (opts[0].state_dict(), nn.Parameter(sharded(one_rank_mesh, w0.clone())), opts[1].state[dt])):
            again = make(w)
            again.load_state_dict(sd)
            assert set(again.state[w]) == set(like)
            for k, v in like.items():
                got = again.state[w][k]
                assert type(got) is type(v) and (torch.equal(bits(got).view(torch.uint8), bits(v).view(torch.uint8))
                                                 if torch.is_tensor(v) else got == v), (prec, k)


def test_dtensor_params_sharded_otherwise_refused(one_rank_mesh):
    "Low-bit state for a DTensor sharded other than on dim 0 (tensor parallel's Shard(1)) is refused, naming it."
    from torch.distributed.tensor import Shard, distribute_tensor
    w = nn.Parameter(distribute_tensor(torch.randn(64, 64), one_rank_mesh, [Shard(1)]))
    with pytest.raises(NotImplementedError, match=r"param 0: a DTensor with placements \(Shard\(dim=1\),\)"):
        cbopt.Adam([w], state_precision='8bit')
    opt = cbopt.Adam([w])
    with pytest.raises(NotImplementedError, match="Shard"): opt.set_state_precision('4bit')
    assert 'state_precision' not in opt.param_groups[0]


# -- convergence: issue #33's goals -----------------------------------------------------------------------------------
GOALS = {'8bit': 0.03, '4bit': 0.08}  # AdamW's eval loss within this of fp32 AdamW's, over the same steps and batches


def _adamw(prec, lr, **kw):
    return lambda ps: cbopt.optim.AdamW(ps, lr=lr, weight_decay=0.01, state_precision=prec, **kw)


@pytest.mark.usefixtures('one_thread')
def test_adamw_converges_like_fp32_on_the_demo_task():
    """`python -m cbopt demo`'s task (its teacher-net regression, its MLP, its 400 steps of batch 64 through its own
    `train`), with 512 samples held out: 8-bit and 4-bit AdamW end within the issue's distance of fp32's eval loss.
    `min_quantize_size=1024` quantizes both hidden layers' weights (96% of the params; the 64x64 one alone would be
    77% at the default 4,096), which `state_bytes` shows. (The losses here end near 0.015, so the goals leave the
    low-bit runs room; a quantizer that stalled training would end near the start, 0.19.)"""
    from cbopt.cli import demo
    x, y = demo.make_data(n=2048 + 512)
    ev = {}
    for prec in ('fp32', *GOALS):
        model, opts = demo.make_model(), []
        demo.train(lambda ps: opts.append(_adamw(prec, 3e-3, min_quantize_size=1024)(ps)) or opts[0], model, x[:2048], y[:2048], 400)
        with torch.no_grad(): ev[prec] = nn.functional.mse_loss(model(x[2048:]), y[2048:]).item()
        ev[prec, 'bytes'] = cbopt.state_bytes(opts[0])
    with torch.no_grad(): start = nn.functional.mse_loss(demo.make_model()(x[2048:]), y[2048:]).item()
    assert ev['fp32'] < 0.2 * start, (start, ev)
    for prec, tol in GOALS.items(): assert abs(ev[prec] - ev['fp32']) <= tol, (prec, ev)
    assert ev['8bit', 'bytes'] <= 0.3 * ev['fp32', 'bytes'] and ev['4bit', 'bytes'] <= 0.18 * ev['fp32', 'bytes'], ev


@pytest.mark.usefixtures('one_thread')
def test_adamw_converges_like_fp32_on_a_char_transformer():
    """The character-level GPT of `cbopt.cli.char_lm` (110k params, 98% of them in matrices that quantize) on Python's
    stdlib sources, 200 steps of 16 windows of 64 characters, lr warmed up and annealed: 8-bit and 4-bit AdamW end
    within the issue's distance of fp32's held-out loss (notebook 08 plots these runs)."""
    from cbopt.cli import char_lm
    data = char_lm.char_data()
    runs = {prec: char_lm.train(_adamw(prec, 3e-3), steps=200, data=data) for prec in ('fp32', *GOALS)}
    ev = {prec: r.eval_loss for prec, r in runs.items()}
    assert ev['fp32'] < 0.5 * math.log(char_lm.VOCAB), ev  # it learned: uniform guessing is log(128) = 4.85
    for prec, tol in GOALS.items(): assert abs(ev[prec] - ev['fp32']) <= tol, (prec, ev)
    params = list(runs['fp32'].model.parameters())
    assert sum(p.numel() for p in params if p.numel() >= 4096) >= 0.98 * sum(p.numel() for p in params)
    size = {prec: cbopt.state_bytes(r.opt) for prec, r in runs.items()}
    assert size['8bit'] <= 0.29 * size['fp32'] and size['4bit'] <= 0.17 * size['fp32'], size
