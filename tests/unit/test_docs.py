# The user docs: every relative link and #anchor resolves, README.md stays short enough to read, and
# perf/README.md lists every committed result.
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "perf" / "README.md", ROOT / "openai_frontend" / "README.md",
               *(ROOT / "docs").glob("*.md")])
README_MAX_BYTES = 15 * 1024

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"`+[^`\n]*`+")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text outside fenced code blocks, where a link is a link."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, only letters, digits, '-', '_' and
    spaces kept, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set(_HTML_ID.findall(text))
    for _, title in _HEADING.findall(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    return _LINK.findall(_CODE.sub("", text)) + _REF_DEF.findall(text)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {_shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_shown(dest)}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    assert broken_links(doc) == []


def test_readme_is_under_15_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/ and link to it"


def test_every_committed_result_is_listed_in_perf_readme():
    listed = {(ROOT / "perf" / t).resolve() for t in links(ROOT / "perf" / "README.md") if t.startswith("results/")}
    unlisted = sorted(p.name for p in (ROOT / "perf" / "results").iterdir() if p.resolve() not in listed)
    assert unlisted == [], "perf/README.md lists each file of perf/results/ (Current results or Earlier results)"


def test_the_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Known `limits`, in short\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n[ok](other.md#known-limits-in-short) [self](#doc) [web](https://example.com/x)\n"
                   "[gone](missing.md) [no anchor](other.md#known-issues) ![img](img/none.png)\n"
                   "```\n[in code](not-checked.md)\n```\n")
    assert broken_links(doc) == [
        "missing.md: no file missing.md",
        "other.md#known-issues: no heading #known-issues in other.md",
        "img/none.png: no file none.png",
    ]
