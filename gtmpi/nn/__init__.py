"""Neural-network modules. GT's spellings keep working: ``from gtmpi.nn import Module, Linear, SGD``,
and its functions on the nn module (``nn.relu(x)``, ``nn.sigmoid(x)``, ``nn.mse_loss(pred,
target)``), which torch keeps in torch.nn.functional."""
from . import functional, init, utils
from .functional import (LinearCrossEntropyOptions, cross_entropy, gelu, log_softmax, mse_loss,
                         relu, sigmoid, silu, softmax, tanh)
from .layers import (CELU, ELU, GELU, GLU, SELU, AdaptiveAvgPool1d, AdaptiveAvgPool2d,
                     AvgPool1d, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d,
                     CrossEntropyLoss, Dropout, Embedding, Flatten, Hardsigmoid, Hardswish,
                     Hardtanh, Identity, LayerNorm, LeakyReLU, Linear, LogSigmoid, LogSoftmax,
                     MaxPool1d, MaxPool2d, Mish, MSELoss, MultiheadAttention,
                     MultiheadSelfAttention, NLLLoss, PReLU, ReLU, ReLU6, RMSNorm, Sigmoid, SiLU,
                     Softmax, Softmin, Softplus, Softsign, Tanh, Tanhshrink, Threshold, Unflatten,
                     L1Loss, BCELoss, BCEWithLogitsLoss, SmoothL1Loss, HuberLoss, KLDivLoss,
                     CosineSimilarity, PairwiseDistance, GroupNorm, InstanceNorm1d,
                     InstanceNorm2d, TransformerEncoder, TransformerEncoderLayer, Upsample,
                     PixelShuffle, PixelUnshuffle, Dropout1d, Dropout2d, ConstantPad1d,
                     ConstantPad2d, ZeroPad1d, ZeroPad2d, ReflectionPad1d, ReflectionPad2d,
                     ReplicationPad1d, ReplicationPad2d, ConvTranspose1d, ConvTranspose2d,
                     LSTM, GRU)
from .module import Module, ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from .parameter import Parameter
from ..optim import SGD, Adam, AdamW

__all__ = ["functional", "init", "utils", "cross_entropy", "gelu", "log_softmax", "mse_loss",
           "relu", "sigmoid", "silu", "softmax", "tanh", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d", "GELU",
           "CrossEntropyLoss", "Dropout", "Embedding", "Flatten", "Identity", "LayerNorm",
           "LeakyReLU", "Linear", "MSELoss", "MultiheadAttention", "MultiheadSelfAttention",
           "NLLLoss", "ReLU", "RMSNorm", "Sigmoid", "SiLU", "Softmax", "Tanh", "Module",
           "ModuleDict", "ModuleList", "Sequential", "Parameter", "SGD", "Adam", "AdamW",
           "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AvgPool1d", "AvgPool2d", "MaxPool1d",
           "MaxPool2d", "CELU", "ELU", "GLU", "SELU", "Hardsigmoid", "Hardswish", "Hardtanh",
           "LogSigmoid", "LogSoftmax", "Mish", "PReLU", "ReLU6", "Softmin", "Softplus",
           "Softsign", "Tanhshrink", "Threshold", "Unflatten", "ParameterDict", "ParameterList", "L1Loss", "BCELoss",
           "BCEWithLogitsLoss", "SmoothL1Loss", "HuberLoss", "KLDivLoss", "CosineSimilarity",
           "PairwiseDistance", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
           "TransformerEncoder", "TransformerEncoderLayer", "Upsample", "PixelShuffle",
           "PixelUnshuffle", "Dropout1d", "Dropout2d", "ConstantPad1d", "ConstantPad2d",
           "ZeroPad1d", "ZeroPad2d", "ReflectionPad1d", "ReflectionPad2d", "ReplicationPad1d",
           "ReplicationPad2d", "ConvTranspose1d", "ConvTranspose2d", "LSTM",
           "GRU"]
