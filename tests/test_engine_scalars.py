"""The compiled chain's per-step numbers: every 0-d value that an op over a param's elements reads passes through
`cbopt::scalar`, so inductor computes it once before its loops (not once per vector of elements), and the graph pass
`ScalarsOnce` makes those barriers one call per graph: one per value, none of a graph input, the independent ones
merged into one `cbopt::scalars`. Checked on a hand-made graph (against the unchanged graph's results) and through
inductor on schedule-free SGD (whose per-param weights are 0-d tensors), against the loop backend."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import cbopt
from cbopt.engine import compiled, scalars
from cbopt.engine.scalars import ScalarArgsAsTensors
from conftest import assert_rel_close, NO_COMPILE_FALLBACK

pytestmark = NO_COMPILE_FALLBACK

scalars.register_ops()  # (made on the first compile: `import cbopt` registers no op)
SCALAR, SCALARS = torch.ops.cbopt.scalar.default, torch.ops.cbopt.scalars.default


def _calls(gm: torch.fx.GraphModule, target) -> list:
    return [n for n in gm.graph.nodes if n.op == 'call_function' and n.target is target]


def test_scalars_once_dedupes_drops_inputs_and_merges() -> None:
    def step(x, y, a, w):
        b = a * 2
        u = x * SCALAR(b) + y * SCALAR(b)  # one value twice: one barrier
        v = x * SCALAR(a)                  # a graph input that nothing writes: no barrier
        c = SCALAR(u.sum())                # reads what a barrier feeds: a call of its own, after the first
        r = v * SCALAR(w)                  # `w` is written below: kept, and read before the write
        w.add_(1.)
        d = SCALAR(w * 2) * SCALAR(w * 5)  # computed after the write: not merged (their readers would cross it)
        return u * c + r + d

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(6, generator=g), torch.randn(6, generator=g), torch.tensor(0.3), torch.tensor(-1.5)]
    gm = make_fx(step)(*[a.clone() for a in args])
    assert len(_calls(gm, SCALAR)) == 7
    expected = gm(*[a.clone() for a in args])
    scalars.ScalarsOnce()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    merged = _calls(gm, SCALARS)
    assert len(merged) == 1 and len(merged[0].args[0]) == 2  # b's and w's, which do not depend on each other
    assert [src.op for src in merged[0].args[0]] == ['call_function', 'placeholder']  # b = a * 2, and w (written)
    assert merged[0].args[0][1].name.startswith('w')
    assert [v.shape for v in merged[0].meta['val']] == [(), ()]  # what inductor lowers the call by: its outputs
    assert len(_calls(gm, SCALAR)) == 3                       # u.sum()'s, which depends on b's, and d's two
    assert not any(n.args[0].op == 'placeholder' and n.args[0].name.startswith('a') for n in _calls(gm, SCALAR))
    got_args = [a.clone() for a in args]
    torch.testing.assert_close(gm(*got_args), expected, rtol=0, atol=0)
    assert got_args[3].item() == args[3].item() + 1  # the write still happens


def test_scalars_once_merges_no_scalars_of_two_devices() -> None:
    """`ScalarsOnce` merges the barriers of one device only: in a CUDA graph the tensorified hypers are CPU scalars,
    and one `cbopt::scalars` call over CPU and CUDA values would mix devices (here the second device is 'meta', set
    on the barrier of `w` in the graph of `test_scalars_once_dedupes_drops_inputs_and_merges`)."""
    def step(x, a, w):
        r = x * SCALAR(a * 2) + x * SCALAR(w)
        w.add_(1.)
        return r
    args = [torch.randn(6), torch.tensor(0.3), torch.tensor(-1.5)]
    gm = make_fx(step)(*[a.clone() for a in args])
    on_w = next(n for n in _calls(gm, SCALAR) if n.args[0].op == 'placeholder')
    on_w.meta['val'] = torch.empty((), device='meta')
    scalars.ScalarsOnce()(gm.graph)
    assert not _calls(gm, SCALARS) and len(_calls(gm, SCALAR)) == 2
    gm2 = make_fx(step)(*[a.clone() for a in args])  # (the same graph on one device: merged)
    scalars.ScalarsOnce()(gm2.graph)
    assert len(_calls(gm2, SCALARS)) == 1


def test_schedule_free_compiled_step_computes_its_numbers_in_one_call(monkeypatch) -> None:
    """Through inductor: one `cbopt::scalars` call per graph (ckp1 and the step sizes of every param, lr), no
    `scalar` left, one graph for runs of two flat params (the last padded), no recompiles as the warmup moves lr,
    and the loop's results (1e-6 of each tensor's scale: inductor reorders float ops) over 12 steps."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(compiled, '_COMPILED', {})  # (a fresh compile: its code is what is checked)
    torch._dynamo.reset()
    counters.clear()
    shapes = [(5, 3), (3,), (4,)]

    def run(backend: cbopt.Backend) -> tuple[torch.nn.ParameterList, list]:
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        opt = cbopt.ScheduleFreeSGD(ps, lr=0.1, wd=0.01, warmup_steps=4, backend=backend).train()
        codes = []
        for i in range(12):
            for p in ps: p.grad = torch.randn(p.shape, generator=g)
            if i == 1: codes = run_and_get_code(opt.step)[1]  # the compiling step (the first runs eagerly)
            else: opt.step()
        return torch.nn.ParameterList(ps), codes

    with torch._inductor.config.patch(fx_graph_cache=False), torch._dynamo.config.patch(error_on_recompile=True):
        fused, codes = run(cbopt.Backend('fused', compile_chunk=2))
    loop, _ = run(cbopt.Backend('loop'))
    assert counters['stats']['unique_graphs'] == 1 and not counters['recompiles']
    assert len(codes) == 1
    assert codes[0].count('torch.ops.cbopt.scalars.default(') == 1
    assert 'torch.ops.cbopt.scalar.default(' not in codes[0]
    assert_rel_close(fused, loop, rtol=1e-6)


def test_scalars_once_keeps_one_barrier_per_converted_value() -> None:
    """The chain runs once per param, so a value made float32 for ops over float32 tensors is converted once per
    param: one barrier for it all the same (`_value_key`), and none for a value converted to another dtype."""
    def step(x, y, a):
        u = x * SCALAR(a.to(torch.float32)) + y * SCALAR(a.to(torch.float32))  # one value, converted per param
        return u * SCALAR(a.to(torch.float16).to(torch.float32))                 # another value

    args = [torch.randn(6), torch.randn(6), torch.tensor(0.3, dtype=torch.float64)]
    gm = make_fx(step)(*args)
    expected = gm(*args)
    assert len(_calls(gm, SCALAR)) == 3
    scalars.ScalarsOnce()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    (merged,) = _calls(gm, SCALARS)
    assert len(merged.args[0]) == 2 and not _calls(gm, SCALAR)
    torch.testing.assert_close(gm(*args), expected, rtol=0, atol=0)


def test_float32_loops_read_float32_numbers_and_float64_ones_keep_theirs(monkeypatch) -> None:
    """Over float32 params, the per-step numbers reach inductor's loop as float32 0-d buffers (the elementwise kernel
    takes no float64 pointer: a float64 number cost the loop a conversion per vector of elements, which the C++
    compiler does not hoist); over float64 params they stay float64. RAdam (its rectification and debiasing numbers
    computed in double), 12 steps against the loop backend: 1e-6 of each tensor's scale for float32, 1e-12 for
    float64 (numbers rounded to float32 would be off by about 1e-8)."""
    import ast
    import re

    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(compiled, '_COMPILED', {})
    torch._dynamo.reset()

    def run(backend, dtype: torch.dtype) -> tuple[torch.nn.ParameterList, list]:
        g = torch.Generator().manual_seed(2)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in [(5, 3), (4,)]]
        opt = cbopt.RAdam(ps, lr=0.01, wd=0.1, backend=backend)
        codes = []
        for i in range(12):
            for p in ps: p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            if i == 1: codes = run_and_get_code(opt.step)[1]
            else: opt.step()
        return torch.nn.ParameterList(ps), codes

    def loop_kernel_args(code: str) -> list[str]:
        "The argument types of the kernel with a vectorised loop over elements (the other computes the numbers)."
        kernels = re.findall(r"cpp_pybinding\((\[.*?\]), r'''(.*?)'''\)", code, re.S)
        (args,) = [ast.literal_eval(a) for a, src in kernels if 'loadu' in src]
        return args

    with torch._inductor.config.patch(fx_graph_cache=False):
        f32, code32 = run(cbopt.Backend('fused', compile_chunk=1), torch.float32)
        f64, code64 = run(cbopt.Backend('fused', compile_chunk=1), torch.float64)
    args32, args64 = loop_kernel_args(code32[0]), loop_kernel_args(code64[0])
    assert 'const float*' in args32 and 'const double*' not in args32
    assert 'const float*' not in args64 and 'float*' not in args64
    assert_rel_close(f32, run(cbopt.Backend('loop'), torch.float32)[0], rtol=1e-6)
    assert_rel_close(f64, run(cbopt.Backend('loop'), torch.float64)[0], rtol=1e-12)


def test_scalars_once_has_a_key_for_the_graph_cache() -> None:
    """Inductor's FX graph cache keys a custom pass by its `uuid`: the hash of the pass's source file, the same for
    every instance (a cached graph compiled with another version of the pass is not reused)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files
    key = scalars.ScalarsOnce().uuid()
    assert isinstance(key, bytes) and key == scalars.ScalarsOnce().uuid()
    assert key == get_hash_for_files((scalars.__file__,))


@pytest.mark.parametrize('scalars_once', [False, True])
def test_scalar_args_as_tensors_computes_the_same(scalars_once, monkeypatch) -> None:
    """Under the mode, `alpha=`, `value=`, a number `lerp` weight and clamp bounds become tensor ops: the values are
    those of the plain ops, and the in-place ops still write into their tensor and return it; with `scalars_once`
    (the compiled chain's), numbers and 0-d tensors that arithmetic on a tensor reads pass through `cbopt::scalar`."""
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3))
    lo = torch.full((5,), -0.3, dtype=torch.float64)
    ops = {
        'add': lambda: x.add(y, alpha=0.7), 'sub': lambda: torch.sub(x, y, alpha=-2.),
        'addcmul': lambda: x.addcmul(y, z, value=0.25), 'addcdiv': lambda: torch.addcdiv(x, y, z.abs() + 1, value=-3.),
        'lerp': lambda: x.lerp(y, 0.3), 'torch.lerp': lambda: torch.lerp(x, y, 0.6), 'lerp-tensor': lambda: x.lerp(y, z),
        'clamp': lambda: x.clamp(-0.2, 0.5), 'clamp-min': lambda: torch.clamp(x, min=-0.1), 'clip-max': lambda: x.clip(max=0.1),
        'clamp-tensor': lambda: x.clamp(min=lo), 'mul': lambda: x.mul(2.5),
        'scalar-math': lambda: (x * (0.9 ** 3) / (1 - torch.tensor(0.3, dtype=torch.float64))).sub(y, alpha=1 / 7),
        'rsub': lambda: 1. - x / torch.tensor(3., dtype=torch.float64),
    }
    barriers, real = [], scalars.scalar
    monkeypatch.setattr(scalars, 'scalar', lambda v: barriers.append(v) or real(v))
    for name, op in ops.items():
        expected = op()
        with ScalarArgsAsTensors(scalars_once): got = op()
        torch.testing.assert_close(got, expected, rtol=1e-15, atol=0, msg=name)
    for name, op in {'add_': lambda t: t.add_(y, alpha=0.7), 'addcdiv_': lambda t: t.addcdiv_(y, z.abs() + 1, value=2.),
                     'lerp_': lambda t: t.lerp_(y, 0.3), 'clamp_': lambda t: t.clamp_(-0.2, 0.5),
                     'clip_': lambda t: t.clip_(min=0.)}.items():
        expected = op(x.clone())
        t = x.clone()
        with ScalarArgsAsTensors(scalars_once): got = op(t)
        assert got is t, name
        torch.testing.assert_close(t, expected, rtol=1e-15, atol=0, msg=name)
    assert bool(barriers) == scalars_once and all(v.dim() == 0 for v in barriers)
    barriers.clear()
    w = torch.tensor(0.3, dtype=torch.float64)  # any op's 0-d tensor arg, not only arithmetic's (schedule-free's lerp)
    with ScalarArgsAsTensors(scalars_once): got = x.lerp(y, w)
    torch.testing.assert_close(got, x.lerp(y, w), rtol=1e-15, atol=0)
    assert [v is w for v in barriers] == ([True] if scalars_once else [])
    for op, number in ((lambda: x.add(y, alpha=0.7), 0.7), (lambda: torch.sub(x, y, alpha=-2.), -2.),
                       (lambda: x.addcmul(y, z, value=0.25), 0.25), (lambda: torch.addcdiv(x, y, z + 5, value=-3.), -3.)):
        barriers.clear()  # an `alpha=`/`value=` number: once, as a float64 0-d tensor (read at Python's precision)
        with ScalarArgsAsTensors(scalars_once): op()
        assert [(v.item(), v.dtype) for v in barriers] == ([(number, torch.float64)] if scalars_once else [])
    u, v = (torch.randn(1000, generator=g) for _ in range(2))  # a number lerp weight: `u + (v - u) * w`, which a
    for w in (0.3, 0.75):                                      # compile keeps symbolic (torch's lerp: other roundings)
        with ScalarArgsAsTensors(scalars_once): got = (u.lerp(v, w), torch.lerp(u, v, w), u.clone().lerp_(v, w))
        assert all(torch.equal(r, u + (v - u) * w) for r in got), w
    assert not torch.equal(torch.lerp(u, v, 0.75), u + (v - u) * 0.75)  # (so the check above tells them apart)
