"""`python -m cbopt bench`: cbopt's backends timed against torch.optim, fastai and the other references, on CPU in fp32
(or on a GPU, `--device cuda`, in fp32 and bf16).

One job per module: `params` (the param sets and the model the cases time), `contenders` (what is timed: cbopt per
backend and the references, their optional packages imported only when used), `harness` (interleaved timing, ratios,
numerics checks, memory counters), `cases` (the cases, one function each, and what each times), `memory` (state per
rank under DDP, ZeRO and FSDP2), `report` (tables, bench.json, bench.md, bench.png) and `command` (the arguments and
the run). This package re-exports their public names (but `report`, the module: its `report` function renders a run).
"""
from .params import GPT2, TOKENS, Named, Shapes, gpt2_at, gpt2_model, gpt2_shapes, grid_shapes, make_params, numel, \
    param_sets, placed, PLACEMENT, tiny_gpt2
from .contenders import ADAM, BACKENDS, CLIP_NORM, LION, PACKAGES, STREAM_BYTES, Entry, adam_contenders, \
    available_backends, backend_kw, catalogue, catalogue_contenders, clip_contenders, entry_missing, fastai_adam, \
    installed, lion_contenders, missing, needs, one_group_each, select, stream_contenders, train_contenders, \
    train_step, unclipped_contenders
from .harness import Progress, cpu_s, cuda_peak_bytes, measure, numerics_gap, paired, pin_mmap_threshold, state_bytes, status_kb, timed
from .cases import CUDA_PARTS, PARTS, TRAIN_ROWS, cuda_peak_memory, catalogue_case, catalogue_numerics, cold_compile, compile_case, \
    in_backward_case, peak_memory, run_case, step_peak_memory, train_case, train_step_peak
from .memory import MODES, measure_rank, memory_rows, state_memory
from .report import ADAM_BYTES, CASE_TITLES, LION_BYTES, adam_rows, catalogue_report, catalogue_rows, clip_rows, \
    compile_report, fastest_ref, fmt, in_backward_rows, lion_rows, machine, plot, table, times_floor, train_rows, write
from .command import BF16_TOL, main, run

__all__ = ['gpt2_shapes', 'grid_shapes', 'make_params', 'available_backends', 'measure', 'catalogue', 'main']
