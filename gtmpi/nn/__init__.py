"""Neural-network modules. GT's spellings keep working: ``from gtmpi.nn import Module, Linear, SGD``
and ``nn.mse_loss(pred, target)``."""
from . import functional, init, utils
from .functional import cross_entropy, mse_loss
from .layers import (GELU, CrossEntropyLoss, Dropout, Embedding, Flatten, Identity, LayerNorm,
                     LeakyReLU, Linear, MSELoss, MultiheadAttention, MultiheadSelfAttention,
                     NLLLoss, ReLU, RMSNorm, Sigmoid, SiLU, Softmax, Tanh)
from .module import Module, ModuleDict, ModuleList, Sequential
from .parameter import Parameter
from ..optim import SGD, Adam, AdamW

__all__ = ["functional", "init", "utils", "cross_entropy", "mse_loss", "GELU",
           "CrossEntropyLoss", "Dropout", "Embedding", "Flatten", "Identity", "LayerNorm",
           "LeakyReLU", "Linear", "MSELoss", "MultiheadAttention", "MultiheadSelfAttention",
           "NLLLoss", "ReLU", "RMSNorm", "Sigmoid", "SiLU", "Softmax", "Tanh", "Module",
           "ModuleDict", "ModuleList", "Sequential", "Parameter", "SGD", "Adam", "AdamW"]
