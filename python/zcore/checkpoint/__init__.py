"""Sharded checkpoints: saved per parameter range by every rank, loadable at
any world size, stage or offload setting, consolidated by streaming."""

from zcore.checkpoint.consolidate import consolidate
from zcore.checkpoint.full_state import full_state_dict
from zcore.checkpoint.load import load_checkpoint
from zcore.checkpoint.save import save_checkpoint

__all__ = ["consolidate", "full_state_dict", "load_checkpoint", "save_checkpoint"]

for _name in __all__:
    globals()[_name].__module__ = __name__
