"""docs/architecture.md names modules that exist, and its table of modules lists each once."""

from __future__ import annotations

import re

from conftest import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_module_the_architecture_names_exists():
    named = set(
        re.findall(r"`((?:manager|worker|common|clients|bench|scripts|tests|examples|deploy)/[\w/]+\.py)`", DOC)
    )
    assert len(named) > 40
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


def test_the_table_of_modules_lists_each_module_once():
    rows = [line for line in DOC.splitlines() if line.startswith("| ") and ".py`" in line.split("|")[-2]]
    listed = [path for row in rows for path in re.findall(r"`([\w/]+\.py)`", row.split("|")[-2])]
    assert listed and len(listed) == len(set(listed)), sorted({p for p in listed if listed.count(p) > 1})
