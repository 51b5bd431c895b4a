"""Tables the commands print, readable at any terminal width: never a number cut to ``7…``.

:func:`print_table` lays a table out in one of three ways, the first that fits the console's width:

1. rich's own table, every column at its natural width;
2. the same table with each column at least as wide as its longest value (a number, ``16 x 1000``) and its
   header's and prose cells' (``text`` columns: a configuration, a pruning reason) longest word, so that only
   headers and prose wrap, at spaces — the space left goes to the columns that need it least first;
3. when even that is too wide (an 80-column terminal and a dozen columns): one block per row — its ``key`` cells
   on a line, then ``header: value`` items, as many to a line as fit, no item split unless it is prose longer
   than a line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_ITEM_GAP = "   "
_WHOLE = {"break_long_words": False, "break_on_hyphens": False}  # textwrap: split at spaces only
_INDENT = "    "


def _words(s: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(w) for w in s.split()), default=0)


def table_widths(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                 text: Sequence[str] = (), min_width: Mapping[str, int] | None = None) -> list[int] | None | bool:
    """Column widths (without padding) that show every value whole in ``width`` cells: None when the natural
    widths fit (rich lays it out), False when nothing does (the block layout). ``min_width``: header -> the
    narrowest a prose column may get (fewer lines per cell)."""
    from rich.cells import cell_len

    n = len(headers)
    frame = 3 * n + 1  # a padding cell each side and a rule between columns and at both edges
    hi = [max([cell_len(h), *(cell_len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    if sum(hi) + frame <= width:
        return None
    lo = [min(hi[i], max(_words(h), (min_width or {}).get(h, 1),
                         *((_words(r[i]) if h in text else cell_len(r[i])) for r in rows)))
          for i, h in enumerate(headers)]
    spare = width - frame - sum(lo)
    if spare < 0:
        return False
    widths = list(lo)
    for i in sorted(range(n), key=lambda i: hi[i] - lo[i]):
        grow = min(hi[i] - lo[i], spare)
        widths[i] += grow
        spare -= grow
    return widths


def block_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, *, key: int = 1,
                bare: Sequence[str] = ()) -> list[str]:
    """The block layout (module docstring) as lines of at most ``width`` cells (prose longer than a line is
    wrapped at spaces). ``bare``: key headers whose values speak for themselves (printed without the header;
    ``#`` gives ``#1``)."""
    import textwrap

    from rich.cells import cell_len

    lines: list[str] = []
    room = max(20, width - len(_INDENT))
    for r in rows:
        head = []
        for h, v in zip(headers[:key], r[:key]):
            if v:
                head.append(f"#{v}" if h == "#" else v if h in bare else f"{h} {v}")
        lines += textwrap.wrap("  ".join(head), width, subsequent_indent=_INDENT, **_WHOLE) or [""]
        line = ""
        for h, v in zip(headers[key:], r[key:]):
            if v in ("", "-"):  # no value
                continue
            item = f"{h}: {v}"
            if line and cell_len(line) + len(_ITEM_GAP) + cell_len(item) <= room:
                line += _ITEM_GAP + item
                continue
            if line:
                lines.append(_INDENT + line)
            line = item
            if cell_len(item) > room:  # prose longer than a line: wrapped at spaces
                parts = textwrap.wrap(item, room, **_WHOLE)
                lines += [_INDENT + p for p in parts[:-1]]
                line = parts[-1]
        if line:
            lines.append(_INDENT + line)
    return lines


def print_table(console, title: str, headers: Sequence[str], rows: Sequence[Sequence], *,
                text: Sequence[str] = (), left: Sequence[str] | None = None, key: int = 1,
                bare: Sequence[str] = ("#", "configuration", "kind"), min_width: Mapping[str, int] | None = None
                ) -> None:
    """Print a table on ``console`` in the first layout of the module docstring that fits its width. ``text``:
    headers of prose columns (may wrap at spaces); ``left``: headers justified left (default ``text``); ``key``,
    ``bare``: the block layout's (:func:`block_lines`); ``min_width``: :func:`table_widths`'. Cells are shown as ``str`` (None as empty), never as
    markup."""
    from rich.table import Table
    from rich.text import Text

    rows = [["" if c is None else str(c) for c in r] for r in rows]
    headers = list(headers)
    left = text if left is None else left
    widths = table_widths(headers, rows, console.width, text, min_width)
    if widths is False:
        console.print(Text(title, style="italic"), justify="center")
        for line in block_lines(headers, rows, console.width, key=key, bare=bare):
            console.print(Text(line), soft_wrap=True)
        return
    t = Table(title=title)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if h in left else "right", overflow="fold",
                     width=None if widths is None else widths[i])
    for r in rows:
        t.add_row(*(Text(c) for c in r))
    console.print(t)
