"""Sharded checkpoints: saved per parameter range by every rank, loadable at
any world size, stage or offload setting, consolidated by streaming; and
PyTorch's DCP format, both ways."""

from zcore.checkpoint.consolidate import consolidate
from zcore.checkpoint.dcp import load_dcp, save_dcp
from zcore.checkpoint.full_state import full_state_dict
from zcore.checkpoint.load import load_checkpoint
from zcore.checkpoint.save import save_checkpoint

__all__ = ["consolidate", "full_state_dict", "load_checkpoint", "load_dcp", "save_checkpoint", "save_dcp"]

for _name in __all__:
    globals()[_name].__module__ = __name__
