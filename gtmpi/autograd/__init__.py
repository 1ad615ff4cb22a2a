"""Autograd in the client: a graph of Nodes per forward pass (engine.py), and one gradient
rule per differentiable op of the op table (grads.py). Gradient ops are ordinary instructions:
they run on the workers, and no tensor data comes to the client."""
from ..client.gradmode import (enable_grad, inference_mode, is_grad_enabled, no_grad,
                               set_grad_enabled)
from .engine import backward, grad, zero_grads

__all__ = ["backward", "enable_grad", "grad", "inference_mode", "is_grad_enabled", "no_grad",
           "set_grad_enabled", "zero_grads"]
