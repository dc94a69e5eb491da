"""scripts/launch_count.py: device operations per task, counted on fake "cuda" tensors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from test_cuda_fake import all_cells

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("launch_count", ROOT / "scripts" / "launch_count.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_counts_follow_the_task_structure():
    launch_count = load_script()
    rows = {row.cell_type: row for row in launch_count.count_launches(64, ROOT / "configs" / "all.toml")}
    specs = {spec.key: spec for spec in all_cells()[0]}
    assert set(rows) == set(specs)
    for key, row in rows.items():
        spec = specs[key]
        inline = sum(kind.dtype == "int64" for kind in spec.inputs)  # tokens arrive inline, copied over the rows
        assert row.gather == len(spec.inputs) + inline, key  # one gather per input, one copy per inline input
        assert row.cell >= 1, key
        assert row.scatter == len(spec.outputs), key  # one scatter per output
        assert row.downloads == 2 * len(spec.outputs), key  # a gather and a copy to the host per download
    # A cell that is one matrix product launches one kernel; an LSTM step launches several.
    assert rows["treelstm/classifier"].cell == 1
    assert rows["lstm/layer0"].cell > 5
    table = launch_count.table(list(rows.values()))
    assert table.count("\n") == len(rows) + 1 and "| `lstm/layer0` | 3 | 2 | 4 |" in table
