"""Every package of the library is listed in pyproject.toml: an editable install
finds an unlisted one anyway, but a wheel would leave it out."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_package_is_listed_for_setuptools():
    listed = set(re.findall(r'"(cerebro_automl[\w.]*)"', (ROOT / "pyproject.toml").read_text()
                            .split("packages = [", 1)[1].split("]", 1)[0]))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cerebro_automl").rglob("*.py")}
    found.add("cerebro_automl.adapters")
    assert listed == found, f"pyproject.toml lists {sorted(listed)}; the packages are {sorted(found)}"
