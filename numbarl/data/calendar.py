"""Exchange session calendar: which trading session (trade date) a timestamp belongs to.

A session is named by its exchange trade date and runs from its open to the next session's open.
The default is CME Globex: sessions open at 17:00 America/Chicago on the evening *before* the
trade date and close at 16:00 on the trade date, Monday to Friday (Monday's session opens on
Sunday evening). Daylight saving time is handled by ``zoneinfo``: the open is 17:00 local time all
year, so its UTC instant moves by an hour in March and November.

This is what ``bars_per_day`` counts (bars / sessions with data, never UTC dates: a Sunday-evening
open and Monday's trading are one session), what the ``target`` bar mode calibrates on, what
``session_id`` in the cache numbers, and what walk-forward folds never split.

Holidays need no list: a weekday without records simply has no bars and does not count.

Markets that trade every day (crypto) set ``weekends=True``: every calendar day is a session.
``close_time`` "24:00" closes a session at the next midnight (``UTC_DAYS``: UTC days, 00:00-24:00,
every day — the calendar of the Binance reader). A session's trading hours are [open, close);
the time from its close to the next open (CME's 16:00-17:00 halt and pre-open, a weekend) is
outside the trading session: crossed books there are skipped, not an error (bars.py).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np

from numbarl.data.errors import DataError

NS_PER_SECOND = 1_000_000_000
NS_PER_DAY = 86_400 * NS_PER_SECOND
EPOCH = dt.date(1970, 1, 1)
_TS_LOW = 365 * NS_PER_DAY  # 1971-01-01: the range validate.py accepts, with a margin
_TS_HIGH = (dt.date(2200, 1, 2) - EPOCH).days * NS_PER_DAY


def _parse_hhmm(text: str, field: str) -> dt.time:
    try:
        hours, minutes = (int(part) for part in str(text).split(":"))
        return dt.time(hours, minutes)
    except (ValueError, TypeError):
        if field == "close_time" and str(text).strip() == "24:00":
            return dt.time(0, 0)
        raise DataError(f"session calendar: {field} must be HH:MM (24h), got {text!r}") from None


def _midnight_close(text) -> bool:
    return str(text).strip() == "24:00"


@dataclass(frozen=True)
class SessionCalendar:
    """Exchange sessions: timezone, session open and close (local wall-clock times)."""

    tz: str = "America/Chicago"
    """IANA timezone of the exchange, e.g. America/Chicago (CME), America/New_York, Europe/London."""
    open_time: str = "17:00"
    """Local time the session opens. When it is later than ``close_time`` the session opens on the
    evening before its trade date (CME Globex); otherwise on the trade date itself."""
    close_time: str = "16:00"
    """Local time the session closes on its trade date (used for time-of-session features);
    "24:00" is the midnight that ends the trade date."""
    weekends: bool = False
    """True: every day is a session (crypto); False: Monday to Friday."""

    def __post_init__(self):
        try:
            ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise DataError(f"session calendar: unknown timezone {self.tz!r} (use an IANA name such as America/Chicago)") from None
        _parse_hhmm(self.open_time, "open_time")
        _parse_hhmm(self.close_time, "close_time")

    @property
    def overnight(self) -> bool:
        """True when a session opens the evening before its trade date."""
        if _midnight_close(self.close_time):
            return False
        return _parse_hhmm(self.open_time, "open_time") > _parse_hhmm(self.close_time, "close_time")

    def to_dict(self) -> dict:
        return asdict(self)

    def open_close_ns(self, trade_date: dt.date) -> tuple[int, int]:
        """UTC nanoseconds of the open and close of the session with this trade date."""
        zone = ZoneInfo(self.tz)
        open_day = trade_date - dt.timedelta(days=1) if self.overnight else trade_date
        opened = dt.datetime.combine(open_day, _parse_hhmm(self.open_time, "open_time"), tzinfo=zone)
        close_day = trade_date + dt.timedelta(days=1) if _midnight_close(self.close_time) else trade_date
        closed = dt.datetime.combine(close_day, _parse_hhmm(self.close_time, "close_time"), tzinfo=zone)
        return _to_ns(opened), _to_ns(closed)

    def sessions_between(self, start_ns: int, end_ns: int) -> "SessionTable":
        """Every weekday session whose span [open, next open) can hold a time in [start_ns, end_ns]."""
        if not (_TS_LOW <= int(start_ns) <= int(end_ns) <= _TS_HIGH):
            raise DataError(
                f"session calendar: times {int(start_ns)}..{int(end_ns)} ns are not between 1971 and 2200 "
                "(a corrupt or sentinel timestamp)"
            )
        first = _utc_date(start_ns) - dt.timedelta(days=4)
        last = _utc_date(end_ns) + dt.timedelta(days=4)
        dates, opens, closes = [], [], []
        day = first
        while day <= last:
            if self.weekends or day.weekday() < 5:
                o, c = self.open_close_ns(day)
                dates.append((day - EPOCH).days)
                opens.append(o)
                closes.append(c)
            day += dt.timedelta(days=1)
        return SessionTable(
            np.asarray(opens, np.int64), np.asarray(closes, np.int64), np.asarray(dates, np.int32)
        )

    def trade_dates(self, ts_ns) -> np.ndarray:
        """Trade date (days since 1970-01-01, int32) of each UTC-nanosecond timestamp."""
        ts_ns = np.asarray(ts_ns, dtype=np.int64)
        if ts_ns.size == 0:
            return np.zeros(0, np.int32)
        table = self.sessions_between(int(ts_ns.min()), int(ts_ns.max()))
        return table.trade_date[table.index_of(ts_ns)]


UTC_DAYS = SessionCalendar("UTC", "00:00", "24:00", weekends=True)
US_EQUITIES = SessionCalendar("America/New_York", "09:30", "16:00")


@dataclass(frozen=True)
class SessionTable:
    """Consecutive sessions: session k spans [open_ns[k], open_ns[k+1])."""

    open_ns: np.ndarray  # int64 [S] UTC ns of each open, increasing
    close_ns: np.ndarray  # int64 [S] UTC ns of each scheduled close
    trade_date: np.ndarray  # int32 [S] days since 1970-01-01

    def index_of(self, ts_ns) -> np.ndarray:
        idx = np.searchsorted(self.open_ns, np.asarray(ts_ns, np.int64), side="right") - 1
        if np.any(idx < 0):
            raise DataError("session calendar: timestamp before the first session of the table")
        return idx


def date_from_ordinal(days: int) -> dt.date:
    """Trade date from days since 1970-01-01."""
    return EPOCH + dt.timedelta(days=int(days))


def _to_ns(when: dt.datetime) -> int:
    delta = when - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * NS_PER_SECOND + delta.microseconds * 1000


def _utc_date(ts_ns: int) -> dt.date:
    return EPOCH + dt.timedelta(days=int(ts_ns) // NS_PER_DAY)
