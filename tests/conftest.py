"""The helpers every test file shares, one meaning per name: a tiny two-group MLP, real gradients that are the same
for the same params at the same step, and the per-tensor comparisons. The algorithm cases (cbopt builders, their
torch and fastai references, tolerances) are in `cases.py`."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cbopt


# A compiled chain that cannot compile falls back to foreach with one warning, stepping the same values: in the files
# that test the compiled path, that warning fails the test (`pytestmark = NO_COMPILE_FALLBACK`), or a broken compiled
# path would pass unseen.
NO_COMPILE_FALLBACK = pytest.mark.filterwarnings('error:the callback chain could not be compiled')


def import_torchvision() -> None:
    """Import torchvision's Python package where its C ops cannot load (timm, Lightning and HF's Trainer import it).
    PyPI's torchvision wheel is built against CUDA torch: beside the CPU torch this suite runs on, its C extension does
    not load, and `torchvision._meta_registrations` (fake kernels for those C++ ops) raises at `import torchvision`
    ('operator torchvision::nms does not exist'). The package is then imported without that one module; no test runs
    a torchvision op. Nothing changes where torchvision imports, or is not installed."""
    import sys, types
    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        for k in [k for k in sys.modules if k == 'torchvision' or k.startswith('torchvision.')]: del sys.modules[k]
        sys.modules['torchvision._meta_registrations'] = types.ModuleType('torchvision._meta_registrations')
        import torchvision  # noqa: F401
    except ImportError: pass


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: these tensors are tiny, and CPU kernels that go parallel (torch's fused
    AdamW) spin for milliseconds per call when the cores are shared. `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (tools/gpu_check.sh runs these on a GPU)"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device a test's params live on: the CPU, and CUDA where a GPU exists (skipped with the reason otherwise), so
    one test checks both. A CUDA run keeps torch's default: TF32 matmuls off, as the CPU computes."""
    return torch.device(request.param)


@pytest.fixture(scope='module')
def one_rank_mesh():
    "A gloo process group of this process alone and its 1-D mesh: DTensors without spawning ranks."
    dist = pytest.importorskip('torch.distributed')
    if not dist.is_available() or dist.is_initialized(): pytest.skip('needs torch.distributed, not yet initialised')
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try: yield init_device_mesh('cpu', (1,))
    finally: dist.destroy_process_group()


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny MLP (6-8-3; FQNs `0.weight`, `0.bias`, `2.weight`, `2.bias`), the same for the same `seed` whatever
    the global RNG (tanh is smooth: tiny differences stay tiny)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def two_groups(model: nn.Module, named: bool = False) -> list[list]:
    "fastai splitter style: body and head, as tensors or as (FQN, tensor) pairs."
    ps = list(model.named_parameters()) if named else list(model.parameters())
    return [ps[:2], ps[2:]]


def batch_loss(model: nn.Module, step: int) -> torch.Tensor:
    "The MSE loss of `model` (a `make_model`) on batch `step` of a fixed synthetic data set."
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    x, y = x.to(model[0].weight), y.to(model[0].weight)
    return F.mse_loss(model(x), y)


def set_grads(model: nn.Module, step: int) -> None:
    "Set every `p.grad` from `batch_loss(model, step)`: a real, param-dependent grad."
    for p in model.parameters(): p.grad = None
    with torch.enable_grad(): batch_loss(model, step).backward()


def random_grads(params, seed: int) -> None:
    "Set every `p.grad` of a list of params to seeded noise (different for every `seed`), in each param's dtype."
    g = torch.Generator().manual_seed(seed)
    for p in params: p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def train(opt, model: nn.Module, steps: int, start: int = 0) -> None:
    "Take `steps` optimizer steps on the batches `start`, `start+1`, ..."
    for i in range(start, start + steps):
        set_grads(model, i)
        opt.step()


def assert_rel_close(actual: nn.Module, expected: nn.Module, rtol: float = 1e-6, atol: float = 0., msg: str = '') -> None:
    """Every param of `actual` is within `rtol` of `expected`'s, relative to that tensor's own largest magnitude, or
    within the absolute floor `atol` where that is larger. `rtol=0, atol=0` is bit for bit.

    Why a floor at all: two correct implementations that order their float ops differently (torch's kernels, compiled
    chains) differ by the fp32 rounding of each *step* (~lr * 2**-24 per step, whatever the param's size), so a
    tensor that decays towards 0 under weight decay shows a large *relative* error made of nothing but rounding. The
    cases that need a floor say so, with the reason, in `cases.py`; no comparison uses the model's largest param."""
    named = list(actual.named_parameters())
    assert_tensors_close([a for _, a in named], list(expected.parameters()), rtol, atol, msg,
                         names=[f'param {n}' for n, _ in named])


def assert_tensors_close(actual: list, expected: list, rtol: float = 1e-6, atol: float = 0., msg: str = '',
                         names: list[str] | None = None) -> None:
    """`assert_rel_close` for lists of tensors (state entries, flat params, complex params), pair by pair."""
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert_tensor_close(a, b, f'{msg} {names[i] if names else f"tensor {i}"}', rtol, atol)


def assert_tensor_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = '', rtol: float = 1e-6,
                        atol: float = 0.) -> None:
    """`actual` of `expected`'s shape and within `rtol` of `expected`'s own largest magnitude, or within `atol`
    (compared in double precision, complex kept complex)."""
    wide = lambda t: t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
    a, b = wide(actual), wide(expected)
    assert a.shape == b.shape, f'{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}'
    err, scale = ((a - b).abs().max().item(), b.abs().max().item()) if b.numel() else (0., 0.)
    assert err <= max(rtol * scale, atol), f"{msg}: max abs diff {err:.3g} > max({rtol:g} * {scale:.3g}, {atol:g})"


def assert_same_params(actual: nn.Module, expected: nn.Module, msg: str = '') -> None:
    "Bit for bit the same params, param by param (named in the message)."
    for (n, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(a, b), f"{msg} param {n} differs"


def assert_moved(model: nn.Module, start: nn.Module, rtol: float = 1e-2) -> None:
    "Every param of `model` moved by more than `rtol` of its size at `start` (parity on params that never move proves nothing)."
    for (n, p), p0 in zip(model.named_parameters(), start.parameters(), strict=True):
        assert (p - p0).abs().max() > rtol * p0.abs().max(), f"param {n} barely moved: the comparison proves little"


# -- the engine's unit tests (tests/test_engine_*.py) ----------------------------------------------------------------
# the compiled chain through dynamo's `eager` backend: its Python, without code generation (a second or two each)
EAGER = cbopt.Backend('fused', compiler='eager', compile_chunk=4)


def sharded(mesh, t: torch.Tensor) -> torch.Tensor:
    "`t` as a DTensor sharded on dim 0 over `mesh` (`one_rank_mesh`: this process alone)."
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(t, mesh, [Shard(0)])


def count_calls(monkeypatch, kernel: str = '_fused_adamw_') -> list:
    "A list that gets one entry per call of torch's `kernel`: the call's keyword arguments (`grad_scale`, ...)."
    calls, real = [], getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


def params_and_grads(shapes: list, steps: int, seed: int = 0) -> tuple[list, list]:
    "Seeded params of `shapes`, and `steps` lists of grads for them."
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes], [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


# -- state tests (test_state_save, _load, _formats) ---------------------------------------------------------------------
def step_random(opt, steps, start=0):
    "`steps` steps of `opt` on seeded random grads (seeds `start`, `start+1`, ...)."
    for i in range(start, start + steps):
        random_grads(opt.params, i)
        opt.step()
    return opt


def trained_adam(seed=0, lr=0.01, dtype=torch.float32, steps=3):
    return step_random(cbopt.Adam(make_model(seed, dtype).named_parameters(), lr=lr, wd=0.1), steps, start=seed * 10)


def state_snapshot(opt):
    "Everything a load may change: each param's state (deep-copied) and the hypers, by name."
    return ({n: copy.deepcopy(dict(opt.state[p])) for n, p in opt.named_params().items() if p in opt.state},
            [dict(h) for h in opt.hypers])


def assert_same_snapshot(a, b):
    "Deep equality of snapshots, tensors compared exactly (dtype included)."
    (sa, ha), (sb, hb) = a, b
    assert ha == hb
    assert sa.keys() == sb.keys()
    for n in sa:
        assert sa[n].keys() == sb[n].keys(), n
        for k, v in sa[n].items():
            if torch.is_tensor(v): torch.testing.assert_close(v, sb[n][k], rtol=0, atol=0)
            else: assert v == sb[n][k], (n, k)


def assert_same_state(opt, ref):
    "Two optimizers over different params have equal state and params, param by param (by name)."
    assert_same_snapshot(state_snapshot(opt), state_snapshot(ref))
    for p, q in zip(opt.params, ref.params): torch.testing.assert_close(p, q, rtol=0, atol=0)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))  # 0.weight (2, 3), 0.bias, 1.weight (1, 2), 1.bias


def seeded_grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ps: p.grad = torch.randn(p.shape, generator=g)


def small_adam(steps: int = 2, groups: bool = False, **kw) -> cbopt.Optimizer:
    m = small_model()
    named = list(m.named_parameters())
    opt = cbopt.Adam([named[:2], named[2:]] if groups else named, lr=0.01, **kw)
    for i in range(steps):
        seeded_grads(opt.params, i)
        opt.step()
    return opt


def assert_load_rejected(opt, sd, exc, message: str) -> None:
    "Loading `sd` raises `exc` with exactly `message` and leaves `opt` as it was."
    before = state_snapshot(opt)
    with pytest.raises(exc) as e: opt.load_state_dict(sd)
    got = e.value.args[0] if exc is KeyError else str(e.value)
    assert got == message
    assert_same_snapshot(before, state_snapshot(opt))  # (nothing changed: state entries, values, dtypes, hypers)


MODEL_NAMES = ['0.weight', '0.bias', '2.weight', '2.bias']  # make_model's


ADAM_KEYS = {'grad_avg', 'sqr_avg', 'step'}


def equal_values(a, b) -> bool:
    "Equal values of the same types, tensors (torch.equal) and tuples included."
    if torch.is_tensor(a) or torch.is_tensor(b): return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict): return type(b) is dict and a.keys() == b.keys() and all(equal_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return type(a) is type(b) and len(a) == len(b) and all(map(equal_values, a, b))
    return type(a) is type(b) and a == b


def stepped_lbfgs(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict]:
    "An L-BFGS of 3 steps on a small regression: its history (`d`, `old_dirs`, `old_stps`, `prev_flat_grad`) filled."
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    xs = torch.randn(32, 4, dtype=dtype)
    opt = cbopt.LBFGS(net.named_parameters(), history_size=5)
    def closure():
        opt.zero_grad()
        loss = (net(xs) - xs.sum(1, keepdim=True).sin()).pow(2).mean()
        loss.backward()
        return loss
    for _ in range(3): opt.step(closure)
    return net, opt.state_dict()


def pytest_collection_modifyitems(config, items) -> None:
    """A registry case that a test cannot run (`cases.Case.gap`: a known gap, or a case that needs a closure) is
    reported skipped with its reason: never filtered out unseen."""
    from cases import Case
    for item in items:
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        for c in (v for v in params.values() if isinstance(v, Case)):
            reason = c.gap(item.originalname)
            if reason: item.add_marker(pytest.mark.skip(reason=f'{c.id}: {reason}'))
