"""Parameters: leaf tensors that require grad and that Modules collect."""
from __future__ import annotations

from ..autograd import no_grad
from ..client.tensor import Tensor
from ..signals import as_state


class Parameter(Tensor):
    __slots__ = ()

    def __new__(cls, data: Tensor, requires_grad: bool = True) -> "Parameter":
        if data._host is not None:  # the client holds it: the parameter shares its values
            param = object.__new__(cls)
            Tensor.__init__(param, None, data._sig, data._host, data._recipe)
            param.requires_grad = requires_grad
            param._state, param._scope = True, data._scope
            return param
        with no_grad():
            # made on a worker (host tensors off, a named GPU): a config's 'parameters'
            # signal places it as it places a held one at its first use
            alias = None if data._scope else as_state(data)
            if alias is None:
                alias = data.detach()
        param = object.__new__(cls)
        Tensor.__init__(param, alias.id, alias._sig)
        alias.id = None  # the parameter now owns the worker tensor: only it frees it
        param.requires_grad = requires_grad
        return param

    def __init__(self, data: Tensor, requires_grad: bool = True) -> None:
        pass

    def _copied(self, values: Tensor) -> "Parameter":
        return Parameter(values, self.requires_grad)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
