"""A Static for text that is redrawn often: unchanged text costs nothing, and only a change
in the number of lines asks for a layout pass (the expensive part of a redraw)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class TextPanel(Static):
    _shown: Text | None = None

    def show_text(self, text: Text) -> None:
        last = self._shown
        if last is not None and text == last:
            return
        same_height = last is not None and text.plain.count("\n") == last.plain.count("\n")
        self._shown = text
        self.update(text, layout=not same_height)
