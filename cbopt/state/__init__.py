"""Named state: torch-layout and name-keyed state_dicts and strict, atomic loading by name (`named`), reading every
supported checkpoint format (`formats`), wrapper prefixes removed from names (`names`), and fastai's per-param flags
(`flags`)."""
from .flags import FLAGS, split_flags
from .formats import read_checkpoint
from .named import initial_state, named_state_dict, prepare_load, torch_class_state_dict, torch_state_dict
from .names import canonical_names

__all__ = ['FLAGS', 'split_flags', 'read_checkpoint', 'initial_state', 'named_state_dict', 'torch_state_dict',
           'torch_class_state_dict', 'prepare_load', 'canonical_names']
