"""The instance page's time scale: where a moment falls on the timeline, and its ticks.

A run may last 50 ms or 3 days, and may sit idle for a day between two steps of a minute.
So the scale is relative to the run's first start (ticks read "+0 s", "+10 s", "+2 h", chosen
for the span shown), and an idle gap that would take most of the width (no attempt running
for longer than a fifth of what remains shown) is compressed to a narrow break, marked with
the time it skips. Between breaks, time is linear. A bar is never narrower than `MIN_BAR`,
so a 1 ms attempt in a 3-day run still shows (and can be hovered and focused); and the
attempts of a step keep at least `MIN_GAP` between them, so two 50 ms attempts beside a 2-hour
step read as two bars, not one sliver.

Positions are percents of the timeline's width: the lanes' labels take the first `LABEL`,
the bars the next `AREA`.
"""

import itertools
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

LABEL, AREA = 22.0, 76.0
MIN_BAR = 0.4  # percent of the width: about 4 px on a 1,000 px timeline
MIN_GAP = 0.5  # percent: the least room between two attempts of a lane (3 px at 640 px)
BREAK = 4.0  # the width of a compressed gap, in percent
GAP_SHARE = 0.2  # a gap longer than this share of the time still shown is compressed
TICK_ROOM = 7.5  # ticks (and breaks) at least this many percent apart, so labels never overlap
ROOM = 0.05  # room past the end while a step runs, so its bar grows before the scale changes

# Tick steps in milliseconds: 1-2-5 below a second, then round numbers of each unit.
SECOND, MINUTE, HOUR, DAY = 1000, 60_000, 3_600_000, 86_400_000
STEPS = [
    *(m * 10**e for e in range(3) for m in (1, 2, 5)),
    *(s * SECOND for s in (1, 2, 5, 10, 15, 30)),
    *(m * MINUTE for m in (1, 2, 5, 10, 15, 30)),
    *(h * HOUR for h in (1, 2, 3, 6, 12)),
    *(d * DAY for d in (1, 2, 7, 14, 30)),
]
UNITS = [("d", DAY), ("h", HOUR), ("min", MINUTE), ("s", SECOND)]


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of time drawn linearly, from `start` to `end` ms after the first start, at
    `x` percent of the width, `pct_per_ms` percent per millisecond."""

    start: float
    end: float
    x: float
    pct_per_ms: float


@dataclass(frozen=True, slots=True)
class Gap:
    """A compressed idle gap: its break mark at `x`, `BREAK` wide, skipping `skipped`."""

    x: float
    skipped: str
    label: str


@dataclass(frozen=True, slots=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True, slots=True)
class Scale:
    first: datetime
    end: float  # ms after `first` where the scale ends
    segments: list[Segment]
    gaps: list[Gap]
    ticks: list[Tick]

    def x(self, moment: datetime) -> float:
        """Where a moment falls, in percent of the width."""
        ms = (moment - self.first) / timedelta(milliseconds=1)
        for segment in self.segments:
            if ms <= segment.end:
                ms = max(ms, segment.start)
                return segment.x + (ms - segment.start) * segment.pct_per_ms
        last = self.segments[-1]
        return last.x + (last.end - last.start) * last.pct_per_ms

    def bar(self, start: datetime, end: datetime) -> tuple[float, float]:
        """A bar's `x` and width in percent: at least `MIN_BAR` wide, within the area."""
        x0, x1 = self.x(start), self.x(end)
        width = max(x1 - x0, MIN_BAR)
        x0 = min(x0, LABEL + AREA - width)
        return round(x0, 3), round(width, 3)


def separate(bars: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A lane's bars (`x`, width; in attempt order) placed apart: each starts at least
    `MIN_GAP` after the one before it ends (shortened to keep its end, never below `MIN_BAR`),
    and the last ends within the area (those before it moved back to keep the gaps)."""
    placed: list[tuple[float, float]] = []
    for x, width in bars:
        if placed and x < (after := placed[-1][0] + placed[-1][1] + MIN_GAP):
            width = max(x + width - after, MIN_BAR)
            x = after
        placed.append((x, width))
    limit = LABEL + AREA
    for i in reversed(range(len(placed))):
        x, width = placed[i]
        x = max(min(x, limit - width), LABEL)
        placed[i] = (round(x, 3), round(width, 3))
        limit = x - MIN_GAP
    return placed


def duration(seconds: float) -> str:
    """A short human duration: 350 ms, 12.3 s, 4 min 12 s, 2 h 5 min, 3 d 4 h."""
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds) * SECOND
    for (unit, size), (small, small_size) in itertools.pairwise(UNITS):
        if whole >= size:
            rest = (whole % size) // small_size
            return f"{whole // size} {unit}" + (f" {rest} {small}" if rest else "")
    raise AssertionError("unreachable")


def offset(ms: float, step: float) -> str:
    """A tick's label: `ms` after the first start, in the units the tick step needs ("+0 s",
    "+250 ms", "+1.5 s", "+1 d 6 h"); zero units in between are left out."""
    if step < SECOND:
        return f"+{ms:g} ms" if ms < SECOND else f"+{ms / SECOND:g} s"
    smallest = max(size for _, size in UNITS if size <= step)
    parts, rest = [], round(ms)
    for unit, size in UNITS:
        if size < smallest:
            break
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count} {unit}")
    name = next(unit for unit, size in UNITS if size == smallest)
    return "+" + (" ".join(parts) or f"0 {name}")


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The stretches when some attempt ran: overlapping or touching intervals merged."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def scale(
    intervals: list[tuple[datetime, datetime]], *, running: bool, now: datetime
) -> Scale | None:
    """The scale for attempts running over `intervals` (a running one ends now); None
    without any. While a step runs, the scale has `ROOM` to spare past now."""
    if not intervals:
        return None
    first = min(start for start, _ in intervals)
    one = timedelta(milliseconds=1)
    spans = [((s - first) / one, max((e - first) / one, (s - first) / one)) for s, e in intervals]
    busy = _busy(spans)
    total = max(busy[-1][1], 1.0)
    # Which gaps to compress: the longest first, while each is a large share of what is left.
    gaps = sorted(((busy[i + 1][0] - busy[i][1], i) for i in range(len(busy) - 1)), reverse=True)
    shown = total
    cut: set[int] = set()
    for length, index in gaps:
        if length <= GAP_SHARE * (shown - length) or length <= 0:
            break
        cut.add(index)
        shown -= length
    # The stretches drawn linearly: busy ones with the gaps kept between them.
    stretches: list[tuple[float, float]] = []
    start = 0.0
    for i, (_, end) in enumerate(busy):
        if i in cut or i == len(busy) - 1:
            stretches.append((start, end))
            if i + 1 < len(busy):
                start = busy[i + 1][0]
    end_ms = total + (max(total, 1.0) * ROOM if running else 0.0)
    stretches[-1] = (stretches[-1][0], end_ms)
    shown = sum(b - a for a, b in stretches)
    pct_per_ms = (AREA - BREAK * len(cut)) / max(shown, 1.0)
    segments, breaks = [], []
    x = LABEL
    for i, (a, b) in enumerate(stretches):
        segments.append(Segment(a, b, x, pct_per_ms))
        x += (b - a) * pct_per_ms
        if i + 1 < len(stretches):
            skipped = stretches[i + 1][0] - b
            text = duration(skipped / SECOND)
            breaks.append(Gap(round(x, 3), text, f"{text} with no step running, not drawn"))
            x += BREAK
    return Scale(first, end_ms, segments, breaks, _ticks(segments, breaks, shown))


def _ticks(segments: list[Segment], gaps: list[Gap], shown: float) -> list[Tick]:
    """Ticks at round multiples of a step chosen so about 8 fit in the time shown, placed in
    each segment, none closer than `TICK_ROOM` to another or to a break."""
    step = next((s for s in STEPS if shown / s <= 8), STEPS[-1])
    taken = [gap.x + BREAK / 2 for gap in gaps]
    ticks: list[Tick] = []
    for segment in segments:
        k = math.ceil(segment.start / step)  # the first multiple of the step in the segment
        while (value := k * step) <= segment.end:
            k += 1
            x = segment.x + (value - segment.start) * segment.pct_per_ms
            if x <= LABEL + AREA and all(abs(x - other) >= TICK_ROOM for other in taken):
                ticks.append(Tick(round(x, 3), offset(value, step)))
                taken.append(x)
    return ticks
