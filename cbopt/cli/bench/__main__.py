"""`python -m cbopt.cli.bench`: the same command as `python -m cbopt bench`."""
import sys

from .command import main

if __name__ == '__main__': main(sys.argv[1:])
