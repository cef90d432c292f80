"""CHOCO's state and fused step equal, bit for bit, the full recomputation they replace
(add_to on both copies, then x + gamma (mixed - public) over whole tensors)."""

from __future__ import annotations

import pytest
import torch

from gossip.compress import create
from gossip.strategies.dpsgd import public_copy
from gossip.strategies.dpsgd.public_copy import PublicCopy


@pytest.mark.parametrize("name, options", [
    ("topk", {"density": 0.03}), ("topk", {"density": 0.1, "values": "fp16"}),
    ("randomk", {"density": 0.05}), ("threshold", {"threshold": 0.8}), ("qsgd", {}),
    ("sign", {}),
])
def test_public_copy_matches_the_full_recomputation(name, options, monkeypatch):
    monkeypatch.setattr(public_copy, "CHUNK", 256)  # several chunks, the last one short
    compressor = create(name, **options)
    gen = torch.Generator().manual_seed(7)
    n, weights = 2003, (0.4, 0.35, 0.25)  # self, then two neighbours
    state = public_copy.PublicCopy(torch.zeros(n))
    public, mixed = torch.zeros(n), torch.zeros(n)
    x = torch.randn(n, generator=gen)
    for round in range(6):
        payload, own = state.compress(compressor, x, key="k", round=round)
        reference = compressor.compress(x - public, key="k", round=round)
        assert [b.tolist() for b in payload.buffers] == [b.tolist() for b in reference.buffers]
        if own is not None:  # what unpack would decode, without decoding
            decoded = compressor.unpack(payload)
            assert torch.equal(own.indices, decoded.indices)
            assert torch.equal(own.values, decoded.values)
        state.add_own(compressor, payload, own, self_weight=weights[0], scale=1.0)
        compressor.add_to(reference, public, alpha=1.0)
        compressor.add_to(reference, mixed, alpha=weights[0])
        for j, weight in enumerate(weights[1:]):
            theirs = compressor.compress(torch.randn(n, generator=gen), key=f"n{j}", round=round)
            state.add_neighbour(compressor, theirs, weight=weight, scale=1.0)
            compressor.add_to(theirs, mixed, alpha=weight)
        assert torch.equal(state.public, public) and torch.equal(state.mixed, mixed)
        expected = torch.add(x, torch.sub(mixed, public), alpha=0.3)
        x = state.step_into(x, 0.3, x)  # in place, as synchronize(x, out=x) does
        assert torch.equal(x, expected)
        x = x + 0.3 * torch.randn(n, generator=gen)


def test_a_payload_for_another_length_is_refused():
    from gossip.errors import ProtocolError

    compressor = create("topk", density=0.1)
    state = PublicCopy(torch.zeros(50))
    with pytest.raises(ProtocolError, match="60 elements but out has 50"):
        state.add_neighbour(compressor, compressor.compress(torch.randn(60)), weight=0.5,
                            scale=1.0)


def test_the_fused_step_equals_the_whole_tensor_ops_at_full_chunk_size():
    gen = torch.Generator().manual_seed(2)
    x, public, mixed = (torch.randn(3 * public_copy.CHUNK + 7, generator=gen) for _ in range(3))
    state = PublicCopy(x, public=public, mixed=mixed)
    expected = torch.add(x, torch.sub(mixed, public), alpha=0.017)
    assert torch.equal(state.step_into(x, 0.017, torch.empty_like(x)), expected)
