"""MkDocs hook: Sphinx roles in docstrings (:class:`Foo`, :func:`bar`, :meth:`x`, ...)
render as links to the API pages, or as inline code where the target has no page.

The docstrings use Google style, which mkdocstrings renders, but many also name
other objects with Sphinx roles, which it leaves as text (``:class:<code>Foo</code>``
in the HTML). This hook rewrites each role once every page is rendered: a target
that resolves to an object documented somewhere in the site becomes an autorefs
cross-reference (a link, as mkdocstrings makes for the signatures); any other
becomes inline code, so that ``mkdocs build --strict`` has no unresolved reference
to fail on. It runs before autorefs turns references into links and before the
search index is built, so neither ever sees a role.

Sphinx's forms are understood: ``~a.b.C`` shows ``C``; ``.name`` and bare names are
looked up from the documented object the role appears in, outwards; ``title <target>``.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable

from mkdocs.plugins import event_priority
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

# How a role reaches the HTML: the role's name as text, its backquoted target as code.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const|type):<code>([^<]*)</code>")
# mkdocstrings' headings of the objects it documents, with their full (canonical) paths.
ANCHOR = re.compile(r'<h[1-6] id="((?:cerebro_automl|adapters)(?:\.\w+)+)" class="doc doc-heading"')
PACKAGE = "cerebro_automl"
# The API pages document the folder adapters/ by its own name; it installs as cerebro_automl.adapters.
ADAPTERS = re.compile(r"^cerebro_automl\.adapters\.")

_documented: set[str] = set()  # every object some API page renders, by full path


def on_pre_build(config) -> None:
    _documented.clear()


def on_page_content(html_text: str, page: Page, config, files: Files) -> str:
    _documented.update(ANCHOR.findall(html_text))
    return html_text


@event_priority(50)  # before autorefs (-50) resolves cross-references, and before the search index
def on_env(env, config, files: Files):
    for file in files:
        if file.page is not None and file.page.content:
            file.page.content = rewrite(file.page.content, _documented)
    return env


def rewrite(content: str, documented: set[str]) -> str:
    """``content`` with every role replaced by a cross-reference or inline code."""
    anchors = [(m.start(), m.group(1)) for m in ANCHOR.finditer(content)]

    def replace(match: re.Match) -> str:
        context = next((name for start, name in reversed(anchors) if start < match.start()), PACKAGE)
        title, target = split_role(html.unescape(match.group(1)))
        found = resolve(target, context, documented)
        code = f"<code>{html.escape(title)}</code>"
        return code if found is None else f'<autoref identifier="{found}" optional>{code}</autoref>'

    return ROLE.sub(replace, content)


def split_role(text: str) -> tuple[str, str]:
    """(what to show, the target) of a role's text: ``title <target>``, ``~a.b.C``, or a name."""
    titled = re.fullmatch(r"(.*?)\s*<([^>]+)>", text)
    if titled:
        return titled.group(1), titled.group(2).lstrip("~")
    if text.startswith("~"):
        target = text[1:]
        return target.rsplit(".", 1)[-1], target
    return text, text


def resolve(target: str, context: str, documented: set[str]) -> str | None:
    """The documented object ``target`` names, seen from the object ``context``, or None.

    As written if documented; else under each enclosing object of ``context``, the
    innermost first; else, for a dotted name or a class's, the documented object whose
    path ends with the target (a package's re-exports are documented under their
    defining module), the nearest to ``context`` when several do."""
    name = ADAPTERS.sub("adapters.", target.lstrip("."))
    if not name:
        return None
    if name in documented:
        return name
    for scope in _enclosing(context):
        if f"{scope}.{name}" in documented:
            return f"{scope}.{name}"
    if not (target.startswith(".") or "." in name or name[0].isupper()):
        return None  # a bare function or attribute name: only where it is in scope, as in Sphinx
    tail = name.split(".")
    for size in range(len(tail), 0, -1):
        suffix = "." + ".".join(tail[-size:])
        matches = [path for path in documented if path.endswith(suffix)]
        if matches:
            return max(matches, key=lambda path: (_shared(path, context), -len(path)))
    return None


def _enclosing(path: str) -> Iterable[str]:
    parts = path.split(".")
    return (".".join(parts[:i]) for i in range(len(parts), 0, -1))


def _shared(a: str, b: str) -> int:
    """How many leading path components ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):  # paths of different lengths
        if x != y:
            break
        count += 1
    return count
