"""Training steps through Peer.step on a tiny model, recorded per step and rank."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from gossip.topology import Topology
from gossip.transport import LoopbackHub

from support.peers import peer_once_all_bound, run_in_threads


class TinyNet(torch.nn.Module):
    """Two layers plus a parameter the forward pass never uses (its grad stays None) and a
    frozen one (Peer.step must leave it out)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)
        self.unused = torch.nn.Parameter(torch.ones(2))
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(x) + self.frozen))


class BatchNormNet(torch.nn.Module):
    """A linear layer and a BatchNorm over its outputs: float buffers beside the
    parameters."""

    def __init__(self, inputs: int = 3, outputs: int = 2):
        super().__init__()
        self.layer = torch.nn.Linear(inputs, outputs)
        self.norm = torch.nn.BatchNorm1d(outputs)

    def forward(self, x):
        return self.norm(self.layer(x))


@dataclass
class Steps:
    """Flat trainable parameters and gradients per step and rank: ``[step, rank, d]``."""

    before: torch.Tensor
    grads: torch.Tensor
    after: torch.Tensor
    frozen_after: torch.Tensor  # [rank, 3]


def run_training_steps(topology: Topology, strategy: str, *, steps: int = 2, lr: float = 0.1,
                       same_init: bool = True, loopback: bool = False,
                       timeout: float = 10.0, **options) -> Steps:
    """Each peer trains a TinyNet with SGD through ``Peer.step`` on its own batches
    (``options``: the strategy's)."""
    size = topology.size
    hub = LoopbackHub(size) if loopback else None
    record: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(size)]
    frozen: list[torch.Tensor] = [torch.empty(0)] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        model = TinyNet()
        init = torch.Generator().manual_seed(0 if same_init else 100 + rank)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=init))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        trainable = [p for p in model.parameters() if p.requires_grad]
        batches = torch.Generator().manual_seed(1000 + rank)
        with peer_once_all_bound(rank, topology, strategy, all_bound, hub=hub,
                                 timeout=timeout, **options) as peer:
            for _ in range(steps):
                inputs = torch.randn(5, 4, generator=batches)
                targets = torch.randn(5, 1, generator=batches)
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(inputs), targets).backward()
                before = flat(p.detach() for p in trainable)
                grads = flat(p.grad if p.grad is not None else torch.zeros_like(p)
                             for p in trainable)
                peer.step(model, optimizer)
                record[rank].append((before, grads, flat(p.detach() for p in trainable)))
        frozen[rank] = model.frozen.detach().clone()

    run_in_threads(size, peer_main, timeout=3 * timeout)

    def stack(i: int) -> torch.Tensor:  # -> [step, rank, d]
        return torch.stack([torch.stack([record[rank][s][i] for rank in range(size)])
                            for s in range(steps)])

    return Steps(stack(0), stack(1), stack(2), frozen_after=torch.stack(frozen))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).clone() for t in tensors])
