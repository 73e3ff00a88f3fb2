"""Command line: `python -m cbopt demo` trains a small model with several optimizers; `python -m cbopt bench` benchmarks
the backends; `python -m cbopt docs` builds the documentation site and serves it locally."""
import argparse
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog='python -m cbopt', description=__doc__)
    sub = parser.add_subparsers(dest='cmd', required=True)
    sub.add_parser('demo', help='train a small model on synthetic data, print a table, write a loss plot', add_help=False)
    sub.add_parser('bench', help='benchmark the backends against torch.optim and fastai', add_help=False)
    sub.add_parser('docs', help='build the documentation site and serve it locally (needs the docs extra)', add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd == 'demo':
        from .cli.demo import main as run
    elif args.cmd == 'docs':
        from .cli.docs import main as run
    else:
        from .cli.bench import main as run
    run(rest)


if __name__ == '__main__': main(sys.argv[1:])
