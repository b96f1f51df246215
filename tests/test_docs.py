"""The manual cannot go stale: every code example in it runs here, and the site
builds with strict checking (a broken link or reference fails).

Pages take their Python from ``docs/snippets/*.py`` (``--8<-- "file:section"``);
each snippet file runs as a script on a few rows, most with ``executor="local"``.
The README's code blocks are sections of those same files.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS, SNIPPETS = ROOT / "docs", ROOT / "docs" / "snippets"
# Snippets that start Dask processes: cluster tests, as elsewhere in the suite.
CLUSTER = {"existing_cluster", "local_cluster", "tls_cluster", "replicas", "cluster_managers", "gangs"}
INCLUDE = re.compile(r'--8<-- "docs/snippets/(\w+)\.py:(\w+)"')


def _snippet_files() -> list[str]:
    return sorted(p.stem for p in SNIPPETS.glob("*.py") if p.stem != "tiny")


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def _sections(name: str) -> dict[str, str]:
    text = (SNIPPETS / f"{name}.py").read_text()
    sections = {}
    for start in re.finditer(r"# --8<-- \[start:(\w+)\]\n", text):  # sections may nest
        end = re.compile(rf"\n[ \t]*# --8<-- \[end:{start.group(1)}\]").search(text, start.end())
        if end is not None:
            body = re.sub(r"[ \t]*# --8<-- \[(?:start|end):\w+\]\n", "", text[start.end():end.start()] + "\n")
            sections[start.group(1)] = textwrap.dedent(body.rstrip("\n"))
    return sections


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.cluster) if n in CLUSTER else n
                                  for n in _snippet_files()])
def test_snippet_runs(name, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(SNIPPETS))
    done = subprocess.run([sys.executable, str(SNIPPETS / f"{name}.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]


def test_every_python_example_in_the_manual_comes_from_a_snippet_that_runs():
    """An inline ```python block would not run anywhere; an include must name a section
    that exists (a missing one would render as an empty block)."""
    for page in _pages():
        text = page.read_text()
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            lines = [line for line in block.splitlines() if line.strip()]
            assert lines and all(INCLUDE.search(line) for line in lines), \
                f"{page.relative_to(ROOT)} has a Python block not included from docs/snippets: {block[:200]}"
        for name, section in INCLUDE.findall(text):
            assert section in _sections(name), f"{page.relative_to(ROOT)} includes {name}.py:{section}, " \
                                               f"but {name}.py has no such section"


def test_readme_code_is_snippet_code():
    """The README shows sections of the snippet files verbatim, so its code runs too."""
    sections = [body for name in _snippet_files() for body in _sections(name).values()]
    blocks = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        assert block in sections, f"README block not found in docs/snippets: {block[:200]}"


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_readme_figures_are_in_the_benchmark_results():
    """Every figure of the README's headline table is quoted from the results file it names:
    each number in the figure, and each in the description of what was measured (the
    configurations, the workers, the target), appears there."""
    table = re.findall(r"^\| (.+?) \| (.+?) \| \[(\w+\.md)\]\((benchmarks/results/\w+\.md)\) \|$",
                       (ROOT / "README.md").read_text(), re.M)
    assert len(table) >= 5
    for what, figure, name, results in table:
        assert results.endswith("/" + name), (what, results)
        text = (ROOT / results).read_text()
        assert figure in text or all(_number_in(n, text) for n in re.findall(r"\d+(?:\.\d+)?(?:x|%)?", figure)), \
            (what, figure, results)
        for number in re.findall(r"\d+(?:\.\d+)?x?", what):
            assert _number_in(number, text), (what, number, results)


def test_the_manuals_home_page_shows_the_readmes_figures():
    """docs/index.md repeats the README's headline table, linking the generated Benchmarks pages."""
    row = r"^\| (.+?) \| (.+?) \| \[(\w+\.md)\]\((?:benchmarks/results|benchmarks)/\3\) \|$"
    readme = re.findall(row, (ROOT / "README.md").read_text(), re.M)
    home = re.findall(row, (DOCS / "index.md").read_text(), re.M)
    assert readme and home == readme


# What stands where content should: "*(The table: ...)*" and the like.
PLACEHOLDER = re.compile(r"\(\s*the table\b|\b(?:TODO|TBD|FIXME|XXX)\b", re.I)
# A line that is not prose: a heading, table row, fence, include, HTML comment, admonition,
# or one made only of links and images (a list item of them too). A list item of words is prose.
NOT_PROSE = re.compile(r"^\s*(?:#|\||```|--8<--|<!--|!!! |\?\?\? |:::)"
                       r"|^\s*(?:[-*+] |\d+\. )?(?:!?\[[^\]]*\]\([^)]*\)[\s,;]*)+$")
# How a sentence ends: its punctuation, then closing quotes, emphasis, code or brackets.
SENTENCE_END = re.compile(r"[.!?:][\"'*_`)\]]*$|\]\([^)]*\)[.!?:]?$")


def _page_problems(text: str) -> list[str]:
    """A page's placeholders, and whether it opens with something other than its
    title or ends mid-sentence (its last prose line, outside code blocks, does not
    end a sentence)."""
    problems = [f"placeholder: {line.strip()[:80]}" for line in text.splitlines() if PLACEHOLDER.search(line)]
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        problems.append(f"opens with {lines[0][:80] if lines else 'nothing'!r}, not its title")
    prose, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.strip() and not NOT_PROSE.search(line):
            prose.append(line.rstrip())
    if prose and not SENTENCE_END.search(prose[-1]):
        problems.append(f"ends mid-sentence: {prose[-1].strip()[-80:]!r}")
    return problems


@pytest.mark.parametrize("page", [*_pages(), ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_is_truncated_or_holds_a_placeholder(page):
    """A page that lost its end (a sentence broken off, another page's fragment at its
    top) or holds a placeholder where a results table should be fails here; tables are
    included from ``benchmarks/results`` (``--8<-- "benchmarks/results/x.md:section"``)."""
    assert not _page_problems(page.read_text()), (str(page.relative_to(ROOT)), _page_problems(page.read_text()))


def test_the_page_check_finds_truncated_pages_and_placeholders():
    """The shapes the check exists for: pages that were committed broken."""
    whole = "# Title\n\nA sentence.\n\n- an item\n  that goes on.\n\n```python\nx = (\n```\n"
    assert _page_problems(whole) == []
    assert _page_problems("# T\n\nIt ends with [a link](x.md).\n\n| a | b |\n|---|---|\n") == []
    assert _page_problems("# T\n\nThe list:\n\n- [one](one.md)\n- [two](two.md)\n") == []
    truncated = "# Promises\n\n- **The fault campaign**: a search, with a config that allocates 3 GB in its\n"
    assert any("mid-sentence" in p for p in _page_problems(truncated))
    fragment = "# TLS\n\nA test runs a search on a TLS cluster made with `Security.temporary()` and\n"
    assert any("mid-sentence" in p for p in _page_problems(fragment))
    assert any("title" in p for p in _page_problems("`unit_timeout`, and healthy MLPs.\n# TLS\n"))
    placeholder = "# GPUs\n\n*(The table: [benchmarks/results/gpu.md](../benchmarks/gpu.md).)*\n\nMore.\n"
    assert any("placeholder" in p for p in _page_problems(placeholder))


def _number_in(number: str, text: str) -> bool:
    """``number`` stands in ``text`` as a number of its own (not inside a longer one)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d]|\.\d)", text) is not None


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_site_builds_strict(tmp_path):
    """mkdocs --strict: every page's links and anchors resolve, every API reference is found."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index.html", "api/session/index.html", "guides/tuners/optuna/index.html",
                 "benchmarks/strategies/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    api = (tmp_path / "site/api/session/index.html").read_text()
    assert 'id="cerebro_automl.session.Session.add"' in api  # generated from the docstrings
    # Sphinx roles in docstrings became links (or inline code), in the pages and the search index
    for path in [*(tmp_path / "site").rglob("*.html"), tmp_path / "site/search/search_index.json"]:
        assert not re.search(r":(class|func|meth|attr|mod|exc|obj):(<code>|`)", path.read_text()), path
    assert re.search(r'<a class="autorefs[^>]*href="../callbacks/#cerebro_automl.callbacks.Callback">'
                     r"<code>Callback</code></a>", api)
    # Docstrings' "Example:" doctests render as code, not as nested block quotes and headings
    for page in (tmp_path / "site/api").rglob("*.html"):
        assert "<blockquote>" not in page.read_text(), page
    assert '<span class="gp">&gt;&gt;&gt; </span>' in api


def _roles_hook():
    spec = importlib.util.spec_from_file_location("roles_hook", DOCS / "hooks" / "roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_sphinx_roles_become_cross_references_or_code():
    roles = _roles_hook()
    page = ('<h2 id="cerebro_automl.session.Session" class="doc doc-heading">Session</h2>'
            '<h3 id="cerebro_automl.session.Session.status" class="doc doc-heading">status</h3>'
            "<p>:meth:<code>status</code>, :class:<code>~cerebro_automl.Session</code>, "
            ":class:<code>StalledError</code>, :func:<code>cerebro_automl.adapters.optuna.optimize</code>, "
            ":func:<code>close</code>, :class:<code>the hook &lt;cerebro_automl.callbacks.Callback&gt;</code></p>")
    documented = set(roles.ANCHOR.findall(page)) | {"adapters.optuna.optimize", "cerebro_automl.callbacks.Callback"}
    out = roles.rewrite(page, documented)
    assert '<autoref identifier="cerebro_automl.session.Session.status" optional><code>status</code>' in out
    assert '<autoref identifier="cerebro_automl.session.Session" optional><code>Session</code>' in out
    assert '<autoref identifier="adapters.optuna.optimize" optional>' in out  # the installed name of adapters/
    assert '<autoref identifier="cerebro_automl.callbacks.Callback" optional><code>the hook</code>' in out
    assert "<code>StalledError</code>," in out and "<code>close</code>," in out  # documented nowhere: code
    assert ":class:" not in out and ":func:" not in out and ":meth:" not in out
