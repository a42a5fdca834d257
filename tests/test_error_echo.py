"""What an error message may echo of a client's value (``errors.clip``): bounded whatever was sent,
and never itself the cause of a 500."""

from __future__ import annotations

import pytest

from embedfleet.deployments.errors import clip


def nested(depth: int) -> list:
    root = node = []
    for _ in range(depth - 1):
        node.append([])
        node = node[0]
    return root


def test_a_long_string_is_cut_with_an_ellipsis_and_its_length():
    assert clip("a" * 100_000) == "'" + "a" * 64 + "…' (100000 chars)"
    assert clip("a" * 65, limit=4) == "'aaaa…' (65 chars)"


@pytest.mark.parametrize("value", ["", "m", "a" * 64, 0, -3, 1.5, True, None, [], {}, (1,),
                                   [1, "x"], {"a": [1, 2, {"b": None}]}])
def test_a_short_value_is_its_repr(value):
    assert clip(value) == repr(value)


def test_escapes_count_against_the_limit():
    out = clip("\x00" * 100)
    assert out.startswith("'\\x00") and out.endswith("…' (100 chars)")
    assert len(out) <= 64 + len("…' (100 chars)") + 1


@pytest.mark.parametrize("depth", [1, 63, 64, 65, 255, 256, 1000, 1024, 5000, 50_000])
def test_deep_nesting_is_cut_without_recursing_through_it(depth):
    # repr() of a 1,000-deep list raises RecursionError, orjson.dumps TypeError past 254 levels
    out = clip(nested(depth))
    full = "[" * depth + "]" * depth  # what repr() would say
    assert out == (full if len(full) <= 64 else full[:64] + "… (1 item)")


def test_big_containers_and_ints_are_bounded():
    assert clip(["x"] * 1_000_000).endswith("… (1000000 items)")
    assert len(clip(["x"] * 1_000_000)) < 100
    assert clip({str(i): i for i in range(100)}).endswith("… (100 keys)")
    assert clip(10 ** 10_000) == "<int of 33220 bits>"  # repr() would raise past 4,300 digits
    assert len(clip(10 ** 100)) < 100
