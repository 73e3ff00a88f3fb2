"""The bench's params: the sets of shapes each case times (GPT-2 small's, a grid of small tensors, tiny versions for
quick runs and numerics checks), params made from them with fixed grads, and a GPT-2 model for the cases that run
forward and backward (InBackward); `placed` puts the params on a GPU or in bf16 (`--device cuda`)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ['Shapes', 'Named', 'gpt2_shapes', 'grid_shapes', 'param_sets', 'PLACEMENT', 'placed', 'make_params', 'numel', 'tiny_gpt2',
           'gpt2_at', 'GPT2', 'gpt2_model', 'TOKENS']

Shapes = list[tuple[str, tuple[int, ...]]]
Named = list  # [(name, param)]


def gpt2_shapes(vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12) -> Shapes:
    "GPT-2's params in model order (defaults: GPT-2 small, 148 tensors, 124.4M params; Linear-style weight shapes)."
    block = [('ln_1.weight', (d,)), ('ln_1.bias', (d,)), ('attn.c_attn.weight', (3 * d, d)), ('attn.c_attn.bias', (3 * d,)),
             ('attn.c_proj.weight', (d, d)), ('attn.c_proj.bias', (d,)), ('ln_2.weight', (d,)), ('ln_2.bias', (d,)),
             ('mlp.c_fc.weight', (4 * d, d)), ('mlp.c_fc.bias', (4 * d,)), ('mlp.c_proj.weight', (d, 4 * d)),
             ('mlp.c_proj.bias', (d,))]
    return [('wte.weight', (vocab, d)), ('wpe.weight', (ctx, d)),
            *[(f'h.{i}.{n}', s) for i in range(layers) for n, s in block], ('ln_f.weight', (d,)), ('ln_f.bias', (d,))]


def grid_shapes(n: int = 1000, size: int = 64) -> Shapes:
    "`n` square tensors of `size`: many small params, where per-param overhead dominates a step."
    return [(f'w{i}', (size, size)) for i in range(n)]


def param_sets(quick: bool) -> dict[str, Shapes]:
    """The param sets of the Adam cases and of Lion's. `quick` shrinks them so that a run takes seconds; its Lion set
    has 4 tensors, the numerics check's size, so that the compiled chain is compiled once."""
    if quick:
        gpt2 = gpt2_shapes(vocab=512, ctx=64, d=32, layers=2)
        return {'gpt2': gpt2, 'grid': grid_shapes(50, 16), 'lion': gpt2[:4]}
    return {'gpt2': gpt2_shapes(), 'grid': grid_shapes(), 'lion': gpt2_shapes()}


PLACEMENT: dict = {'device': torch.device('cpu'), 'dtype': torch.float32}  # where `make_params` puts the params


@contextlib.contextmanager
def placed(device: str | torch.device = 'cpu', dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """`make_params` (and the streams, and the timer: `harness.timed`) on `device` in `dtype` inside the block:
    `--device cuda` runs the same cases on a GPU, and its bf16 rows in bfloat16."""
    before = dict(PLACEMENT)
    PLACEMENT.update(device=torch.device(device), dtype=dtype)
    try: yield
    finally: PLACEMENT.update(before)


def make_params(shapes: Shapes, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """Named params with a fixed random grad each, where `PLACEMENT` says (fp32 on the CPU unless `placed`): the step
    needs no backward, and every step sees the same grads. The values are drawn on the CPU, the same on every device."""
    g = torch.Generator().manual_seed(seed)
    res = []
    for name, shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(**PLACEMENT))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(**PLACEMENT)
        res.append((name, p))
    return res


def numel(ps: Named) -> int:
    "The elements of named params `ps`."
    return sum(p.numel() for _, p in ps)


def tiny_gpt2(layers: int = 12) -> list:
    """GPT-2's tensors at width 16 (148 with 12 layers): the numerics check's set. The same buckets and chunks as GPT-2
    small's, and no two sizes equal that differ there, so the fused rows reuse the graphs compiled for the timed set."""
    return gpt2_shapes(vocab=100, ctx=24, d=16, layers=layers)


def gpt2_at(width: float = 1., quick: bool = False) -> list:
    """The GPT-2 set at `width` times GPT-2 small's width and vocabulary (148 tensors at any width, so the same
    buckets and graphs; about width**2 of its 124.4M params); quick runs take a 1-layer `tiny_gpt2` (16 tensors)."""
    if quick: return tiny_gpt2(1)
    if width == 1: return gpt2_shapes()
    return gpt2_shapes(vocab=max(64, round(50257 * width)), ctx=max(16, round(1024 * width)),
                       d=max(64, 64 * round(12 * width)))


# -- the model of case 8 (InBackward) -----------------------------------------------------------------------------
class GPT2(torch.nn.Module):
    """A GPT-2 with `gpt2_shapes`' params (and, untied, an `lm_head` of its own): causal self-attention, GELU MLP,
    pre-LayerNorm. Enough of the real forward and backward that grads arrive in backward's order, one by one."""
    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12,
                 tied: bool = True):
        super().__init__()
        nn = torch.nn
        self.heads, self.wte, self.wpe = heads, nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), attn_proj=nn.Linear(d, d), ln_2=nn.LayerNorm(d),
            c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d))) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        if tied: self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        "The next-token cross-entropy of `idx` (batch, time)."
        F = torch.nn.functional
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            q, k, v = blk['c_attn'](blk['ln_1'](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            x = x + blk['attn_proj'](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
            x = x + blk['mlp_proj'](F.gelu(blk['c_fc'](blk['ln_2'](x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def gpt2_model(quick: bool, tied: bool, seed: int = 0) -> GPT2:
    "A seeded `GPT2`, GPT-2 small's size (or a tiny one when `quick`), its embeddings `tied` to its head or not."
    torch.manual_seed(seed)
    return GPT2(vocab=512, ctx=64, d=32, layers=2, heads=2, tied=tied) if quick else GPT2(tied=tied)


TOKENS = 32  # one sequence of 32 tokens: activations stay small next to the params, as the grads are the question
