"""Integrations with other libraries, each in its own module, none imported by this package: `fastai` registers a
neutral hook with the core (`cbopt.optimizer.on_create`) at `import cbopt` and imports fastai only if the user has;
`zero` (`cbopt.ZeroRedundancyOptimizer`, a subclass of torch's) is imported on first use."""
