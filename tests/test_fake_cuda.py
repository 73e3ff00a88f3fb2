"""cbopt on CUDA, checked without a GPU (issue #28): every prebuilt optimizer's default step over fake CUDA tensors
(`tests/fake_cuda.py`) makes no host-device sync, keeps its state on the params' device, and loads a checkpoint read
with `map_location='cpu'` back onto it; 16-bit buckets take one kernel call per op, not one per param. What a real GPU
run checks besides (numbers, speed): `tools/gpu_check.sh`."""
import pytest
import torch

import cbopt
from cases import CASES
from conftest import stepped_lbfgs
from fake_cuda import cuda_params, fake_cuda, off_device, on_host, set_grads

STEPS = 3


def steps(opt, params, log, n=STEPS, scaler=False):
    "`n` steps; the syncs and ops of the last one (the steady state: the first creates the state)."
    for i in range(n):
        opt.zero_grad()
        set_grads(params)
        if scaler: opt.grad_scale, opt.found_inf = torch.full((), 1024., device='cuda'), torch.zeros((), device='cuda')
        log.clear()
        log.on = i == n - 1
        opt.step()
        log.on = False
        if scaler: del opt.grad_scale, opt.found_inf
    return dict(log.syncs), dict(log.where)


STEPPABLE = [c for c in CASES if not c.needs_closure]


@pytest.mark.parametrize('case', STEPPABLE, ids=str)
def test_default_step_has_no_sync_and_state_stays_on_device(case):
    """The default backend's step: no host-device sync once the state exists; every state tensor on the params'
    device; a checkpoint moved to the CPU loads back onto it, and the loaded optimizer steps there."""
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        opt = case.build(ps, 1e-3)
        syncs, where = steps(opt, ps, log)
        assert not syncs, f"{case}: {syncs} at {where}"
        assert not off_device(opt)
        fresh = case.build(ps, 1e-3)
        fresh.load_state_dict(on_host(opt.state_dict()))
        assert not off_device(fresh)
        syncs, where = steps(fresh, ps, log, n=1)
        assert not syncs, f"{case} after a load: {syncs} at {where}"


def test_lbfgs_history_loaded_from_cpu_steps_on_cuda():
    "L-BFGS's history from a `map_location='cpu'` checkpoint lands on the CUDA params' device (its next step's math)."
    net, sd = stepped_lbfgs()
    with fake_cuda():
        ps = [(n, torch.nn.Parameter(torch.empty(p.shape, device='cuda'))) for n, p in net.named_parameters()]
        gpu = cbopt.LBFGS(ps, history_size=5)
        gpu.load_state_dict(sd)
        assert not off_device(gpu)
        flat = torch.cat([torch.ones_like(p).reshape(-1) for _, p in ps])
        flat.sub(gpu.param_groups[0]['lbfgs.prev_flat_grad']).dot(gpu.param_groups[0]['lbfgs.d'])


@pytest.mark.parametrize('make', [lambda ps: cbopt.Adam(ps, 1e-3), lambda ps: cbopt.Adam(ps, 1e-3, decouple_wd=False),
                                  lambda ps: cbopt.Adagrad(ps, 1e-2), lambda ps: cbopt.optim.AdamW(ps, fused=True)],
                         ids=['adamw', 'adam-l2', 'adagrad', 'optim.AdamW-fused'])
def test_kernel_step_count_is_float32_on_device(make):
    """torch's kernels get the step count as a float32 0-d tensor on the params' device, made without a host-to-device
    copy and counted in place (not one per step), whatever the default dtype (CUDA's kernels read it as float32)."""
    torch.set_default_dtype(torch.float64)
    try:
        with fake_cuda() as (log, kernels):
            ps = cuda_params(torch.float32)
            opt = make(ps)
            syncs, where = steps(opt, ps, log, n=4)
            assert not syncs, where
            assert sum(kernels.calls.values()) == 3  # (the first step runs the chain, which makes the state; the
            # stand-in checked the count's dtype and device at each call)
            assert log.ops.get('aten.add_.Tensor', 0) + log.ops.get('aten.add_.Scalar', 0) == 1  # counted in place
    finally: torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize('name,backend', [('Adam', 'foreach'), ('Lion', 'foreach'), ('Adam', 'auto'), ('SGD', 'auto')])
def test_bf16_bucket_is_one_call_per_op(name, backend):
    """A bf16 bucket on CUDA costs the ops of an fp32 one: one foreach call per op (the per-param multiply is a CPU
    numerics rule), and torch's fused kernel where one computes the chain (its CUDA kernels take 16-bit params)."""
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        with fake_cuda() as (log, kernels):
            ps = cuda_params(dtype, [(f'{i}', (8, 4)) for i in range(50)])
            opt = getattr(cbopt, name)(ps, lr=1e-3, mom=0.9, wd=0.01, backend=backend)
            steps(opt, ps, log)
            counts[dtype] = (sum(log.ops.values()), dict(kernels.calls))
    assert counts[torch.bfloat16] == counts[torch.float32] and counts[torch.float32][0] < 20, counts


@pytest.mark.parametrize('make', [lambda ps: cbopt.Adam(ps, 1e-3), lambda ps: cbopt.Lion(ps, 1e-4)], ids=['adam', 'lion'])
def test_state_dict_holds_no_second_device_copy(make):
    "state_dict() snapshots CUDA state into host memory: no second copy on the GPU while the dict lives."
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        opt = make(ps)
        steps(opt, ps, log, n=1)
        sd = opt.state_dict()
        devices = {t.device.type for st in sd['state'].values() for t in st.values() if isinstance(t, torch.Tensor)}
        assert devices == {'cpu'}


@pytest.mark.parametrize('make', [lambda ps: cbopt.Adam(ps, 1e-3), lambda ps: cbopt.Lion(ps, 1e-4, wd=0.1),
                                  lambda ps: cbopt.SGD(ps, 1e-2, mom=0.9)], ids=['adam', 'lion', 'sgd-mom'])
def test_in_backward_step_has_no_sync(make):
    "InBackward's hook (each param alone, torch's kernel where the backend would use it) makes no host-device sync."
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        opt = cbopt.InBackward(make(ps))
        for i in range(STEPS):
            set_grads(ps)
            log.clear()
            log.on = i == STEPS - 1
            for _, p in reversed(ps): opt._step_in_backward(p)  # (what backward's post-accumulate-grad hooks call)
            log.on = False
            assert all(p.grad is None for _, p in ps)
        assert not log.syncs, dict(log.where)
        assert not off_device(opt)


@pytest.mark.parametrize('in_place', [False, True])
def test_clipped_kernel_step_is_one_call_per_bucket(in_place):
    """Clipping by the global norm before torch's kernel: on CUDA one kernel call per bucket, out of place too (one
    scaled copy of the bucket's grads: the CPU's cache-sized runs would be a launch each), and no sync."""
    with fake_cuda() as (log, kernels):
        ps = cuda_params(shapes=[(f'{i}', (300, 1000)) for i in range(8)])  # 2.4M elements: several CPU runs
        opt = cbopt.GradientClippingOptimizer(cbopt.Adam(ps, 1e-3), cbopt.GradientClipping.NORM, max_gradient=0.01,
                                              in_place=in_place)
        syncs, where = steps(opt, ps, log)
        assert not syncs, where
        assert log.ops['aten._fused_adamw_.default'] == 1
        assert log.ops.get('aten._foreach_mul.Tensor', 0) + log.ops.get('aten._foreach_mul.List', 0) == (not in_place)


def test_capturable_on_cuda_is_refused_not_ignored(monkeypatch):
    """`capturable=True` over CUDA params is refused (cbopt's counts are Python numbers: a CUDA graph's replay would
    reuse them), in the constructor and in a group added later, which is then not added; so is a step under capture."""
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        with pytest.raises(ValueError, match=r"capturable=True.*cuda"):
            cbopt.optim.Adam([p for _, p in ps], capturable=True)
        opt = cbopt.optim.Adam([p for _, p in ps[:2]])
        with pytest.raises(ValueError, match=r"param group 1"):
            opt.add_param_group({'params': [p for _, p in ps[2:]], 'capturable': True})
        assert len(opt.param_groups) == 1
        cpu = cbopt.optim.Adam([torch.nn.Parameter(torch.zeros(2, device='cpu'))], capturable=True)  # (changes nothing)
        set_grads(ps[:2])
        monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
        monkeypatch.setattr(torch.cuda, 'is_current_stream_capturing', lambda: True)
        with pytest.raises(RuntimeError, match='CUDA graph'): opt.step()
        assert not opt.state and cpu.param_groups[0]['capturable']


KERNEL_CASES = [c for c in STEPPABLE if c.has_torch_kernel and not c.splits_groups]  # (Muon's matrices: a chain)


@pytest.mark.parametrize('case', KERNEL_CASES, ids=str)
def test_grad_scaler_step_on_torch_kernels_has_no_sync(case):
    """Under GradScaler (its `grad_scale` and `found_inf` on the optimizer, as `scaler.step` sets them), a steady step
    whose buckets all take torch's kernel passes `found_inf` to the kernel and never reads it on the host: no sync, and
    the step counts are then float32 tensors on the device. A checkpoint reads them as numbers."""
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        opt = case.build(ps, 1e-3)
        syncs, where = steps(opt, ps, log, scaler=True)
        assert not syncs, f"{case}: {syncs} at {where}"
        assert sum(kernels.calls.values()) >= 1
        counts = [st['step'] for st in opt.state.values() if 'step' in st]
        assert all(isinstance(t, torch.Tensor) and t.device.type == 'cuda' and t.dtype == torch.float32 for t in counts)
        assert all(type(st['step']) is int for st in opt.state_dict()['state'].values() if 'step' in st)


def test_grad_scaler_with_a_chain_reads_found_inf_once():
    "Under GradScaler, a chain without a torch kernel (Lion) reads `found_inf` once per step, as torch's GradScaler does."
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        opt = cbopt.Lion(ps, 1e-4)
        syncs, where = steps(opt, ps, log, scaler=True)
        assert syncs == {'D2H .item()/bool()': 1}, where


@pytest.mark.parametrize('make', [lambda ps, lr: cbopt.Adam(ps, lr), lambda ps, lr: cbopt.Adam(ps, lr, backend='foreach'),
                                  lambda ps, lr: cbopt.SGD(ps, lr, mom=0.9, backend='foreach'),
                                  lambda ps, lr: cbopt.SGD(ps, lr, mom=0.9, wd=0.01, decouple_wd=False)],
                         ids=['adam', 'adam-foreach', 'sgd-foreach', 'sgd-l2'])
def test_tensor_lr_on_the_device_is_never_read(make):
    """A tensor lr on the params' device goes to torch's kernels and into foreach ops as a tensor (an `alpha` as one
    `addcmul`), and the step's DCP check (an lr of 0) does not read it: no sync. (Reads answer 1 here: the
    constructor checks the lr, once.)"""
    with fake_cuda(value=1) as (log, kernels):
        ps = cuda_params()
        opt = make(ps, torch.tensor(1e-3, device='cuda'))
        syncs, where = steps(opt, ps, log)
        assert not syncs, where


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_compiled_chain_on_cuda_asks_for_combo_kernels_and_runs_float64_state_foreach(monkeypatch):
    """The fused backend on a GPU: the compiled chain asks inductor for combo kernels (one kernel for a call's params,
    `cbopt._torch.GPU_INDUCTOR_OPTIONS`; the CPU's options do not have them), and a chain keeping 0-d float64 state
    (schedule-free AdamW, which a GPU run found the compiled chain computes wrongly) runs foreach, warning once.
    (torch.compile recorded and the chain run as it is: fake tensors do not compile.)"""
    from cbopt.engine import compiled
    seen = []
    def compile_(fn, backend, fullgraph, options):
        seen.append(options)
        return fn
    monkeypatch.setattr(torch, 'compile', compile_)
    monkeypatch.setattr(compiled, '_COMPILED', {})
    with fake_cuda() as (log, kernels):
        ps = cuda_params()
        steps(cbopt.Lion(ps, 1e-3, backend='fused'), ps, log)
        assert seen and all(o['combo_kernels'] is True for o in seen)
        seen.clear()
        with pytest.warns(UserWarning, match='0-d float64 state on a GPU') as w:
            steps(cbopt.ScheduleFreeAdamW(ps, 1e-3, backend='fused').train(), ps, log)
        assert not seen and len([x for x in w if '0-d float64' in str(x.message)]) == 1
    cpu = [torch.nn.Parameter(torch.ones(3))]
    opt = cbopt.Lion(cpu, 1e-3, backend='fused')
    for _ in range(2):
        cpu[0].grad = torch.ones(3)
        opt.step()
    assert seen and 'combo_kernels' not in seen[-1]
