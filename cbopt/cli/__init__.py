"""`python -m cbopt demo` and `python -m cbopt bench`: tools, outside the import path of `import cbopt`."""
