"""Every relative link of README.md and of docs/**/*.md resolves.

A link's path must name an existing file (or directory), relative to the file that links; a
`#fragment` into a Markdown file (or a bare `#fragment`, into the linking file itself) must be
the anchor of one of its headings, by GitHub's rules: the heading's text lowercased, punctuation
dropped except `-` and `_`, spaces turned into `-`, and `-1`, `-2`, ... added to repeats.
http(s) and mailto links are not followed. Code blocks and code spans hold no links."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_FENCE_CLOSE = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*$")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)  # never across a blank line
# [text](target) and ![alt](target); the target may be <bracketed> and followed by a title.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>]*>|\S+)", re.M)
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_EXTERNAL = re.compile(r"^(?:https?|mailto):", re.I)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            opening = _FENCE.match(line)
            if opening:
                fence = opening.group(1)
            else:
                lines.append((number, line))
            continue
        closing = _FENCE_CLOSE.match(line)
        if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence):
            fence = None
    return lines


def _strip_code_spans(text: str) -> str:
    """`text` with every code span blanked out, line breaks kept."""
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _heading_text_to_anchor(text: str) -> str:
    """GitHub's anchor for a heading whose Markdown source is `text`."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), text)  # code spans: their content
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(?<![\w])_{1,2}(?=\S)(.+?)(?<=\S)_{1,2}(?![\w])", r"\1", text)  # _emphasis_
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link may point at in the Markdown file `path`."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set()
    seen: dict[str, int] = {}

    def add(heading: str) -> None:
        anchor = _heading_text_to_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")

    previous = ""
    for _, line in _prose_lines(text):
        atx = _ATX.match(line)
        if atx:
            add(atx.group(2) or "")
        elif _SETEXT.match(line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", "+", ">")) and not _ATX.match(previous):
            add(previous)
        found.update(_HTML_ANCHOR.findall(line))
        previous = line
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the Markdown file `path`, code excluded. A link's
    text may run over several lines."""
    text = path.read_text(encoding="utf-8")
    kept = dict(_prose_lines(text))
    prose = "\n".join(kept.get(number, "") for number in range(1, text.count("\n") + 2))
    prose = _strip_code_spans(prose)
    found = []
    for pattern in (_INLINE_LINK, _REFERENCE_DEF):
        for match in pattern.finditer(prose):
            found.append((match.start(1), match.group(1)))
    return [
        (prose.count("\n", 0, start) + 1, target.removeprefix("<").removesuffix(">")) for start, target in sorted(found)
    ]


def broken_links(path: Path) -> list[str]:
    """One line per link of `path` that does not resolve."""
    problems = []
    for number, target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            problems.append(f"{where}: a scheme that is neither http(s) nor mailto")
            continue
        link_path, _, fragment = target.partition("#")
        link_path = unquote(link_path.split("?", 1)[0])
        resolved = (path.parent / link_path).resolve() if link_path else path
        if not resolved.exists():
            problems.append(f"{where}: no such file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
            continue
        if fragment and resolved.is_file() and resolved.suffix.lower() == ".md":
            if unquote(fragment) not in anchors(resolved):
                problems.append(f"{where}: no heading of {resolved.relative_to(ROOT)} has the anchor #{fragment}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Durable admissions (optional)", "durable-admissions-optional"),
        ("The local gateway: `iris-lab up`", "the-local-gateway-iris-lab-up"),
        ("Nothing of the client's identity reaches a third party", "nothing-of-the-clients-identity-reaches-a-third-party"),
        ("On a quiet machine, with the floor (2026-12-01 11:31-12:00 UTC)", "on-a-quiet-machine-with-the-floor-2026-12-01-1131-1200-utc"),
        ("`max_pinned_sessions` and [links](x.md)", "max_pinned_sessions-and-links"),
        ("4. Where the ext_proc time goes", "4-where-the-ext_proc-time-goes"),
    ],
)
def test_anchors_follow_githubs_rules(heading, anchor):
    assert _heading_text_to_anchor(heading) == anchor


def test_a_broken_link_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Some section\n\n"
        "[ok](b.md#other) [ok](#some-section) [ok](https://example.com/x) `[code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n# not a heading\n```\n"
        "[missing](nowhere.md) [bad anchor](b.md#nope) [bad local](#not-a-heading) [a link\n"
        "over two lines](#gone)\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("Other\n=====\n", encoding="utf-8")
    problems = broken_links(tmp_path / "a.md")
    assert [p.split(": (", 1)[1].split(")", 1)[0] for p in problems] == ["nowhere.md", "b.md#nope", "#not-a-heading", "#gone"]
