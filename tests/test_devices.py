"""cbopt on every device this machine has (issue #28): the `device` fixture runs each test on the CPU and on CUDA where
a GPU exists (CUDA cases are skipped with the reason elsewhere; `tools/gpu_check.sh` runs them on a GPU). The CPU
variant of a test the CPU suite already runs elsewhere is skipped, naming that test; the cheap ones run on both.
Without a GPU, `test_fake_cuda.py` checks syncs and devices on fake CUDA tensors."""
import copy
import io

import pytest
import torch

import cbopt
from cases import BY_ID, CASES
from conftest import assert_rel_close, batch_loss, make_model, set_grads, train, two_groups

STEPS = 20
BACKENDS = ('loop', 'foreach', 'auto', 'fused')


def on(device, model):
    "`model` moved to `device` (a copy: the CPU model stays the reference)."
    return copy.deepcopy(model).to(device)


def cpu_only_elsewhere(device, where: str):
    if device.type == 'cpu': pytest.skip(f"on the CPU: {where} checks it")


def _fused_too(c) -> bool:
    "The cases whose fused backend a GPU run checks: torch's kernel, or a chain the CPU suite compiles (time-boxed)."
    return c.has_torch_kernel or bool(c.compiles)


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('c', [c for c in CASES if not c.needs_closure], ids=str)
def test_every_backend_follows_the_cpu_loop(c, backend, device):
    "Every case in every backend on the device: within 1e-5 of the CPU loop backend over 20 steps (fp32; Muon 1e-2)."
    cpu_only_elsewhere(device, 'tests/test_backends.py')
    if backend == 'fused' and not _fused_too(c): pytest.skip("fused: the kernel cases and the compiled selection only")
    ref = make_model()
    ref_opt = c.build(two_groups(ref), 3e-2, 'loop')
    m = on(device, make_model())
    opt = c.build(two_groups(m), 3e-2, backend)
    for i in range(STEPS):
        train(ref_opt, ref, 1, start=i)
        train(opt, m, 1, start=i)
    # Muon's Newton-Schulz iteration runs its matmuls in bfloat16, which a GPU rounds otherwise than the CPU (an H200
    # run measured 3e-3 of the largest weight): a bf16 tolerance for it, 1e-5 for every other case
    tol = dict(rtol=1e-2, atol=1e-5) if c.id.startswith('muon') else dict(rtol=1e-5, atol=1e-7)
    assert_rel_close(m.cpu(), ref, **tol, msg=f"{c} {backend} on {device}:")


@pytest.mark.parametrize('cid', ['adam', 'sgd-mom', 'lion-prebuilt', 'adam-kahan'])
@pytest.mark.parametrize('backend', ['foreach', 'auto'])
def test_bf16_follows_fp32(cid, backend, device):
    """bf16 params on the device (torch's fused kernel where `auto` takes it: on CUDA it takes 16-bit params) stay
    within bf16 tolerance of the fp32 CPU loop over 10 steps."""
    c = BY_ID[cid]
    ref = make_model()
    ref_opt = c.build(two_groups(ref), 1e-2, 'loop')
    m = on(device, make_model()).to(torch.bfloat16)
    opt = c.build(two_groups(m), 1e-2, backend)
    for i in range(10):
        train(ref_opt, ref, 1, start=i)
        train(opt, m, 1, start=i)
    assert_rel_close(m.float().cpu(), ref, rtol=3e-2, atol=2e-3, msg=f"{cid} {backend} bf16 on {device}:")


def test_checkpoint_read_on_the_cpu_resumes_on_the_device(device):
    """A checkpoint saved on the device, read with `map_location='cpu'` and loaded into a fresh optimizer there (L-BFGS's
    history and a tensor lr too), steps on exactly as the original does."""
    m, twin = on(device, make_model()), on(device, make_model())
    opt = cbopt.Adam(m.named_parameters(), lr=torch.tensor(1e-2, device=device), wd=0.1)
    train(opt, m, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin.load_state_dict(m.state_dict())
    other = cbopt.Adam(twin.named_parameters(), lr=torch.tensor(0.5, device=device), wd=0.1)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), map_location='cpu', weights_only=True))
    assert {t.device for st in other.state.values() for t in st.values() if torch.is_tensor(t)} == {m[0].weight.device}
    assert other.param_groups[0]['lr'].device == m[0].weight.device
    train(opt, m, 3, start=3), train(other, twin, 3, start=3)
    assert_rel_close(twin, m, rtol=0, atol=0)


def test_lbfgs_checkpoint_read_on_the_cpu_resumes_on_the_device(device):
    "L-BFGS's whole-model history, read with `map_location='cpu'`, steps on the device as the original does."
    m, twin = on(device, make_model()), on(device, make_model())
    def closure_of(opt, model, i):
        def closure():
            opt.zero_grad()
            set_grads(model, i)
            return batch_loss(model, i).detach()
        return closure
    opt = cbopt.LBFGS(m.named_parameters(), lr=0.5, history_size=4)
    for i in range(3): opt.step(closure_of(opt, m, i))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    twin.load_state_dict(m.state_dict())
    other = cbopt.LBFGS(twin.named_parameters(), lr=0.5, history_size=4)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), map_location='cpu', weights_only=True))
    for i in range(3, 5): opt.step(closure_of(opt, m, i)), other.step(closure_of(other, twin, i))
    assert_rel_close(twin, m, rtol=0, atol=0)


@pytest.mark.parametrize('backend', ['auto', 'fused'])
def test_grad_scaler_follows_torch(backend, device):
    """Under `torch.amp.GradScaler`, with an inf grad at one step, cbopt's Adam steps as torch's fused AdamW does under
    its own scaler (`fused`: GradScaler's flag handed to torch's kernel, on a GPU never read on the host)."""
    m, ref = on(device, make_model()), on(device, make_model())
    opt = cbopt.Adam(m.parameters(), lr=1e-2, mom=0.9, sqr_mom=0.99, eps=1e-8, wd=0.1, backend=backend)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    for model, o in ((m, opt), (ref, ref_opt)):
        scaler = torch.amp.GradScaler(device.type, init_scale=2. ** 10)
        for i in range(6):
            o.zero_grad()
            scaler.scale(batch_loss(model, i)).backward()
            if i == 3: model[2].bias.grad[0] = float('inf')
            scaler.step(o)
            scaler.update()
    assert_rel_close(m, ref, rtol=1e-5, atol=1e-7)
    sd, theirs = opt.state_dict()['state'], ref_opt.state_dict()['state']
    assert [s['step'] for s in sd.values()] == [int(s['step']) for s in theirs.values()]  # (the inf step not counted)


def test_in_backward_steps_as_after_backward(device):
    "InBackward on the device: each param steps in its hook, as the same optimizer stepping after backward does."
    m, ref = on(device, make_model()), on(device, make_model())
    opt, ref_opt = cbopt.InBackward(cbopt.Adam(m.named_parameters(), lr=1e-2)), cbopt.Adam(ref.named_parameters(), lr=1e-2)
    for i in range(5):
        batch_loss(m, i).backward()
        opt.step()
        train(ref_opt, ref, 1, start=i)
    assert_rel_close(m, ref, rtol=1e-6, atol=1e-8)


def test_functional_update_is_the_step(device):
    "`cbopt.functional(cbopt.Adam)`'s update on the device gives the optimizer's step."
    m, ref = on(device, make_model()), on(device, make_model())
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2, wd=0.1)
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = fopt.init(params)
    ref_opt = cbopt.Adam(ref.named_parameters(), lr=1e-2, wd=0.1)
    for i in range(3):
        set_grads(m, i)
        params, state = fopt.update(params, {n: p.grad for n, p in m.named_parameters()}, state)
        with torch.no_grad():
            for n, p in m.named_parameters(): p.copy_(params[n])
        train(ref_opt, ref, 1, start=i)
    assert_rel_close(m, ref, rtol=1e-6, atol=1e-8)


def test_compiled_step_follows_eager(device):
    "torch's compiled-optimizer recipe (`torch.compile(opt.step)`) on the device: the eager step's numbers."
    cpu_only_elsewhere(device, 'tests/test_engine_traced.py')
    m, ref = on(device, make_model()), on(device, make_model())
    opt, ref_opt = (cbopt.Adam(x.named_parameters(), lr=1e-2, wd=0.1, backend='foreach') for x in (m, ref))
    step = torch.compile(lambda: opt.step())
    for i in range(4):
        set_grads(m, i)
        step()
        train(ref_opt, ref, 1, start=i)
    assert_rel_close(m, ref, rtol=1e-5, atol=1e-7)
    a, b = on(device, make_model()), on(device, make_model())  # and the fused backend's compiled chain (Lion: no kernel)
    fused, eager = cbopt.Lion(a.named_parameters(), lr=1e-3, backend='fused'), cbopt.Lion(b.named_parameters(), lr=1e-3)
    train(fused, a, 3), train(eager, b, 3)
    assert_rel_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('c', [c for c in CASES if not c.needs_closure], ids=str)
def test_default_step_makes_no_sync(c, device):
    """On a GPU, the default backend's steady step makes no host-device sync (`torch.cuda.set_sync_debug_mode('error')`
    raises at one): the fake-CUDA check of `test_fake_cuda.py`, on the real device."""
    cpu_only_elsewhere(device, 'tests/test_fake_cuda.py (fake CUDA tensors)')
    m = on(device, make_model())
    opt = c.build(two_groups(m), 1e-3)
    train(opt, m, 2)
    set_grads(m, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try: opt.step()
    finally: torch.cuda.set_sync_debug_mode(0)
