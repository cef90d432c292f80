"""A joiner's state crosses the wire as msgpack with tensor extensions, never pickle."""

import msgpack
import pytest
import torch

from gossip.errors import ProtocolError
from gossip.transport.state_bytes import TENSOR, state_from_bytes, state_to_bytes


def trained():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_model_and_its_optimizer_come_back_bitwise():
    model, optimizer = trained()
    state = state_from_bytes(state_to_bytes({"model": model.state_dict(),
                                             "optimizer": optimizer.state_dict()}))
    copy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    copy_optimizer = torch.optim.Adam(copy.parameters())
    copy.load_state_dict(state["model"])
    copy_optimizer.load_state_dict(state["optimizer"])
    for a, b in zip(model.state_dict().values(), copy.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    ours, theirs = optimizer.state_dict(), copy_optimizer.state_dict()
    # msgpack has one sequence type: a tuple (Adam's betas) comes back a list
    assert [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
            for group in ours["param_groups"]] == theirs["param_groups"]
    for key, values in ours["state"].items():  # int keys, tensors and a step count
        for name, value in values.items():
            assert torch.equal(value, theirs["state"][key][name])


@pytest.mark.parametrize("tensor", [torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
                                    torch.empty(0, 3), torch.tensor(7, dtype=torch.int64),
                                    torch.tensor([[True, False]]),
                                    torch.arange(12.0).reshape(3, 4).t()])  # not contiguous
def test_every_codec_dtype_and_shape(tensor):
    back = state_from_bytes(state_to_bytes({"t": tensor}))["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_what_is_not_a_state_is_refused_in_one_line():
    with pytest.raises(TypeError, match="complex"):
        state_to_bytes({"z": torch.zeros(2, dtype=torch.complex64)})
    for data in (b"\xc1", msgpack.packb(msgpack.ExtType(9, b""))):
        with pytest.raises(ProtocolError, match="state"):
            state_from_bytes(data)
    short = msgpack.ExtType(TENSOR, msgpack.packb(["float32", [4], b"\x00" * 8]))
    with pytest.raises(ProtocolError, match=r"shape \[4\] in a state holds 8 bytes"):
        state_from_bytes(msgpack.packb({"t": short}))
    bad = msgpack.ExtType(TENSOR, msgpack.packb(["float128", [1], b"\x00" * 16]))
    with pytest.raises(ProtocolError, match="malformed tensor"):
        state_from_bytes(msgpack.packb({"t": bad}))
