"""torch's compiled-optimizer recipe, `@torch.compile def step(): opt.step()`, on cbopt optimizers: it runs in every
backend, steps exactly as the same optimizer in eager mode, and never recompiles when lr or the step count change.
The step is one graph break (`cbopt.engine.run_step` runs eagerly: see its docstring); the test says so."""
import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import cbopt

BACKENDS = {'loop': 'loop', 'foreach': 'foreach', 'auto': 'auto',
            'fused': cbopt.Backend('fused', compiler='aot_eager')}  # aot_eager: tracing without inductor's codegen


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


@pytest.mark.parametrize('lr_kind', ['float', 'tensor'])
@pytest.mark.parametrize('backend', list(BACKENDS))
def test_compiled_step_matches_eager(backend, lr_kind):
    torch._dynamo.reset()
    m = _model()
    m_ref = copy.deepcopy(m)
    lr = 1e-2 if lr_kind == 'float' else torch.tensor(1e-2)
    opt = cbopt.Adam(m.named_parameters(), lr=lr, backend=BACKENDS[backend])
    ref = cbopt.Adam(m_ref.named_parameters(), lr=copy.deepcopy(lr), backend=BACKENDS[backend])
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(): opt.step()

    for i in range(6):
        x = torch.randn(8, 5)
        for mod in (m, m_ref): mod(x).pow(2).mean().backward()
        step()
        ref.step()
        for o in (opt, ref): o.zero_grad()
        if i == 0: frames = counter.frame_count
        if i == 2:  # a new lr, as a scheduler sets it: never a recompile
            for o in (opt, ref):
                if lr_kind == 'float': o.param_groups[0]['lr'] = 5e-3
                else: o.param_groups[0]['lr'].fill_(5e-3)
    for p, q in zip(m.parameters(), m_ref.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert counter.frame_count == frames, "a later step recompiled"
    assert opt.named_state_dict()['state']['0.weight']['step'] == 6


def test_compiled_step_is_one_graph_break():
    "What breaks, said once: the engine's step runs eagerly inside the compiled function (torch's own has no break)."
    torch._dynamo.reset()
    m = _model()
    opt = cbopt.SGD(m.parameters(), lr=0.1, mom=0.9)
    for p in m.parameters(): p.grad = torch.ones_like(p)

    def step(x):
        y = x * 2
        opt.step()
        return y + 1
    explained = torch._dynamo.explain(step)(torch.ones(3))
    assert explained.graph_break_count == 1, explained.break_reasons
    assert "cbopt's step runs eagerly" in str(explained.break_reasons[0].reason)
