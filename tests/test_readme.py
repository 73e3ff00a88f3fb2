"""The README's Python examples run as written, in order, in one namespace (as a reader would paste them), and print
what their comments say; its other claims that no other test file owns: fastai's names, hyper names and defaults, and
the files and pages it names. (Its length and the docs pages' examples: tests/test_docs.py.)"""
import inspect
import re
from pathlib import Path

import fastai.optimizer as fo
import pytest
import torch

import cbopt

ROOT = Path(__file__).parents[1]
README = ROOT / 'README.md'


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 3  # a prebuilt optimizer, a chain with a callback of your own, cbopt.optim as a drop-in
    ns = {}
    for code in blocks: exec(compile(code, str(README), 'exec'), ns)
    # every `print(...)   # expected` line printed what its comment says
    expected = [line.split('#', 1)[1].strip() for code in blocks for line in code.splitlines()
                if line.startswith('print(') and '#' in line]
    assert capsys.readouterr().out.splitlines() == expected
    opt = ns['opt']  # the listed chain with the user's Lion callbacks
    assert sorted(opt.named_state_dict()['state']) == ['0.bias', '0.weight', '2.bias', '2.weight']
    assert all(set(s) == {'grad_avg'} for s in opt.named_state_dict()['state'].values())
    assert isinstance(opt, torch.optim.Optimizer)
    assert ns['sched'].optimizer is not opt and ns['sched'].last_epoch == 3  # the scheduler stepped the prebuilt Adam
    assert isinstance(ns['adamw'], cbopt.optim.AdamW) and isinstance(ns['adamw'], cbopt.Optimizer)


@pytest.mark.parametrize('name', ['SGD', 'RMSProp', 'Adam', 'RAdam', 'QHAdam', 'Larc', 'Lamb', 'Lookahead', 'ranger'])
def test_prebuilt_have_fastais_names_hypers_and_defaults(name):
    """'Every prebuilt optimizer has fastai's name, hyper names and defaults ... so a fastai user switches by changing
    an import': each takes every keyword fastai's takes, and gives the same hypers with and without them."""
    ps = lambda: [torch.zeros(3, requires_grad=True)]
    make = (lambda m, **kw: m.Lookahead(m.Adam(ps(), 0.1), **kw)) if name == 'Lookahead' else \
        (lambda m, **kw: getattr(m, name)(ps(), 0.1, **kw))
    theirs = make(fo)
    fastai_defaults = {k: p.default for k, p in inspect.signature(getattr(fo, name)).parameters.items()
                       if p.default is not inspect.Parameter.empty}
    for ours in (make(cbopt), make(cbopt, **fastai_defaults)):
        assert {k: ours.hypers[0][k] for k in theirs.hypers[0]} == dict(theirs.hypers[0])
        if name in ('Lookahead', 'ranger'):  # fastai keeps them on the wrapper, cbopt as hypers
            assert (ours.hypers[0]['k'], ours.hypers[0]['alpha']) == (theirs.k, theirs.alpha)


def test_files_the_readme_names_exist():
    "Every `cbopt/...py` path the README names is a file of the package."
    named = set(re.findall(r"`(cbopt/[\w/]+\.py)`", README.read_text()))
    assert named and sorted(p for p in named if not (ROOT / p).is_file()) == []


def test_pages_the_readme_links_exist():
    "Every relative link of the README (to the docs pages, their sections and the plots) is a file of the repository."
    links = re.findall(r"\]\(((?:docs|nbs)/[^)#\s]+)(?:#[\w-]+)?\)", README.read_text())
    assert links and sorted(p for p in set(links) if not (ROOT / p).is_file()) == []
