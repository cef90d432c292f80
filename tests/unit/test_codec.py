"""Wire codec: exact round trips for every dtype and shape, and a reasoned ProtocolError for
every way a message can be malformed (never another exception, never a crash)."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gossip.errors import ProtocolError
from gossip.transport import Message, codec

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def wire(msg: Message, src: int = 3) -> list[bytes]:
    """The frames ``msg`` becomes on the wire, as the receiver gets them (private bytes)."""
    header, frames = codec.encode(msg, src)
    return [header] + [bytearray(f.numpy().tobytes()) for f in frames]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs, infinities, subnormals included); 0/1 for bool."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    bits = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        bits %= 2
    return bits.view(dtype).reshape(shape)


def assert_bitwise_equal(got: torch.Tensor, sent: torch.Tensor) -> None:
    assert got.dtype == sent.dtype and got.shape == sent.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (1,) * codec.MAX_DIMS],
                         ids=str)
@pytest.mark.parametrize("name", list(codec.DTYPES))
def test_round_trip_every_dtype_and_shape(name, shape):
    sent = random_tensor(codec.DTYPES[name], shape, seed=len(shape))
    msg = codec.decode(wire(Message("ring.rs", 7, meta={"n": 5}, buffers=(sent,))))
    assert (msg.kind, msg.round, msg.src, msg.meta) == ("ring.rs", 7, 3, {"n": 5})
    (got,) = msg.buffers
    assert_bitwise_equal(got, sent)


def test_round_trip_several_buffers_and_meta():
    buffers = (torch.arange(6.0).reshape(2, 3), torch.tensor(True),
               torch.empty(0, dtype=torch.int8), torch.arange(4, dtype=torch.bfloat16))
    meta = {"step": 3, "scale": 0.5, "names": ["a", "b"], "nested": {"k": None}}
    msg = codec.decode(wire(Message("gossip", -1, meta=meta, buffers=buffers), src=0))
    assert (msg.round, msg.src, msg.meta) == (-1, 0, meta)
    assert len(msg.buffers) == len(buffers)
    for got, sent in zip(msg.buffers, buffers):
        assert_bitwise_equal(got, sent)


def test_encode_sends_non_contiguous_tensors_as_their_values():
    base = torch.arange(24.0).reshape(4, 6)
    views = (base[:, ::2], base.t(), base[1:3, 2:5])
    msg = codec.decode(wire(Message("gossip", 0, buffers=views)))
    for got, sent in zip(msg.buffers, views):
        assert torch.equal(got, sent) and got.shape == sent.shape


def test_decode_accepts_zmq_frames():
    sent = torch.arange(5, dtype=torch.int64)
    frames = [zmq.Frame(bytes(f)) for f in wire(Message("gossip", 1, buffers=(sent,)))]
    assert torch.equal(codec.decode(frames).buffers[0], sent)


def test_header_length_is_what_encode_reports():
    msg = Message("gossip", 2, meta={"n": 4}, buffers=(torch.zeros(4),))
    header, frames = codec.encode(msg, 1)
    assert msgpack.unpackb(header) == {
        "v": codec.VERSION, "kind": "gossip", "round": 2, "src": 1, "meta": {"n": 4},
        "tensors": [{"dtype": "float32", "shape": [4]}]}
    assert [f.dtype for f in frames] == [torch.uint8] and frames[0].numel() == 16


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn])
def test_encode_rejects_dtypes_not_on_the_wire(dtype):
    with pytest.raises(ProtocolError, match="cannot be sent; allowed: float32"):
        codec.encode(Message("gossip", 0, buffers=(torch.zeros(2, dtype=dtype),)), 0)


@pytest.mark.parametrize("kind", ["", "Gossip", "1abc", "a b", "a" * 65, None])
def test_encode_rejects_bad_kinds(kind):
    with pytest.raises(ProtocolError, match="invalid message kind"):
        codec.encode(Message(kind, 0), 0)


shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)


@FUZZ
@given(names=st.lists(st.sampled_from(list(codec.DTYPES)), max_size=4),
       shape_list=st.lists(shapes, min_size=4, max_size=4),
       seed=st.integers(0, 2**32 - 1), round=st.integers(-2**63, 2**63 - 1),
       src=st.integers(0, 2**31))
def test_round_trip_random_dtypes_and_shapes(names, shape_list, seed, round, src):
    sent = tuple(random_tensor(codec.DTYPES[name], shape, seed + i)
                 for i, (name, shape) in enumerate(zip(names, shape_list)))
    msg = codec.decode(wire(Message("gossip", round, buffers=sent), src=src),
                       kinds=frozenset({"gossip"}))
    assert (msg.round, msg.src) == (round, src)
    assert len(msg.buffers) == len(sent)
    for got, expected in zip(msg.buffers, sent):
        assert_bitwise_equal(got, expected)


# -- rejections ---------------------------------------------------------------------------

FLOATS2 = [{"dtype": "float32", "shape": [2]}]


def header(**fields) -> bytes:
    """A valid header (one float32 tensor of 2 elements) with ``fields`` replaced; a field
    set to ``DROP`` is left out."""
    base = {"v": codec.VERSION, "kind": "gossip", "round": 0, "src": 1, "meta": {},
            "tensors": FLOATS2}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not DROP})


DROP = object()
EIGHT = b"\0" * 8


def decode(frames: list, **kwargs) -> Message:
    """codec.decode on writable copies of ``frames``, as a socket delivers them."""
    return codec.decode([bytearray(f) for f in frames], **kwargs)

REJECTED = {
    "empty message": ([], "empty message"),
    "not msgpack": ([b"\xc1", EIGHT], "not valid msgpack"),
    "truncated msgpack": ([header()[:-3], EIGHT], "not valid msgpack"),
    "trailing bytes": ([header() + b"\x00", EIGHT], "not valid msgpack"),
    "binary in header": ([msgpack.packb({"v": 1, "kind": b"gossip"}, use_bin_type=True)],
                         "not valid msgpack"),
    "header is a list": ([msgpack.packb([1, "gossip"])], "header is not a map"),
    "header is an int": ([msgpack.packb(1)], "header is not a map"),
    "no version": ([header(v=DROP), EIGHT], "unsupported protocol version None"),
    "version 2": ([header(v=2), EIGHT], "unsupported protocol version 2 (want 1)"),
    "version true": ([header(v=True), EIGHT], "unsupported protocol version True (want 1)"),
    "version 1.0": ([header(v=1.0), EIGHT], "unsupported protocol version 1.0 (want 1)"),
    "kind missing": ([header(kind=DROP), EIGHT], "invalid message kind None"),
    "kind uppercase": ([header(kind="Gossip"), EIGHT], "invalid message kind 'Gossip'"),
    "kind too long": ([header(kind="g" * 65), EIGHT], "invalid message kind"),
    "kind not a string": ([header(kind=7), EIGHT], "invalid message kind 7"),
    "round missing": ([header(round=DROP), EIGHT], "bad round/src in header: round=None"),
    "round a string": ([header(round="1"), EIGHT], "bad round/src in header: round='1'"),
    "round a bool": ([header(round=True), EIGHT], "bad round/src in header: round=True"),
    "round a float": ([header(round=1.0), EIGHT], "bad round/src in header: round=1.0"),
    "src negative": ([header(src=-1), EIGHT], "bad round/src in header: round=0 src=-1"),
    "src missing": ([header(src=DROP), EIGHT], "src=None"),
    "meta a list": ([header(meta=[1]), EIGHT], "header meta is not a map"),
    "meta missing": ([header(meta=DROP), EIGHT], "header meta is not a map"),
    "tensors a map": ([header(tensors={"a": 1}), EIGHT], "tensors must be a list of at most 64"),
    "tensors missing": ([header(tensors=DROP), EIGHT], "tensors must be a list"),
    "too many tensors": ([header(tensors=FLOATS2 * 65)] + [EIGHT] * 65,
                         "tensors must be a list of at most 64"),
    "fewer frames": ([header()], "header lists 1 tensors but 0 frames came"),
    "more frames": ([header(), EIGHT, EIGHT], "header lists 1 tensors but 2 frames came"),
    "spec not a map": ([header(tensors=["float32"]), EIGHT], "tensor 0: spec is not a map"),
    "dtype complex": ([header(tensors=[{"dtype": "complex64", "shape": [1]}]), EIGHT],
                      "tensor 0: dtype 'complex64' not allowed"),
    "dtype missing": ([header(tensors=[{"shape": [2]}]), EIGHT], "dtype None not allowed"),
    "dtype torch name": ([header(tensors=[{"dtype": "torch.float32", "shape": [2]}]), EIGHT],
                         "dtype 'torch.float32' not allowed"),
    "shape negative": ([header(tensors=[{"dtype": "uint8", "shape": [-8]}]), EIGHT],
                       "tensor 0: bad shape [-8]"),
    "shape not a list": ([header(tensors=[{"dtype": "uint8", "shape": 8}]), EIGHT],
                         "tensor 0: bad shape 8"),
    "shape missing": ([header(tensors=[{"dtype": "uint8"}]), EIGHT], "tensor 0: bad shape None"),
    "too many dims": ([header(tensors=[{"dtype": "uint8", "shape": [1] * 9}]), b"\0"],
                      "tensor 0: bad shape [1, 1, 1, 1, 1, 1, 1, 1, 1]"),
    "dim a float": ([header(tensors=[{"dtype": "uint8", "shape": [8.0]}]), EIGHT],
                    "tensor 0: bad shape [8.0]"),
    "dim a bool": ([header(tensors=[{"dtype": "uint8", "shape": [True]}]), b"\0"],
                   "tensor 0: bad shape [True]"),
    "dim huge": ([header(tensors=[{"dtype": "uint8", "shape": [1 << 40]}]), EIGHT],
                 "tensor 0: bad shape"),
    "frame too short": ([header(), b"\0" * 7],
                        "tensor 0: shape [2] of float32 needs 8 bytes, frame has 7"),
    "frame too long": ([header(), b"\0" * 9], "needs 8 bytes, frame has 9"),
    "second frame wrong": ([header(tensors=FLOATS2 * 2), EIGHT, b""],
                           "tensor 1: shape [2] of float32 needs 8 bytes, frame has 0"),
    "dims overflow the frame": (
        [header(tensors=[{"dtype": "float64", "shape": [(1 << 40) - 1] * 8}]), EIGHT],
        "needs"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_malformed_message_is_rejected_with_its_reason(case):
    frames, reason = REJECTED[case]
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert reason in str(info.value)


def test_kind_outside_the_allowed_set_is_rejected():
    frames = [header(kind="ring.rs"), EIGHT]
    assert decode(frames, kinds=frozenset({"ring.rs"})).kind == "ring.rs"
    with pytest.raises(ProtocolError, match="unexpected message kind 'ring.rs'"):
        decode(frames, kinds=frozenset({"gossip"}))


def test_message_over_max_message_bytes_is_rejected():
    frames = [header(tensors=FLOATS2 * 3)] + [EIGHT] * 3
    size = sum(map(len, frames))
    assert len(decode(frames, max_message_bytes=size).buffers) == 3
    with pytest.raises(ProtocolError, match=f"exceeds the size limit of {size - 1} bytes"):
        decode(frames, max_message_bytes=size - 1)


def test_header_over_max_header_bytes_is_rejected():
    frames = [header(meta={"pad": "x" * codec.MAX_HEADER_BYTES}), EIGHT]
    with pytest.raises(ProtocolError, match=f"header of {len(frames[0])} bytes exceeds "
                                            f"{codec.MAX_HEADER_BYTES}"):
        decode(frames)


def test_header_at_max_header_bytes_is_accepted():
    pad = codec.MAX_HEADER_BYTES - len(header(meta={"pad": ""}))
    frames = [header(meta={"pad": "x" * (pad - 3)}), EIGHT]  # str8 -> str16 adds 2..3 bytes
    assert len(frames[0]) <= codec.MAX_HEADER_BYTES
    assert decode(frames).meta["pad"] == "x" * (pad - 3)


@pytest.mark.parametrize("dtype", [["float32"], {"name": "float32"}], ids=["list", "map"])
def test_unhashable_dtype_is_rejected(dtype):
    """Regression: DTYPES.get() on a list or map raised TypeError."""
    with pytest.raises(ProtocolError, match="tensor 0: dtype .* not allowed"):
        decode([header(tensors=[{"dtype": dtype, "shape": [2]}]), EIGHT])


# -- fuzzing: decode returns a valid Message or raises ProtocolError, nothing else ------------


def decodes_or_rejects(frames: list) -> None:
    frames = [bytearray(f) for f in frames]  # writable, as a socket delivers them
    try:
        msg = codec.decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, Message) and len(msg.buffers) == len(frames) - 1
    for buf, frame in zip(msg.buffers, frames[1:]):
        assert buf.numel() * buf.element_size() == len(frame)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
@example([b"\x80", b""])  # an empty map
@example([msgpack.packb({"v": 1, "kind": "a", "round": 0, "src": 0, "meta": {},
                         "tensors": []})])
def test_random_bytes_never_crash_decode(frames):
    decodes_or_rejects(frames)


# Header values of every msgpack type, in every field.
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
           | st.text(max_size=8) | st.sampled_from(["gossip", "float32", "bool", "v"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
specs = st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from(list(codec.DTYPES)) | values,
                  "shape": st.lists(st.integers(-1, 4), max_size=3) | values})
headers = st.fixed_dictionaries(
    {}, optional={"v": st.just(1) | values, "kind": st.just("gossip") | values,
                  "round": st.integers(-3, 3) | values, "src": st.integers(-1, 3) | values,
                  "meta": st.just({}) | values, "tensors": st.lists(specs | values, max_size=3)
                  | values})


@FUZZ
@given(headers, st.lists(st.binary(max_size=40), max_size=4))
def test_random_headers_never_crash_decode(fields, payload):
    decodes_or_rejects([msgpack.packb(fields)] + payload)
