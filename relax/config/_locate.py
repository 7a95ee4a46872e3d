"""Find the line of a key in TOML text, so config errors can say where to look.

``tomllib`` gives us values but no positions, so this module re-reads the (already valid) text
with a small structural scanner. It records, for every key it meets, the 1-based line where the
key is written, under its fully resolved path: ``[[actors]]`` headers are counted so the second
one's keys live under ``("actors", 1, ...)``, dotted and quoted keys are split, inline tables and
arrays (also ones spanning several lines) are entered. It never judges the TOML — ``tomllib``
already did — so on anything it does not understand it just stops recording.

Best effort by design: a wrong line number is an annoyance, a crash while reporting an error is
a disaster, so every failure here degrades to "no line".
"""

from __future__ import annotations

from collections.abc import Sequence

PathPart = str | int
Path = tuple[PathPart, ...]

_BARE_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}


class _Scanner:
    """One pass over the text; fills ``lines`` with ``path -> line``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.line = 1
        self.lines: dict[Path, int] = {}
        # Resolved path of each array of tables -> how many elements it has so far.
        self.array_tables: dict[Path, int] = {}

    # ------------------------------------------------------------------ low-level reading

    def _peek(self, offset: int = 0) -> str:
        index = self.pos + offset
        return self.text[index] if index < len(self.text) else ""

    def _advance(self, count: int = 1) -> None:
        for _ in range(count):
            if self.pos < len(self.text):
                if self.text[self.pos] == "\n":
                    self.line += 1
                self.pos += 1

    def _skip_spaces(self) -> None:
        while self._peek() in (" ", "\t"):
            self._advance()

    def _skip_comment(self) -> None:
        if self._peek() == "#":
            while self._peek() not in ("\n", ""):
                self._advance()

    def _skip_blank(self) -> None:
        """Skip spaces, newlines and comments (allowed between array items)."""
        while True:
            self._skip_spaces()
            self._skip_comment()
            if self._peek() in ("\n", "\r"):
                self._advance()
                continue
            return

    def _record(self, path: Path, line: int) -> None:
        self.lines.setdefault(path, line)

    # ------------------------------------------------------------------ keys

    def _read_string(self) -> str:
        """Read a basic or literal string (single or multi-line); return its value."""
        quote = self._peek()
        triple = self._peek(1) == quote and self._peek(2) == quote
        if triple:
            self._advance(3)
        else:
            self._advance()
        chars: list[str] = []
        while self.pos < len(self.text):
            char = self._peek()
            if triple and char == quote and self._peek(1) == quote and self._peek(2) == quote:
                self._advance(3)
                # A multi-line string may end with up to two extra quotes: """a"""" == 'a"'.
                while self._peek() == quote:
                    chars.append(quote)
                    self._advance()
                return "".join(chars)
            if not triple and char == quote:
                self._advance()
                return "".join(chars)
            if quote == '"' and char == "\\":
                nxt = self._peek(1)
                if nxt in _ESCAPES:
                    chars.append(_ESCAPES[nxt])
                    self._advance(2)
                    continue
                if nxt in ("u", "U"):
                    width = 4 if nxt == "u" else 8
                    digits = self.text[self.pos + 2 : self.pos + 2 + width]
                    try:
                        chars.append(chr(int(digits, 16)))
                    except ValueError:
                        pass
                    self._advance(2 + width)
                    continue
                # Line-ending backslash in a multi-line string, or something we do not need.
                self._advance(2)
                continue
            chars.append(char)
            self._advance()
        return "".join(chars)

    def _read_key(self) -> list[str]:
        """Read a possibly dotted key (bare or quoted parts) up to ``=`` or ``]``."""
        parts: list[str] = []
        while True:
            self._skip_spaces()
            char = self._peek()
            if char in ('"', "'"):
                parts.append(self._read_string())
            else:
                start = self.pos
                while self._peek() in _BARE_KEY_CHARS and self._peek() != "":
                    self._advance()
                if self.pos == start:
                    raise ValueError("expected a key")
                parts.append(self.text[start : self.pos])
            self._skip_spaces()
            if self._peek() == ".":
                self._advance()
                continue
            return parts

    # ------------------------------------------------------------------ values

    def _read_value(self, path: Path) -> None:
        """Skip one value, recording keys of inline tables and array items under ``path``."""
        char = self._peek()
        if char in ('"', "'"):
            self._read_string()
        elif char == "[":
            self._read_array(path)
        elif char == "{":
            self._read_inline_table(path)
        else:
            # Numbers, booleans, dates: run to the end of the token.
            while self._peek() not in (",", "]", "}", "\n", "\r", "#", ""):
                self._advance()

    def _read_array(self, path: Path) -> None:
        self._advance()  # [
        index = 0
        while True:
            self._skip_blank()
            if self._peek() in ("]", ""):
                self._advance()
                return
            self._record((*path, index), self.line)
            self._read_value((*path, index))
            self._skip_blank()
            if self._peek() == ",":
                self._advance()
            index += 1

    def _read_inline_table(self, path: Path) -> None:
        self._advance()  # {
        while True:
            self._skip_blank()
            if self._peek() in ("}", ""):
                self._advance()
                return
            line = self.line
            key = self._read_key()
            self._record_key(path, key, line)
            self._skip_spaces()
            if self._peek() != "=":
                raise ValueError("expected '='")
            self._advance()
            self._skip_spaces()
            self._read_value((*path, *key))
            self._skip_blank()
            if self._peek() == ",":
                self._advance()

    def _record_key(self, table: Path, key: Sequence[str], line: int) -> None:
        # A dotted key `a.b.c = 1` also "writes" tables a and a.b on this line.
        for depth in range(1, len(key) + 1):
            self._record((*table, *key[:depth]), line)

    # ------------------------------------------------------------------ statements

    def _resolve(self, parts: Sequence[str]) -> Path:
        """Turn header parts into a path, stepping into the latest element of arrays of tables."""
        resolved: list[PathPart] = []
        for part in parts:
            resolved.append(part)
            count = self.array_tables.get(tuple(resolved))
            if count:
                resolved.append(count - 1)
        return tuple(resolved)

    def scan(self) -> dict[Path, int]:
        table: Path = ()
        while True:
            self._skip_blank()
            if self.pos >= len(self.text):
                return self.lines
            line = self.line
            if self._peek() == "[":
                is_array = self._peek(1) == "["
                self._advance(2 if is_array else 1)
                parts = self._read_key()
                if is_array:
                    parent = self._resolve(parts[:-1])
                    array_path = (*parent, parts[-1])
                    count = self.array_tables.get(array_path, 0) + 1
                    self.array_tables[array_path] = count
                    self._record(array_path, line)
                    table = (*array_path, count - 1)
                else:
                    table = self._resolve(parts)
                # `[a.b]` also opens `a` (if nothing else did), so errors about `a` land here.
                for depth in range(1, len(table) + 1):
                    self._record(table[:depth], line)
                while self._peek() not in ("\n", ""):
                    self._advance()
                continue
            key = self._read_key()
            self._record_key(table, key, line)
            if self._peek() != "=":
                raise ValueError("expected '='")
            self._advance()
            self._skip_spaces()
            self._read_value((*table, *key))
            self._skip_spaces()
            self._skip_comment()


def key_lines(text: str) -> dict[Path, int]:
    """Map every key path written in ``text`` to its 1-based line (what could be scanned)."""
    scanner = _Scanner(text)
    try:
        return scanner.scan()
    except (ValueError, IndexError, RecursionError):
        return scanner.lines  # Whatever was found before the scanner got confused.


def locate(lines: dict[Path, int], path: Sequence[PathPart]) -> int | None:
    """Line of ``path``, or of its deepest written ancestor (e.g. the table header); else None."""
    parts = tuple(path)
    for depth in range(len(parts), 0, -1):
        line = lines.get(parts[:depth])
        if line is not None:
            return line
    return None


__all__ = ["key_lines", "locate"]
