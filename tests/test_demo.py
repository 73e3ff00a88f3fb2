"""`python -m cbopt demo` runs end to end in a fresh process and prints the table of docs/getting-started.md (rows and
losses as the page shows them), writes a real PNG; its flags (`--out`, `--steps`, `--seed`) do what the docs say. No speed is
checked: steps/s depends on the machine and its load."""
import copy
import os
import subprocess
import sys

import pytest

from cbopt.cli import demo

pytestmark = pytest.mark.usefixtures('one_thread')  # in-process training on tiny tensors: one thread, no OpenMP spin

# The table of docs/getting-started.md (python -m cbopt demo, defaults: 400 steps, seed 0): optimizer -> (first loss, final loss)
README_TABLE = {
    'listed: wd+avg_grad+momentum': (0.6573, 0.0201),
    'listed: centralize+Adam':      (0.6573, 0.0083),
    'SGD':                          (0.6573, 0.0201),
    'Adam':                         (0.6573, 0.0107),
    'RAdam':                        (0.6573, 0.0137),
    'Lamb':                         (0.6573, 0.0149),
    'ranger':                       (0.6573, 0.0189),
}


def parse_table(out: str) -> dict[str, tuple[float, float]]:
    "optimizer name -> (first loss, final loss), read from the printed table (the rows after the dashed rule)."
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith('-----'))
    rows = {}
    for line in lines[rule + 1:]:
        if not line.strip(): break
        name, first, final, _speed = line.rsplit(maxsplit=3)
        rows[name.strip()] = (float(first), float(final))
    return rows


@pytest.fixture(scope='module')
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('demo')
    env = {**os.environ, 'MPLBACKEND': 'Agg'}
    res = subprocess.run([sys.executable, '-m', 'cbopt', 'demo', '--out', str(out)], capture_output=True, text=True,
                         timeout=600, cwd=out, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout, out


def test_table_is_the_readmes(demo_run):
    """The page's rows in its order, every row from the same start (first loss 0.6573), the callback-listed SGD
    with the same numbers as cbopt.SGD, and the final losses as the page prints them (to 5e-4: another CPU's
    rounding may move the 4th decimal after 400 steps)."""
    rows = parse_table(demo_run[0])
    assert list(rows) == list(README_TABLE)
    assert rows['listed: wd+avg_grad+momentum'] == rows['SGD']
    for name, (first, final) in rows.items():
        assert first == README_TABLE[name][0], name
        assert final == pytest.approx(README_TABLE[name][1], abs=5e-4), name


def test_losses_decrease(demo_run):
    for name, (first, final) in parse_table(demo_run[0]).items():
        assert final < first / 5, f"{name}: loss went from {first} to {final} only"


def test_flags(tmp_path, capsys):
    "`--out` is where losses.png goes, `--steps` the number of steps each optimizer takes, `--seed` the data and model."
    curves = demo.main(['--out', str(tmp_path / 'a'), '--steps', '30'])
    assert (tmp_path / 'a' / 'losses.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert list(curves) == list(README_TABLE) and all(len(c) == 30 for c in curves.values())
    assert all(c[0] == pytest.approx(0.6573, abs=5e-5) for c in curves.values())  # seed 0: the page's start
    rows = parse_table(capsys.readouterr().out)
    assert all(rows[n][1] > README_TABLE[n][1] for n in rows)  # 30 steps train less far than 400
    other = demo.main(['--out', str(tmp_path / 'b'), '--steps', '5', '--seed', '1'])
    firsts = {c[0] for c in other.values()}
    assert len(firsts) == 1 and abs(firsts.pop() - 0.6573) > 1e-3  # another seed: another start, shared by every row
    assert (tmp_path / 'b' / 'losses.png').exists()


def test_png_written(demo_run):
    png = demo_run[1] / 'losses.png'
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    from matplotlib.image import imread
    h, w = imread(png).shape[:2]
    assert h > 100 and w > 100


def test_listed_optimizers_match_fastai():
    "The demo's callback-listed rows follow fastai's SGD (same callbacks) and Adam (plus centralisation) curves."
    from fastai.optimizer import SGD, Adam
    x, y = demo.make_data(n=256)
    model, opts = demo.make_model(), demo.optimizers()
    ours, _ = demo.train(opts['listed: wd+avg_grad+momentum'], copy.deepcopy(model), x, y, steps=50)
    ref, _ = demo.train(lambda ps: SGD([p for _, p in ps], lr=0.02, mom=0.9, wd=1e-4), copy.deepcopy(model), x, y, steps=50)
    assert ours == pytest.approx(ref, rel=1e-5)
    ours, _ = demo.train(opts['listed: centralize+Adam'], copy.deepcopy(model), x, y, steps=50)
    gc_adam = lambda ps: _with_first_cb(Adam([p for _, p in ps], lr=3e-3, wd=0.01), demo.centralize_grad)
    ref, _ = demo.train(gc_adam, copy.deepcopy(model), x, y, steps=50)
    assert ours == pytest.approx(ref, rel=1e-4)
    plain, _ = demo.train(lambda ps: Adam([p for _, p in ps], lr=3e-3, wd=0.01), copy.deepcopy(model), x, y, steps=50)
    assert ours != pytest.approx(plain, rel=1e-4)  # centralisation really changes the run


def _with_first_cb(opt, cb):
    "A fastai Optimizer with `cb` run before its own callbacks."
    opt.cbs.insert(0, cb)
    return opt


def test_import_cbopt_does_not_need_matplotlib():
    code = "import sys, cbopt, cbopt.cli.demo; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, '-c', code], check=True, timeout=600)  # importing torch alone can take a minute on a loaded machine
