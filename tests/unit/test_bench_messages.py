"""The per-message CPU benchmark: its table's shape, on the in-process transport only."""

from gossip.bench import messages


def test_rows_cover_every_shape_pattern_and_side():
    shapes = [(0, "1k"), (1, "1k")]
    results = messages.measure(shapes, messages.PATTERNS, scale=0.05, transports=("loopback",))
    rows = messages.rows(results)
    assert {(r[1], r[2], r[3]) for r in rows} == {
        (pattern, shape, side) for pattern, sides in (("stream", ("send", "recv")),
                                                       ("pingpong", ("a", "b")))
        for shape in ("0x1k", "1x1k") for side in sides}
    assert all(r[0] == "loopback" and r[4] >= 0 and r[5] >= 0 for r in rows)


def test_shapes_and_forwarded_arguments_are_parsed():
    assert messages.parse_shape("3x50k") == (3, "50k")
    assert messages.parse_shape("3x5k") is None and messages.parse_shape("x1k") is None
    assert messages.without_options(["--trees", "a,b", "--runs=2", "--scale", "0.5"],
                             ("--trees", "--runs")) == ["--scale", "0.5"]
