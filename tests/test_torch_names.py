"""torch.optim's hyper names are aliases of fastai's in cbopt's own optimizers (keywords and group dicts), each with
the optimizer's own decoupling: a torch user's "no decay" group does not decay, as in torch."""
import pytest
import torch

import cbopt
from conftest import assert_rel_close, make_model, train


def _groups(model, named=True):
    "torch's usual split: decay the matrices, not the biases (torch's own names in the group dict)."
    ps = list(model.named_parameters())
    return [{'params': [p for n, p in ps if p.ndim == 2]}, {'params': [p for n, p in ps if p.ndim < 2], 'weight_decay': 0.}]


def test_no_decay_group_as_torch_adamw():
    "cbopt.Adam (decoupled) with torch's names in its keywords and group dicts steps as torch.optim.AdamW."
    m, ref = make_model(), make_model()
    opt = cbopt.Adam(_groups(m), lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.3)
    torch_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.3)
    assert [h['wd'] for h in opt.hypers] == [0.3, 0.]
    train(opt, m, 10)
    train(torch_opt, ref, 10)
    assert_rel_close(m, ref, rtol=1e-5)


@pytest.mark.parametrize('factory,torch_cls,torch_kw,extra', [
    (cbopt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True), dict(decouple_wd=False)),
    (cbopt.Adagrad, torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.1), {}),
    (cbopt.Adadelta, torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1), {}),
    (cbopt.NAdam, torch.optim.NAdam, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True), {}),
    (cbopt.Adamax, torch.optim.Adamax, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1), {}),
])
def test_torch_keywords(factory, torch_cls, torch_kw, extra):
    "Each optimizer takes torch's keywords for its hypers and steps as the torch class given the same ones."
    m, ref = make_model(), make_model()
    opt = factory(_groups(m), **torch_kw, **extra)
    torch_opt = torch_cls(_groups(ref), **torch_kw)
    train(opt, m, 10)
    train(torch_opt, ref, 10)
    assert_rel_close(m, ref, rtol=1e-5)


def test_rmsprop_alpha():
    "RMSProp's `alpha` is its `sqr_mom` (torch's smoothing constant); without momentum the formulas agree."
    m, ref = make_model(), make_model()
    train(cbopt.RMSProp(m.parameters(), lr=1e-2, alpha=0.9, decouple_wd=False, weight_decay=0.1), m, 10)
    train(torch.optim.RMSprop(ref.parameters(), lr=1e-2, alpha=0.9, weight_decay=0.1), ref, 10)
    assert_rel_close(m, ref, rtol=1e-5)


def test_given_twice_is_an_error_and_changes_nothing():
    m = make_model()
    with pytest.raises(ValueError, match=r"betas=\(0\.9, 0\.99\) and mom=0\.8 name one hyper"):
        cbopt.Adam(m.parameters(), mom=0.8, betas=(0.9, 0.99))
    opt = cbopt.Adam(m.parameters())
    before = [dict(h) for h in opt.hypers]
    with pytest.raises(ValueError, match=r"weight_decay=0\.1 \(group 0\) and wd=0\.2 name one hyper"):
        opt.add_param_group({'params': [torch.zeros(2, requires_grad=True)], 'wd': 0.2, 'weight_decay': 0.1})
    assert [dict(h) for h in opt.hypers] == before and len(opt.param_groups) == 1


def test_lion_takes_lion_pytorchs_names():
    "lion-pytorch's keywords (betas, weight_decay) give its numbers."
    from lion_pytorch import Lion
    m, ref = make_model(), make_model()
    train(cbopt.Lion(m.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1), m, 10)
    train(Lion(ref.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1), ref, 10)
    assert_rel_close(m, ref, rtol=1e-5)
