"""What a parameter strategy synchronizes of a model, as one flat vector: the trainable
parameters, the floating-point buffers (BatchNorm's running statistics), and optionally
the optimizer's momentum buffers of those parameters.

Buffers ride along because a model whose parameters agree while each peer keeps its own
running statistics evaluates differently on every peer (pytorch#74157). Integer buffers
(``num_batches_tracked``) count this peer's own steps and stay local.
"""

from __future__ import annotations

import torch

from gossip.errors import ConfigError


class ModelVector:
    """The tensors of ``model`` (and ``optimizer``) a parameter round synchronizes.

    Args:
        model: The model.
        optimizer: Its optimizer; needed only with ``momentum``.
        momentum: Include each trainable parameter's ``momentum_buffer`` (created as zeros
            where the optimizer has none yet, so every peer sends the same length).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, momentum: bool = False):
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.tensors = [p.data for p in params] + [b.data for b in buffers]
        #: How many elements at the front of the vector are trainable parameters.
        self.parameters = sum(p.numel() for p in params)
        if momentum:
            self.tensors += [momentum_buffer(optimizer, p) for p in params]

    def flatten(self) -> torch.Tensor:
        """One new contiguous vector of every tensor, in order (on the first tensor's
        device and dtype)."""
        return torch.cat([t.reshape(-1) for t in self.tensors])

    def assign(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (as ``flatten`` made it) back into the tensors."""
        offset = 0
        for t in self.tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def momentum_buffer(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """``param``'s momentum buffer in ``optimizer``, created as zeros if it has none.

    Raises:
        ConfigError: the optimizer keeps no momentum buffers (only SGD's are averaged).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise ConfigError(f"optimizer_state average synchronizes SGD's momentum buffers; "
                          f"{type(optimizer).__name__} keeps other state (use keep or reset)")
    state = optimizer.state[param]
    if state.get("momentum_buffer") is None:
        state["momentum_buffer"] = torch.zeros_like(param)
    return state["momentum_buffer"]


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget the optimizer's per-parameter state (momentum restarts from zero)."""
    optimizer.state.clear()
