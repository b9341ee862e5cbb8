"""The README and the pages in docs/ link to each other: every relative link leads to a file that exists (and,
for a page, to a heading it has), and every page in docs/ can be reached from the README by following links."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(page: Path):
    """The relative links of a page's text, outside code blocks: (file, anchor)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        yield ((page.parent / path).resolve() if path else page), anchor


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_slugs_are_githubs():
    assert slug(" Settings of `train` and `verify`") == "settings-of-train-and-verify"
    assert slug(" Accumulation, clipping and fp16") == "accumulation-clipping-and-fp16"
    assert slug(" `polytrain generate`") == "polytrain-generate"


def test_every_relative_link_leads_to_a_file_and_a_heading():
    broken = []
    for page in pages():
        for target, anchor in links(page):
            where = f"{page.relative_to(ROOT)} -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{where}#{anchor}: no such heading")
    assert broken == []


def test_every_page_in_docs_is_reached_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo.extend(target for target, _ in links(page))
    assert sorted(str(p.relative_to(ROOT)) for p in set(pages()) - seen) == []
