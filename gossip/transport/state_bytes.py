"""A training state (nested dicts and lists of tensors, numbers, strings: a model's and an
optimizer's ``state_dict``) as bytes to send, and back, without pickle: msgpack with each
tensor as an extension (dtype name from the codec's whitelist, shape, raw bytes).

An elastic run's donor hands a joiner its state this way (gossip/strategies/elastic.py).
``torch.save`` bytes would need an unpickler on the receiving side, which the wire protocol
never runs on what arrives (docs/ARCHITECTURE.md, Wire protocol).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import torch

from gossip.errors import ProtocolError
from gossip.transport.codec import DTYPE_NAMES, DTYPES, ITEMSIZE, MAX_DIMS

TENSOR = 1  # the msgpack extension code of a tensor


def state_to_bytes(state: Any) -> bytes:
    """``state`` as msgpack; tensors (any device, any dtype of the codec's) as extensions.

    Raises:
        TypeError: a value msgpack cannot hold and that is no tensor of a known dtype.
    """
    return msgpack.packb(state, default=_pack_tensor, use_bin_type=True,
                         strict_types=False)


def state_from_bytes(data: bytes) -> Any:
    """What ``state_to_bytes`` made (tensors on the CPU).

    Raises:
        ProtocolError: the bytes are not such a state (malformed, an unknown dtype, a shape
            that does not match its bytes).
    """
    try:
        return msgpack.unpackb(data, ext_hook=_unpack_tensor, raw=False, strict_map_key=False,
                               use_list=True)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"a state that is not msgpack of tensors: {exc}") from None


def _pack_tensor(value: Any) -> msgpack.ExtType:
    if not torch.is_tensor(value) or value.dtype not in DTYPE_NAMES:
        raise TypeError(f"cannot send {type(value).__name__} "
                        f"{getattr(value, 'dtype', '')} in a state")
    flat = value.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return msgpack.ExtType(TENSOR, msgpack.packb([DTYPE_NAMES[value.dtype], list(value.shape), raw],
                                                 use_bin_type=True))


def _unpack_tensor(code: int, data: bytes) -> torch.Tensor:
    if code != TENSOR:
        raise ProtocolError(f"unknown msgpack extension {code} in a state")
    spec = msgpack.unpackb(data, raw=False)
    if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in DTYPES
            and isinstance(spec[1], list) and len(spec[1]) <= MAX_DIMS
            and all(isinstance(n, int) and n >= 0 for n in spec[1])
            and isinstance(spec[2], bytes)):
        raise ProtocolError("a malformed tensor in a state")
    dtype, shape, raw = DTYPES[spec[0]], spec[1], spec[2]
    if len(raw) != math.prod(shape) * ITEMSIZE[dtype]:
        raise ProtocolError(f"a {spec[0]} tensor of shape {shape} in a state holds "
                            f"{len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
