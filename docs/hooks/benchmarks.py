"""MkDocs hook: the Benchmarks pages come from ``benchmarks/results`` at build time.

Each ``benchmarks/results/*.md`` (and the pictures beside it) becomes a page under
``benchmarks/`` in the site, listed in the navigation after the commentary page, so
the manual never holds a hand-made copy of a results table.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SUFFIXES = (".md", ".png", ".svg")


def _results() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.suffix in SUFFIXES)


def on_files(files: Files, config) -> Files:
    for path in _results():
        content = path.read_text() if path.suffix == ".md" else path.read_bytes()
        files.append(File.generated(config, f"benchmarks/{path.name}", content=content))
    return files


def on_nav(nav: Navigation, config, files: Files) -> Navigation:
    section = next(item for item in nav.items if isinstance(item, Section) and item.title == "Benchmarks")
    for path in _results():
        if path.suffix == ".md":
            file = files.get_file_from_path(f"benchmarks/{path.name}")
            section.children.append(Page(_title(path), file, config))
    return nav


def _title(path: Path) -> str:
    """The results file's own heading, without the run's date."""
    first = path.read_text().splitlines()[0].lstrip("# ").strip()
    first = re.sub(r" \(20\d\d-[^)]*\)", "", first).split(" —")[0]
    return first.rstrip(":;, ") or path.stem


def on_page_markdown(markdown: str, page: Page, config, files: Files) -> str:
    if page.file.src_uri != "benchmarks/index.md":
        return markdown
    pages = "\n".join(f"- [{_title(p)}]({p.name})" for p in _results() if p.suffix == ".md")
    return markdown.replace("<!-- results pages -->", f"The results pages:\n\n{pages}")
