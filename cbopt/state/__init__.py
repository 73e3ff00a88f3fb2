"""Named state: the FQN-keyed state_dict, strict and atomic loading (`named`), the torch.optim and fastai readers
(`formats`), and fastai's per-param flags (`flags`)."""
from .flags import FLAGS, split_flags
from .formats import to_named
from .named import initial_state, named_state_dict, prepare_load

__all__ = ['FLAGS', 'split_flags', 'to_named', 'initial_state', 'named_state_dict', 'prepare_load']
