"""Points in time as people write them: a duration ago, epoch seconds, or ISO 8601. Pure: ``now`` is passed in.

The API (``GET /v1/usage?since=2h``) and the CLI (``gpuorch usage --since 2h``) read ``since`` and ``until``
with the same function, so a window means the same thing wherever it is typed.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

ACCEPTED = ("a duration ago (90s, 30m, 2h, 7d, 2w, 1h30m), epoch seconds (1795514400), "
            "ISO 8601 (2026-11-24T10:00:00Z; no offset means UTC), or 'now'")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
EARLIEST_EPOCH = 1e9  # 2001-09-09: a smaller bare number is far likelier a duration without its unit
LATEST_EPOCH = 1e11  # year 5138: a larger one is likelier milliseconds


class TimeSpecError(ValueError):
    """A time a person typed that is none of the accepted forms; the message says which forms are."""


def duration_s(text: str) -> float | None:
    """Seconds in a duration as people write it (90s, 30m, 2h, 7d, 2w, 1h30m); None if ``text`` is not one."""
    s = text.strip().lower()
    return sum(float(n) * UNITS[u] for n, u in _PART.findall(s)) if _DURATION.fullmatch(s) else None


def parse_time(text: str, now: float, typed: bool = True) -> float:
    """Epoch seconds for ``text``: '2h' is two hours before ``now``, '1795514400' and '2026-11-24T10:00:00Z' are
    themselves. ``typed``: a person typed it, so a small bare number is refused as a duration missing its unit
    (the API, whose callers are programs, takes any epoch seconds from 0)."""
    s = text.strip().lower()
    if s == "now":
        return now
    if (ago := duration_s(s)) is not None:
        return now - ago
    try:
        x = float(s)
    except ValueError:
        pass
    else:
        if not math.isfinite(x):
            raise TimeSpecError(f"{text!r} is not a time; use {ACCEPTED}")
        if x < (EARLIEST_EPOCH if typed else 0):
            raise TimeSpecError(f"{text!r}: a bare number is epoch seconds, and this one is before 2001; "
                                f"for a duration add a unit ({text.strip()}h); accepted: {ACCEPTED}")
        if x > LATEST_EPOCH:
            raise TimeSpecError(f"{text!r}: epoch seconds, not milliseconds; accepted: {ACCEPTED}")
        return x
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise TimeSpecError(f"{text!r} is not a time; use {ACCEPTED}") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def parse_window(since: str | None, until: str | None, now: float, default_since: str = "24h",
                 typed: bool = True) -> tuple[float, float]:
    """[since, until) in epoch seconds; ``until`` defaults to ``now``. Raises TimeSpecError naming the bad bound."""
    bounds = []
    for name, text, default in (("since", since, default_since), ("until", until, "now")):
        try:
            bounds.append(parse_time(default if text is None else text, now, typed))
        except TimeSpecError as e:
            raise TimeSpecError(f"{name}: {e}") from None
    lo, hi = bounds
    if hi < lo:
        raise TimeSpecError(f"until ({until}) is before since ({since if since is not None else default_since})")
    return lo, hi
