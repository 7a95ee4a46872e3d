"""``Staleness``: parsing (the config's wording for bad values), its wire form, equality with
what was written, and the comparisons the bus's admission and stale drops use."""

from __future__ import annotations

import math

import pytest

from relax.schema import INF, UNBOUNDED, Staleness, staleness_problem


@pytest.mark.parametrize(
    ("value", "versions"),
    [(0, 0), (1, 1), (7, 7), ("inf", None), (math.inf, None), (Staleness(3), 3)],
)
def test_parse_accepts_a_bound_or_inf(value, versions) -> None:
    parsed = Staleness.parse(value)
    assert parsed.versions == versions
    assert parsed.bounded is (versions is not None)
    assert Staleness.parse(parsed) is parsed  # already one: kept as it is


@pytest.mark.parametrize(
    ("value", "message", "hint"),
    [
        (-3, 'must be 0, a positive integer or "inf", got -3', "0 is strict on-policy"),
        (1.5, 'must be 0, a positive integer or "inf", got 1.5', None),
        (2.0, 'must be 0, a positive integer or "inf", got 2.0', "write 2 without the '.0'"),
        (-math.inf, 'must be 0, a positive integer or "inf", got -inf', None),
        ("Infinity", """must be 0, a positive integer or "inf", got 'Infinity'""", 'write "inf"'),
        ("lots", """must be 0, a positive integer or "inf", got 'lots'""", None),
        (True, 'must be 0, a positive integer or "inf", got True', None),
        (None, 'must be 0, a positive integer or "inf", got None', None),
    ],
)
def test_parse_refuses_anything_else_saying_what_to_write(value, message, hint) -> None:
    assert staleness_problem(value) == (message, hint)
    with pytest.raises(ValueError) as info:
        Staleness.parse(value)
    assert str(info.value) == f"staleness {message}" + (f" ({hint})" if hint else "")


def test_problem_writes_the_value_with_the_callers_show() -> None:
    message, _ = staleness_problem("Inf", show=lambda v: f"<{v}>")
    assert message.endswith("got <Inf>")


def test_wire_form_limit_and_text() -> None:
    assert Staleness.parse(2).wire == 2 and type(Staleness.parse(2).wire) is int
    assert Staleness.parse(math.inf).wire == INF == "inf"
    assert Staleness.parse(2).limit == 2.0 and math.isinf(UNBOUNDED.limit)
    assert str(Staleness.parse(0)) == "0" and str(UNBOUNDED) == "inf"
    # The wire form reads back as the same value.
    for value in (0, 4, "inf"):
        assert Staleness.parse(Staleness.parse(value).wire) == Staleness.parse(value)


def test_equal_to_itself_and_to_its_wire_form() -> None:
    assert Staleness.parse(2) == 2 and Staleness.parse(2) != 3
    assert Staleness.parse("inf") == "inf" and Staleness.parse("inf") != 0
    assert Staleness.parse(1) != True  # noqa: E712 - a bool is no staleness
    assert Staleness.parse(0) == Staleness(0) and Staleness(0) != UNBOUNDED
    assert hash(Staleness.parse(2)) == hash(2) and hash(UNBOUNDED) == hash("inf")
    assert len({Staleness(1), Staleness.parse(1), UNBOUNDED, Staleness.parse("inf")}) == 2
    with pytest.raises(AttributeError):
        Staleness(1).versions = 2  # type: ignore[misc]


def test_oldest_version_and_too_stale() -> None:
    k = Staleness.parse(2)
    assert k.oldest_version(5) == 3
    assert not k.too_stale(3, 5) and k.too_stale(2, 5)
    on_policy = Staleness.parse(0)
    assert not on_policy.too_stale(5, 5) and on_policy.too_stale(4, 5)
    assert UNBOUNDED.oldest_version(5) == -math.inf
    assert not UNBOUNDED.too_stale(-(10**9), 5)


def test_rows_in_play_paces_producers() -> None:
    # AReaL's rule: (batches consumed + k + 1) * batch size rows may be in play.
    assert Staleness.parse(0).rows_in_play(0, 4) == 4
    assert Staleness.parse(2).rows_in_play(3, 4) == 24
    assert math.isinf(UNBOUNDED.rows_in_play(3, 4))
