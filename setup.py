"""Packaging from settings.ini, as the fastai packages do (the nbdev-style keys are the single source of metadata)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read(Path(__file__).parent / 'settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']
for k in 'version description keywords author author_email license min_python lib_name user'.split():
    assert k in cfg, f"settings.ini is missing {k}"

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()
lic = licenses.get(cfg['license'].lower(), (cfg['license'], None))
min_python = cfg['min_python']
requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
docs_requirements = cfg.get('docs_requirements', '').split()
scripts = [s for s in cfg.get('console_scripts', '').split() if s]

setuptools.setup(
    name=cfg['lib_name'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]]
                + (['License :: ' + lic[1]] if lic[1] else []),
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['cbopt', 'cbopt.*']),
    include_package_data=True,
    install_requires=requirements,
    extras_require={'dev': dev_requirements, 'docs': docs_requirements},
    python_requires='>=' + min_python,
    long_description=(Path(__file__).parent / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': scripts},
    version=cfg['version'], description=cfg['description'], keywords=cfg['keywords'],
    author=cfg['author'], author_email=cfg['author_email'],
)
