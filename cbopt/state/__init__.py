"""Checkpoints: saving (`save`: the name-keyed layout and torch's), export in a torch.optim class's own format
(`torch_format`), reading every supported checkpoint format into one form (`formats`), and strict, atomic loading
matched by name (`load`); low-bit state (`lowbit`: `state_precision=`)."""
from .formats import read_checkpoint
from .load import prepare_load
from .save import named_state_dict, torch_state_dict
from .lowbit import PRECISIONS, state_bytes
from .torch_format import torch_class_state_dict

__all__ = ['read_checkpoint', 'named_state_dict', 'torch_state_dict', 'torch_class_state_dict', 'prepare_load', 'PRECISIONS', 'state_bytes']
