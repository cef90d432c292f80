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
    monkeypatch.setattr(public_copy, "KEEP_FROM", 0)  # sparse payloads kept for the step
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_the_fused_step_with_kept_payloads_equals_the_whole_tensor_ops_in_every_dtype(
        dtype, monkeypatch):
    """numpy takes the step's subtractions for float32/64, torch for the others: either
    way the bits of the whole-tensor ops. (Chunks a multiple of the vector width, as CHUNK
    is: torch's half-precision add rounds its scalar tail unlike its vector body.)"""
    monkeypatch.setattr(public_copy, "CHUNK", 1024)
    monkeypatch.setattr(public_copy, "KEEP_FROM", 0)
    gen = torch.Generator().manual_seed(5)
    n = 5003
    x, public, mixed = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
    compressor = create("topk", density=0.05, values="same")
    payload, own = compressor.compress_unpacked(torch.randn(n, generator=gen).to(dtype))
    state = PublicCopy(x, public=public.clone(), mixed=mixed.clone())
    state.add_own(compressor, payload, own, self_weight=0.4, scale=1.0)
    compressor.add_to(payload, public)
    compressor.add_to(payload, mixed, alpha=0.4)
    expected = torch.add(x, torch.sub(mixed, public), alpha=0.3)
    assert torch.equal(state.step_into(x, 0.3, torch.empty_like(x)), expected)
    assert torch.equal(state.public, public) and torch.equal(state.mixed, mixed)


# ---- the fused difference + selection (top-k) against the plain path: sub, then select


@pytest.mark.parametrize("n", [20011, 16384 * 2 + 3])
@pytest.mark.parametrize("k", [1, 200, 5002, "n"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_fused_difference_selects_what_sub_then_select_does(n, k, dtype):
    from gossip.compress.selection import topk_select, topk_select_difference

    k = n if k == "n" else k
    gen = torch.Generator().manual_seed(n + k)
    x, base = (torch.randn(n, generator=gen).to(dtype) for _ in range(2))
    out, plain = torch.empty_like(x), torch.sub(x, base)
    fused_idx, fused_values = topk_select_difference(
        x, base, out, k, generator=torch.Generator().manual_seed(3), sample_size=4096)
    idx, values = topk_select(plain, k, generator=torch.Generator().manual_seed(3),
                              sample_size=4096)
    assert torch.equal(fused_idx, idx) and torch.equal(fused_values, values)
    assert fused_idx.numel() == k


def test_the_fused_difference_falls_back_when_the_sample_misleads(monkeypatch):
    from gossip.compress import selection

    monkeypatch.setattr(selection, "MARGIN_SIGMAS", -50.0)  # threshold far too high
    gen = torch.Generator().manual_seed(4)
    x, base = torch.randn(40009, generator=gen), torch.randn(40009, generator=gen)
    out = torch.empty_like(x)
    idx, values = selection.topk_select_difference(x, base, out, 400, sample_size=4096)
    expected = torch.topk((x - base).abs(), 400).indices.sort().values
    assert torch.equal(idx, expected) and torch.equal(values, (x - base)[expected])
    assert torch.equal(out, x - base)  # the exact top-k ran over the whole difference


@pytest.mark.parametrize("chunk, keep_from", [
    (public_copy.CHUNK, public_copy.KEEP_FROM),  # payloads added as they come
    (public_copy.CHUNK, 0),  # kept for the step: one chunk
    (1000, 0),  # kept for the step: 21 chunks, the last short
])
@pytest.mark.parametrize("density", [1e-9, 0.01, 1.0])  # k = 1, 1%, k = n
def test_choco_rounds_with_the_fused_difference_equal_the_plain_ones(density, chunk, keep_from,
                                                                     monkeypatch):
    """Five peers on a ring (odd P), n not divisible by P, several rounds: the fused round
    (difference taken in the selection's pass, the payloads added inside the chunked step)
    against the plain one (x - x̂ whole, compress, add_to on both copies, x + gamma (s - x̂)
    whole), bit for bit."""
    from gossip.compress import topk

    monkeypatch.setattr(topk, "SAMPLE_SIZE", 1024)  # the sampled path at a test's size
    monkeypatch.setattr(public_copy, "CHUNK", chunk)
    monkeypatch.setattr(public_copy, "KEEP_FROM", keep_from)
    compressor = create("topk", density=density)
    peers, n, gamma = 5, 20011, 0.3
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, generator=gen) for _ in range(peers)]
    plain = [x.clone() for x in xs]
    states = [PublicCopy(x) for x in xs]
    public = [torch.zeros(n) for _ in range(peers)]
    mixed = [torch.zeros(n) for _ in range(peers)]
    ring = [((r - 1) % peers, (r + 1) % peers) for r in range(peers)]
    for round in range(4):
        sent = [states[r].compress(compressor, xs[r], key=f"k{r}", round=round)
                for r in range(peers)]
        reference = [compressor.compress(plain[r] - public[r], key=f"k{r}", round=round)
                     for r in range(peers)]
        for r in range(peers):
            assert [b.tolist() for b in sent[r][0].buffers] == [
                b.tolist() for b in reference[r].buffers]
            states[r].add_own(compressor, *sent[r], self_weight=1 / 3, scale=1.0)
            compressor.add_to(reference[r], public[r], alpha=1.0)
            compressor.add_to(reference[r], mixed[r], alpha=1 / 3)
            for j in ring[r]:
                states[r].add_neighbour(compressor, sent[j][0], weight=1 / 3, scale=1.0)
                compressor.add_to(reference[j], mixed[r], alpha=1 / 3)
        for r in range(peers):
            xs[r] = states[r].step_into(xs[r], gamma, xs[r])  # adds the kept payloads first
            plain[r] = torch.add(plain[r], torch.sub(mixed[r], public[r]), alpha=gamma)
            assert torch.equal(xs[r], plain[r])
            assert torch.equal(states[r].public, public[r])
            assert torch.equal(states[r].mixed, mixed[r])
            step = torch.randn(n, generator=gen) * 0.1  # a local step between rounds
            xs[r].add_(step)
            plain[r].add_(step)
