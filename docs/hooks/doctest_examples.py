"""Griffe extension for the API pages: a docstring's ``Example:`` section renders
as code, like ``Examples:``.

Griffe's Google parser knows only the plural as a section of examples, whose
``>>>`` lines it renders as code; it shows the singular as an admonition of
Markdown text, where ``>>>`` starts three nested block quotes and ``>>> # ...``
a heading. The docstrings here say ``Example:`` (doctest reads either), so this
extension renames the section before the docstrings are parsed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# The section title alone on its line, at any indentation (as in Google style).
SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SINGULAR.sub(r"\1Examples:", obj.docstring.value)
