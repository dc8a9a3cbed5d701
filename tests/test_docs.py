"""The docs hold together: every relative link in README.md and docs/*.md resolves, and the
README stays one screen that opens with the two commands.

A link resolves when the file (or folder) it names exists, relative to the page it is on, and,
where it has an #anchor, when a heading of the target page makes that anchor the way GitHub
does (lowercase; every character but letters, digits, marks, `_`, `-` and spaces dropped;
spaces to `-`; a repeated heading gets -1, -2, ...). Links inside code (fenced blocks and
`inline` spans) are text, not links, and are not checked. External links (http:, mailto:, ...)
are not fetched.
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# The README's two commands, exactly (.ci/run runs the second verbatim).
TRAIN_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt '
                 '-e ".[test]" && python -m train')
TEST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt '
                '-e ".[test]" && python -m pytest -q')
README_MAX_LINES = 120

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of [brackets].
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")  # [label]: target
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str):
    """(line number, line) of each line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
            elif mark[0] == fence[0] and len(mark) >= len(fence) and not line.strip()[len(mark):].strip():
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger, on the rendered text)."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = page.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(HTML_ANCHOR.findall(line))
    return found


def links(page: Path):
    """(line number, target) of each link on a page, outside code."""
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        for m in LINK.finditer(line):
            yield number, m.group(1)
        m = REFERENCE.match(line)
        if m:
            yield number, m.group(1)


def broken_links(pages) -> tuple[list[str], int]:
    """Every relative link on the pages that does not resolve, as 'page:line: target (why)'."""
    problems, checked = [], 0
    cache: dict[Path, set[str]] = {}
    for page in pages:
        for number, target in links(page):
            if not target or EXTERNAL.match(target):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file: {dest})")
                continue
            if anchor:
                if dest.is_dir() or dest.suffix.lower() != ".md":
                    problems.append(f"{where} (an anchor into {dest.name}, which is not a markdown page)")
                    continue
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{where} (no heading of {dest.name} makes the anchor #{anchor})")
    return problems, checked


def test_every_relative_link_resolves():
    problems, checked = broken_links(PAGES)
    assert checked >= 20, f"only {checked} relative links found in {len(PAGES)} pages: is the parser broken?"
    assert not problems, f"{len(problems)} of {checked} relative links do not resolve:\n" + "\n".join(problems)


def test_readme_fits_a_screen_and_opens_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}"
    head = [line.strip() for line in lines[:15]]
    assert TRAIN_COMMAND in head, "README.md's first 15 lines lack the train command"
    assert TEST_COMMAND in head, "README.md's first 15 lines lack the test command"
    assert head.index(TRAIN_COMMAND) < head.index(TEST_COMMAND)


def test_ci_runs_the_documented_commands():
    """.ci/run runs the README's test command and the floor command of docs/TESTS.md, verbatim."""
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run in this checkout")
    commands = [line.strip() for line in ci.read_text().splitlines() if line.startswith("python3 -m venv")]
    assert TEST_COMMAND in commands
    floor = [c for c in commands if "constraints-floor.txt" in c]
    assert floor, ".ci/run has no floor command"
    tests_page = (ROOT / "docs" / "TESTS.md").read_text(encoding="utf-8").splitlines()
    for command in floor:
        assert command in (line.strip() for line in tests_page), f"docs/TESTS.md lacks .ci/run's {command!r}"


@pytest.mark.parametrize("heading, expected", [
    ("python -m zerofunc.plan", "python--m-zerofuncplan"),
    ("Train: python -m train", "train-python--m-train"),
    ("CI and the floor: torch 2.11", "ci-and-the-floor-torch-211"),
    ("Any `nn.Module`", "any-nnmodule"),
    ("Issue 13, first step: torch's fused AdamW on CPU (2026-11-23)",
     "issue-13-first-step-torchs-fused-adamw-on-cpu-2026-11-23"),
    ("~30M (29,788,160 parameters: 6 layers, width 640)", "30m-29788160-parameters-6-layers-width-640"),
    ("Stages 0–3 × [the docs](docs/X.md)", "stages-03--the-docs"),
])
def test_slug_is_githubs(heading, expected):
    assert slug(heading) == expected


def test_the_checker_finds_what_is_broken(tmp_path):
    """The link test could pass by finding nothing: here it must find each planted fault, and no other."""
    (tmp_path / "other.md").write_text("# A heading\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#a-heading) [ok](other.md#twice-1) [ok](#page) [ext](https://x.invalid/y)\n"
        "`[code](missing-in-code.md)`\n"
        "```\n[fenced](missing-in-fence.md)\n```\n"
        "[gone](missing.md)\n"
        "[no anchor](other.md#twice-2)\n"
        "![image](missing.png)\n"
        "[self](#nowhere)\n")
    problems, checked = broken_links([page])
    assert checked == 8
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "missing.md", "other.md#twice-2", "missing.png", "#nowhere"]
