"""The README's Python examples run as written, in order, in one namespace (as a reader would paste them)."""
import re
from pathlib import Path

import torch

README = Path(__file__).parents[1] / 'README.md'


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    ns = {}
    for code in blocks: exec(compile(code, str(README), 'exec'), ns)
    opt = ns['opt']
    assert sorted(opt.state_dict()['state']) == ['0.bias', '0.weight', '2.bias', '2.weight']
    assert all(set(s) == {'grad_avg'} for s in opt.state_dict()['state'].values())
    assert isinstance(opt, torch.optim.Optimizer)
