"""Neural-network modules. GT's spellings keep working: ``from gtmpi.nn import Module, Linear, SGD``."""
from . import functional
from .layers import (GELU, Dropout, Embedding, LayerNorm, Linear, MultiheadSelfAttention, ReLU,
                     RMSNorm, SiLU, Softmax)
from .module import Module, ModuleDict, ModuleList, Sequential
from .parameter import Parameter
from ..optim import SGD, Adam, AdamW

__all__ = ["functional", "GELU", "Dropout", "Embedding", "LayerNorm", "Linear",
           "MultiheadSelfAttention", "ReLU", "RMSNorm", "SiLU", "Softmax", "Module", "ModuleDict",
           "ModuleList", "Sequential", "Parameter", "SGD", "Adam", "AdamW"]
