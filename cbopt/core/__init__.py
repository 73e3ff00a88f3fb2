"""The leaves every other part builds on: what a callback declares (`spec`), the callback protocol (`chain`), param
groups and hypers (`hypers`), the accepted `params` forms (`params`), param names (`names`), fastai's per-param flags
(`flags`), a chain's initial state (`initial`), bucket stand-ins (`tensorlist`), sharded params (`dtensor`), and
per-optimizer engine memory and warnings at the user's line (`runtime`). Nothing here imports from outside `core`."""
