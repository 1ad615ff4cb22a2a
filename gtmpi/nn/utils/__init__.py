"""torch.nn.utils: gradient clipping (gtmpi.optim.clip), under torch's names."""
from ...optim.clip import clip_grad_norm_, clip_grad_value_

__all__ = ["clip_grad_norm_", "clip_grad_value_"]
