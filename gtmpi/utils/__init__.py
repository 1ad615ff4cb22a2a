"""torch.utils on gtmpi: data loading (gtmpi.utils.data), activation checkpointing
(gtmpi.utils.checkpoint)."""
from . import checkpoint, data

__all__ = ["checkpoint", "data"]
