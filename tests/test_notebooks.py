"""Every notebook in nbs/ runs top to bottom in a fresh kernel. The notebooks assert their own claims (cbopt vs
torch.optim and fastai, resumed vs uninterrupted runs), so a run without error is a real check."""
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parent.parent
NBS = sorted((ROOT / 'nbs').glob('*.ipynb'))


def test_all_notebooks_present():
    names = {nb.stem for nb in NBS}
    assert {'00_quick_tour', '01_build_your_own', '02_hypers_and_schedules', '03_fastai', '04_checkpoints',
            '05_whole_model', '06_catalogue', '07_functional', '08_low_bit_state'} <= names


@pytest.mark.parametrize('path', NBS, ids=[nb.stem for nb in NBS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv('MPLBACKEND', 'Agg')   # no display; the kernel inherits this environment
    monkeypatch.setenv('OMP_NUM_THREADS', '1')  # tiny models: one thread is fastest on shared cores
    # the kernel imports this checkout's cbopt, as the tests do (not another one installed in the environment)
    monkeypatch.setenv('PYTHONPATH', os.pathsep.join([str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])]))
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    # cwd is a tmp dir, so nothing is written next to the notebooks (their docs/*.png are only saved from nbs/)
    client = NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == 'code' for o in c.get('outputs', []) if o.output_type == 'error']
    assert not errors
