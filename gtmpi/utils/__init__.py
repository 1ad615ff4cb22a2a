"""torch.utils on gtmpi: data loading (gtmpi.utils.data)."""
from . import data

__all__ = ["data"]
