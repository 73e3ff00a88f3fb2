"`python -m cbopt demo` runs end to end in a fresh process, prints its table and writes a real PNG."
import copy
import os
import subprocess
import sys

import pytest

from cbopt.cli import demo

EXPECTED = list(demo.optimizers())


def parse_table(out: str) -> dict[str, tuple[float, float, float]]:
    "optimizer name -> (first loss, final loss, steps/s), read from the printed table."
    rows = {}
    for line in out.splitlines():
        for name in EXPECTED:
            if line.startswith(name + ' '):
                rows[name] = tuple(float(v) for v in line[len(name):].split())
    return rows


@pytest.fixture(scope='module')
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('demo')
    env = {**os.environ, 'MPLBACKEND': 'Agg'}
    res = subprocess.run([sys.executable, '-m', 'cbopt', 'demo', '--out', str(out)], capture_output=True, text=True,
                         timeout=120, cwd=out, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout, out


def test_table_lists_every_optimizer(demo_run):
    rows = parse_table(demo_run[0])
    assert list(rows) == EXPECTED
    for name, (first, final, speed) in rows.items():
        assert speed > 0, name


def test_losses_decrease(demo_run):
    for name, (first, final, _) in parse_table(demo_run[0]).items():
        assert final < first / 5, f"{name}: loss went from {first} to {final} only"


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
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60)
