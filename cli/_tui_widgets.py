"""Widgets of the ``relax status`` dashboard: a sparkline drawn against a fixed axis, the
dialog that confirms an operator action before it is sent, and the one that asks for a value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Input, Static

BARS = "▁▂▃▄▅▆▇█"


def axis(values: Sequence[float], known: tuple[float, float] | None = None) -> tuple[float, float]:
    """The range a sparkline of ``values`` is drawn against: the data's own range widened to
    include 0 and ``known`` (a metric's usual range, e.g. 0..1 for a reward), so a constant
    draws at its level — a reward stuck at 1.0 is a full bar, at 0.0 an empty one — instead of
    at the bottom, and a wiggle of 0.001 does not fill the whole height."""
    lo, hi = min(values, default=0.0), max(values, default=0.0)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if known is not None:
        lo, hi = min(lo, known[0]), max(hi, known[1])
    if hi <= lo:  # all zero (and no known range): any positive extent draws them at the floor
        hi = lo + 1.0
    return lo, hi


def bar_levels(values: Sequence[float], lo: float, hi: float, height: int) -> list[int]:
    """How many eighths of a cell (1 .. 8 * height) each value fills on the axis ``lo..hi``:
    proportional to its height above ``lo``, but never less than one eighth, so a series at the
    floor of its axis still shows as a line of ``▁``."""
    steps = 8 * height
    levels = []
    for v in values:
        ratio = min(max((v - lo) / (hi - lo), 0.0), 1.0)
        levels.append(max(1, round(ratio * steps)))
    return levels


class AxisSparklineRenderable:
    """Bars of ``values`` (the most recent on the right) on the axis ``lo..hi``."""

    def __init__(self, values: Sequence[float], lo: float, hi: float, style: str) -> None:
        self.values, self.lo, self.hi, self.style = list(values), lo, hi, Style.parse(style)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        height = options.height or 1
        values = self.values[-width:]
        # Few steps yet: widen each bar (by a whole number of columns) rather than leave the
        # chart a sliver at its right edge.
        repeat = max(1, width // len(values)) if values else 1
        levels = [
            level for level in bar_levels(values, self.lo, self.hi, height) for _ in range(repeat)
        ]
        pad = width - len(levels)
        for row in reversed(range(height)):  # top line first
            cells = []
            for level in levels:
                filled = level - 8 * row
                cells.append(" " if filled <= 0 else "█" if filled >= 8 else BARS[filled - 1])
            yield Segment(" " * pad)
            yield Segment("".join(cells), self.style)
            if row:
                yield Segment.line()


class AxisSparkline(Widget):
    """A sparkline with a visible scale: ``data`` drawn on :func:`axis` of it (and of
    ``known``); :meth:`scale_text` says what the axis and the data's min/max are."""

    DEFAULT_CSS = "AxisSparkline { height: 1fr; min-height: 3; }"

    def __init__(
        self,
        *,
        known: tuple[float, float] | None = None,
        style: str = "green",
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.known, self.bar_style = known, style
        self._data: list[float] = []

    @property
    def data(self) -> list[float]:
        return self._data

    @data.setter
    def data(self, values: Sequence[float]) -> None:
        self._data = [float(v) for v in values]
        self.refresh()

    @property
    def range(self) -> tuple[float, float]:
        """The axis the bars are drawn against."""
        return axis(self._data, self.known)

    def scale_text(self) -> str:
        if not self._data:
            return "no steps yet"
        lo, hi = self.range
        return f"min {min(self._data):.3g} · max {max(self._data):.3g} · axis {lo:.3g} to {hi:.3g}"

    def render(self) -> AxisSparklineRenderable:
        lo, hi = self.range
        return AxisSparklineRenderable(self._data, lo, hi, self.bar_style)


class Confirm(ModalScreen[bool]):
    """Asks one yes/no question: ``y`` (or Enter) answers yes, ``n`` or Escape no."""

    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Vertical { width: auto; max-width: 80; height: auto; padding: 1 2;
                         border: thick $warning; background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y,enter", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, id="question")
            yield Static("[b]y[/b] yes · [b]n[/b] / Esc no", id="choices")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class AskValue(ModalScreen[str | None]):
    """Asks for one value (a live setting): Enter sends what was typed, Escape cancels
    (``None``)."""

    DEFAULT_CSS = """
    AskValue { align: center middle; }
    AskValue > Vertical { width: 60; height: auto; padding: 1 2;
                          border: thick $accent; background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, placeholder: str = "") -> None:
        super().__init__()
        self.question, self.placeholder = question, placeholder

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, id="question")
            yield Input(placeholder=self.placeholder, id="value")
            yield Static("[b]Enter[/b] set · [b]Esc[/b] cancel", id="choices")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
