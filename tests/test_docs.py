"""The project's Markdown documents stay well formed: every table row has its header's number of
cells (a row pasted into the wrong table, or a cell broken over several lines, fails here), and
no table repeats a row."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a literal bar, not a separator)."""
    body = line.strip()
    if not (body.startswith("|") and body.endswith("|")):
        raise ValueError(f"not a table row: {line!r}")
    return [c.strip() for c in re.split(r"(?<!\\)\|", body[1:-1])]


def tables(text: str) -> list[tuple[int, list[str], list[tuple[int, str]]]]:
    """``(header line number, header cells, [(line number, row)])`` of every table in ``text``
    (a header row followed by a ``|---|`` rule); line numbers from 1."""
    lines = text.split("\n")
    out, i = [], 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and _RULE.match(lines[i + 1]):
            j, rows = i + 2, []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, lines[j]))
                j += 1
            out.append((i + 1, cells(lines[i]), rows))
            i = j
        else:
            i += 1
    return out


def test_cells_and_tables():
    assert cells(r"| a | `x \| y` | b |") == ["a", r"`x \| y`", "b"]
    text = "x\n| a | b |\n|---|:-:|\n| 1 | 2 |\n| 3 |\n\ny"
    assert tables(text) == [(2, ["a", "b"], [(4, "| 1 | 2 |"), (5, "| 3 |")])]
    with pytest.raises(ValueError, match="not a table row"):
        cells("| a | b")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_tables_well_formed(path):
    problems = []
    for head_no, head, rows in tables(path.read_text()):
        seen = set()
        for no, row in rows:
            if not row.rstrip().endswith("|"):
                problems.append(f"line {no}: a row that does not end in '|' (a cell broken "
                                f"over lines?)")
                continue
            n = len(cells(row))
            if n != len(head):
                problems.append(f"line {no}: {n} cells, the header (line {head_no}) has "
                                f"{len(head)}")
            if row in seen:
                problems.append(f"line {no}: a repeated row")
            seen.add(row)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_architecture_data_flow_is_the_pass_list():
    """ARCHITECTURE.md's data-flow picture lists the plan-time passes as
    ``fxbackend.planning.describe_passes()`` prints them: every pass, in order."""
    from fxbackend.planning import describe_passes

    text = (ROOT / "ARCHITECTURE.md").read_text()
    picture = text.split("## Data flow\n```\n", 1)[1].split("\n```", 1)[0]
    listed = [ln.strip() for ln in picture.splitlines() if re.match(r"\s*\d+\. ", ln)]
    assert listed == [ln.strip() for ln in describe_passes().splitlines()]
