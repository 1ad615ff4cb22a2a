"""The dispatcher: routing and batching of placed instructions."""
from .dispatcher import Dispatcher

__all__ = ["Dispatcher"]
