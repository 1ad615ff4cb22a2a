"""The op vocabulary (table.py) and client-side shape inference (shapes.py)."""
from .table import OPS, Kind, Op, index_key
from .shapes import infer

__all__ = ["OPS", "Kind", "Op", "index_key", "infer"]
