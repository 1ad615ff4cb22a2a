"""Module and containers, with torch's names for parameters and state-dict keys, so that a
gtmpi checkpoint loads into the same model written in plain torch and the other way round."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch

from ..autograd import no_grad, zero_grads
from ..client.creation import beside, tensor
from ..client.dtypes import as_dtype
from ..client.tensor import Tensor
from .parameter import Parameter


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, Tensor) and name in self.__dict__.get("_buffer_names", ()):
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        for table in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Tensor | None) -> None:
        self.__dict__.setdefault("_buffer_names", set()).add(name)
        self._buffers[name] = value

    def register_parameter(self, name: str, value: Parameter | None) -> None:
        self._parameters[name] = value

    def add_module(self, name: str, module: "Module | None") -> None:
        self._modules[name] = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # traversal ------------------------------------------------------------------------------

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        return (m for _, m in self.named_modules())

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        return ((n, m) for n, m in self._modules.items() if m is not None)

    def children(self) -> Iterator["Module"]:
        return (m for _, m in self.named_children())

    def _named(self, table: str) -> Iterator[tuple[str, Tensor]]:
        for prefix, module in self.named_modules():
            for name, value in getattr(module, table).items():
                if value is not None:
                    yield (f"{prefix}.{name}" if prefix else name), value

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        return self._named("_parameters")

    def parameters(self) -> Iterator[Parameter]:
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        return self._named("_buffers")

    def buffers(self) -> Iterator[Tensor]:
        return (b for _, b in self.named_buffers())

    # modes and state ------------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.parameters(), set_to_none)

    def state_dict(self) -> "OrderedDict[str, Tensor]":
        state = OrderedDict(self.named_parameters())
        state.update(self.named_buffers())
        return state

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state)}.")
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: "
                               f"missing keys {missing}, unexpected keys {unexpected}")
        with no_grad():
            for name, target in own.items():
                if name not in state:
                    continue
                value = state[name]
                if isinstance(value, (torch.Tensor, np.ndarray)):
                    with beside(target):  # uploaded where the parameter lives: nothing moves
                        value = tensor(value)
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(f"size mismatch for {name}: copying a param with shape "
                                       f"{tuple(value.shape)}, the shape in current model is "
                                       f"{tuple(target.shape)}.")
                target.copy_(value)

    def to(self, dtype: Any) -> "Module":
        """Convert floating-point parameters and buffers to ``dtype`` (devices are the
        runtime's business, not the model's)."""
        dtype = as_dtype(dtype)
        with no_grad():
            for module in self.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and p.dtype.is_floating_point:
                        module._parameters[name] = Parameter(p.to(dtype), p.requires_grad)
                for name, b in list(module._buffers.items()):
                    if b is not None and b.dtype.is_floating_point:
                        module._buffers[name] = b.to(dtype)
        return self

    def float(self) -> "Module":
        return self.to(torch.float32)

    def half(self) -> "Module":
        return self.to(torch.float16)

    def bfloat16(self) -> "Module":
        return self.to(torch.bfloat16)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(lines) + "\n)" if lines else ")")


class ModuleList(Module):
    def __init__(self, modules: Any = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> "ModuleList":
        self.add_module(str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Modules applied in order; state-dict keys "0.weight", "1.bias", ... as in torch."""

    def __init__(self, *modules: Module) -> None:
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleDict(Module):
    def __init__(self, modules: dict | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self.add_module(k, m)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()
