"""An emulated device: every layer with parameters sleeps ``e`` seconds after its forward
and ``2e`` in backward, so compute is spread over backward the way a GPU's is and
link-bound overlap can be measured on a machine of few cores (a sleep costs no CPU; one
after backward would hide nothing). Training passes only: evaluation runs at full speed."""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds: float, sleep: Callable[[float], None]):
        ctx.seconds, ctx.sleep = seconds, sleep
        sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sleep(2 * ctx.seconds)
        return grad, None, None


def emulate_device(model: torch.nn.Module, seconds: float,
                   sleep: Callable[[float], None]) -> list:
    """Make each module of ``model`` that holds parameters itself sleep ``seconds`` in
    forward and twice that in backward (through ``sleep``, the peer's clock); returns the
    hook handles. The model's structure and state_dict keys stay as they are."""

    def delay(module, args, output):
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
            return output
        return _Sleep.apply(output, seconds, sleep)

    return [module.register_forward_hook(delay) for module in model.modules()
            if any(True for _ in module.parameters(recurse=False))]
