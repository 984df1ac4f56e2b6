"""A time as a person types it: a duration ago, epoch seconds, ISO 8601; anything else is refused with the forms."""

from __future__ import annotations

import pytest

from shared.timespec import TimeSpecError, parse_time, parse_window

NOW = 1_795_600_800.0  # 2026-11-25T09:20:00Z

CASES = [
    ("minutes ago", "30m", NOW - 1800),
    ("hours ago", "2h", NOW - 7200),
    ("days ago", "7d", NOW - 7 * 86400),
    ("weeks ago", "2w", NOW - 14 * 86400),
    ("seconds ago", "90s", NOW - 90),
    ("a compound duration", "1h30m", NOW - 5400),
    ("a fractional duration", "0.5h", NOW - 1800),
    ("upper-case units", "2H", NOW - 7200),
    ("now", "now", NOW),
    ("epoch seconds", "1795514400", 1795514400.0),
    ("fractional epoch seconds", "1795514400.25", 1795514400.25),
    ("ISO 8601 in UTC", "2026-11-24T10:00:00Z", 1795514400.0),
    ("ISO 8601 with an offset", "2026-11-24T11:00:00+01:00", 1795514400.0),
    ("ISO 8601 without an offset is UTC", "2026-11-24T10:00:00", 1795514400.0),
    ("an ISO 8601 date", "2026-11-24", 1795478400.0),
]


@pytest.mark.parametrize("text,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_accepted_forms(text, want):
    assert parse_time(text, NOW) == want


BAD = [
    ("a word", "yesterday"),
    ("an hours count without its unit (the old --since)", "24"),
    ("milliseconds", "1795514400000"),
    ("a negative duration", "-2h"),
    ("an unknown unit", "3y"),
    ("nothing", ""),
    ("not a number", "nan"),
]


@pytest.mark.parametrize("text", [c[1] for c in BAD], ids=[c[0] for c in BAD])
def test_anything_else_is_refused_naming_the_accepted_forms(text):
    with pytest.raises(TimeSpecError) as e:
        parse_time(text, NOW)
    assert "2h" in str(e.value) and "ISO 8601" in str(e.value) and "epoch seconds" in str(e.value)


def test_a_window_defaults_to_the_last_day_and_names_its_bad_bound():
    assert parse_window(None, None, NOW) == (NOW - 86400, NOW)
    assert parse_window("2h", "1h", NOW) == (NOW - 7200, NOW - 3600)
    with pytest.raises(TimeSpecError, match="^until: "):
        parse_window("2h", "soon", NOW)
    with pytest.raises(TimeSpecError, match="before since"):
        parse_window("1h", "2h", NOW)


def test_the_api_takes_any_epoch_seconds_a_person_must_give_a_unit():
    from shared.timespec import TimeSpecError, parse_time

    assert parse_time("0", 5e9, typed=False) == 0.0
    with pytest.raises(TimeSpecError, match="add a unit"):
        parse_time("24", 5e9)
