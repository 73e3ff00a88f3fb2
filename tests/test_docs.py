"""The documentation: the site builds with `mkdocs build --strict` (broken links and references fail); every public name
of `cbopt`, `cbopt.optim`, `cbopt.functional`, `cbopt.testing` and `cbopt.integrations.*` has a docstring and an entry in
the built API reference (as optax's coverage check); the generated parts of the pages are current; every Python block
of a page runs and prints what its comments say; the README stays short and free of commit hashes and timestamps; and a
real browser (Debian's chromium, headless) renders the navigation, the search, the API entries and a page's images.
Needs the docs extra (`pip install -e ".[docs]"`): skipped without mkdocs; the browser test without chromium."""
import functools
import http.server
import html as htmllib
import importlib
import inspect
import json
import pkgutil
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cbopt
import cbopt.integrations
from conftest import import_torchvision
from cbopt.cli import docs

pytest.importorskip('mkdocs')
pytest.importorskip('mkdocstrings_handlers.python')
pytest.importorskip('mkdocs_jupyter')
import_torchvision()  # (cbopt.integrations.lightning's LRFindRestore imports Lightning, which imports torchvision)

ROOT = Path(__file__).parents[1]
README = ROOT / 'README.md'
PAGES = sorted((ROOT / 'docs').rglob('*.md'))
API_MODULES = ['cbopt', 'cbopt.optim', 'cbopt.functional', 'cbopt.testing'] + \
    [f'cbopt.integrations.{m.name}' for m in pkgutil.iter_modules(cbopt.integrations.__path__)]


@pytest.fixture(scope='module')
def site(tmp_path_factory) -> Path:
    "The site built once for the module's tests, strictly: any warning (a broken link, a missing reference) fails."
    out = tmp_path_factory.mktemp('site')
    proc = subprocess.run([sys.executable, '-m', 'cbopt', 'docs', '--build', str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # the documented command (`python -m cbopt docs` builds, then serves)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def public_names(module: str) -> list[str]:
    "`__all__`, and the public names a module imports on first use (`cbopt.LAZY`: `cbopt.ZeroRedundancyOptimizer`)."
    mod = importlib.import_module(module)
    return list(mod.__all__) + list(getattr(mod, 'LAZY', ()))


@functools.lru_cache(maxsize=None)
def static_package():
    "cbopt as a static reader of its source (griffe, as mkdocstrings) sees it: where attribute docstrings live."
    import griffe
    return griffe.load('cbopt', resolve_aliases=True, resolve_external=False)


def has_own_docstring(module: str, name: str) -> bool:
    """A class or function: its own `__doc__`. A constant: the string literal right after its assignment in the module
    that defines it (an attribute docstring, which the API reference shows)."""
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
        return bool((obj.__doc__ or '').strip())
    member = static_package()[f'{module}.{name}'.removeprefix('cbopt.')]
    if member.is_alias: member = member.final_target
    return member.docstring is not None and bool(member.docstring.value.strip())


def test_site_builds_strictly(site):
    assert (site / 'index.html').is_file() and (site / 'api' / 'cbopt' / 'index.html').is_file()
    assert (site / 'search' / 'search_index.json').is_file()
    for nb in (ROOT / 'nbs').glob('*.ipynb'):  # every notebook rendered, with its stored outputs' plots
        html = (site / 'nbs' / nb.stem / 'index.html').read_text()
        plots = sum('image/png' in o.get('data', {}) for c in json.loads(nb.read_text())['cells'] for o in c.get('outputs', []))
        assert html.count('data:image/png;base64') >= plots, nb.name


@pytest.mark.parametrize('module', API_MODULES)
def test_every_public_name_has_a_docstring_and_an_api_entry(site, module):
    "optax's check: a public name without a docstring, or missing from the built reference, fails."
    html = ''.join(p.read_text() for p in (site / 'api').rglob('index.html'))
    entries = set(re.findall(r'id="(cbopt\.[\w.]+)"', html))
    names = public_names(module)
    assert names
    assert [n for n in names if not has_own_docstring(module, n)] == []
    assert module in entries or module == 'cbopt'

    def entered(name: str) -> bool:
        "Under `module.name`, or, for a name the module imports on first use, under the one that defines it."
        obj = getattr(importlib.import_module(module), name)
        return f'{module}.{name}' in entries or f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}" in entries
    assert sorted(f'{module}.{n}' for n in names if not entered(n)) == []


def docstring_examples() -> list[tuple[str, str]]:
    "(public name, Python block) for every fenced example in a public name's docstring."
    out = []
    for module in API_MODULES:
        for name in public_names(module):
            doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ''
            out += [(f'{module}.{name}', code) for code in re.findall(r"```python\n(.*?)```", doc, flags=re.S)]
    return out


@pytest.mark.parametrize('name,code', docstring_examples(), ids=lambda v: v if v.startswith('cbopt') else '')
def test_docstring_examples_run(name, code):
    "The usage examples in the docstrings (shown in the API reference) run and assert what they claim."
    exec(compile(code, name, 'exec'), {})


def test_generated_parts_are_current():
    "Every part between `<!-- generated: NAME -->` markers is what `python -m cbopt docs --update` makes now."
    stale = []
    for path in [README, *PAGES]:
        for name, body in docs.generated_parts(path.read_text()).items():
            if body != docs.GENERATED[name]().strip('\n'): stale.append(f'{path.relative_to(ROOT)}: {name}')
    assert stale == [], "run `python -m cbopt docs --update`"


@pytest.mark.parametrize('page', [p for p in PAGES if '```python' in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT / 'docs')))
def test_page_python_blocks_run(page, capsys):
    "Each page's Python blocks run in order in one namespace, and a `print(...)  # out` line prints what follows `#`."
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ns = {}
    for code in blocks: exec(compile(code, str(page), 'exec'), ns)
    expected = [line.split('  #', 1)[1].strip() for code in blocks for line in code.splitlines()
                if line.startswith('print(') and '  #' in line]
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(expected)
    for out, comment in zip(printed, expected):  # a comment may go on after the output (`[0.000109] 0: the 2nd ...`)
        assert comment.startswith(out), (out, comment)


def test_readme_is_short_and_has_no_log():
    "The README is read to the end: at most 300 lines, no commit hashes, timestamps or load averages (git keeps those)."
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    prose = re.sub(r"```.*?```", '', text, flags=re.S)
    assert re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", prose) == []  # commit hashes
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?::\d\d)? ?UTC\b|load average", prose) == []


def test_docs_pages_have_no_log():
    "The pages are reference, not a lab notebook: no commit hashes or timestamps (the mutation record excepted)."
    for page in PAGES:
        if page.name == 'mutation.md': continue
        prose = re.sub(r"```.*?```", '', page.read_text(), flags=re.S)
        assert re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", prose) == [], page.name
        assert re.findall(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?::\d\d)? ?UTC\b", prose) == [], page.name


CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')


@pytest.fixture
def served(site):
    "The built site over HTTP, as a user's browser gets it (search loads its index with fetch, which file:// refuses)."
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw): super().__init__(*a, directory=str(site), **kw)
        def log_message(self, *a): pass

        def do_GET(self):
            "`/__hold?s=N`: an empty script answered after N seconds, which holds the page's load event (below)."
            if not self.path.startswith('/__hold?s='): return super().do_GET()
            time.sleep(float(self.path.split('=', 1)[1]))
            self.send_response(200)
            self.send_header('Content-Type', 'text/javascript')
            self.end_headers()
            self.wfile.write(b'//')
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{server.server_address[1]}'
    server.shutdown()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_browser_renders_the_site(site, served):
    """chromium --headless --dump-dom of the index, one guide and the API page, served over HTTP: the DOM after the
    page's scripts ran has the navigation, the API entries, search results for a query (Material's `?q=`), and every
    image of a page loaded (naturalWidth > 0, written into the DOM by a probe added to a copy of the page)."""
    def dom(page: str, query: str = '', hold: float = 0) -> str:
        """The DOM once the page has loaded. `--dump-dom` dumps at the load event, and the search runs in a web worker
        that virtual time does not wait for, so a search page holds its load event for `hold` seconds with a script
        the server answers late."""
        src = site / page
        probed = src.with_name('probed.html')
        probe = (f'<script src="/__hold?s={hold}"></script>' if hold else '') + ("<script>window.addEventListener('load', () => { const imgs = [...document.images];"
                 " document.body.setAttribute('data-probe', JSON.stringify({images: imgs.length,"
                 " loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length})); });</script>")
        probed.write_text(src.read_text().replace('</body>', probe + '</body>'))
        url = f"{served}/{probed.relative_to(site).as_posix()}{query}"
        proc = subprocess.run([CHROMIUM, '--headless', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
                               '--virtual-time-budget=5000', '--dump-dom', url],
                              capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    def probe(html: str) -> dict:
        m = re.search(r'data-probe="([^"]*)"', html)
        assert m, 'the page did not finish loading'
        return json.loads(htmllib.unescape(m[1]))

    index = dom('index.html', '?q=checkpoint', hold=5)
    assert 'md-nav' in index and 'Getting started' in index and 'API reference' in index  # the navigation
    assert 'md-search-result__item' in index and 'Checkpoints' in index  # the search ran and found the guide
    seen = probe(index)
    assert seen['images'] >= 1 and seen['loaded'] == seen['images']  # the demo's plot, shown
    guide = dom('guides/schedules/index.html')
    assert 'Per-step records' in guide and 'md-nav' in guide
    seen = probe(guide)
    assert seen['images'] >= 1 and seen['loaded'] == seen['images']
    api = dom('api/cbopt/index.html')
    for name in ('cbopt.Optimizer', 'cbopt.Adam', 'cbopt.weight_decay', 'cbopt.GradientClippingOptimizer'):
        assert f'id="{name}"' in api, name
    assert 'doc-signature' in api  # mkdocstrings' entries, rendered with their signatures
