"""scripts/launch_count.py: device operations per task, counted on fake "cuda" tensors."""

from __future__ import annotations

import importlib.util
import subprocess
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


def test_a_multi_step_task_launches_each_steps_work_and_uploads_once():
    launch_count = load_script()
    config = ROOT / "configs" / "all.toml"
    single = {row.cell_type: row for row in launch_count.count_step_launches(8, config, 1)}
    double = {row.cell_type: row for row in launch_count.count_step_launches(8, config, 2)}
    plain = {row.cell_type: row for row in launch_count.count_launches(8, config)}
    assert set(single) == set(double) == set(plain)
    for key, one in single.items():
        two, row = double[key], plain[key]
        assert (one.total, one.cell) == (row.gather + row.cell + row.scatter, row.cell), key  # a step, no downloads
        assert (two.steps, two.total, two.cell) == (2, 2 * one.total, 2 * one.cell), key  # each step the same work
        assert one.uploads == two.uploads == 1, key  # every step's slot lists in one copy
        graphs = one.total - one.cell + 1 if one.capturable else one.total  # a graph launch per step for its cell
        assert two.with_graphs == 2 * graphs, key
    assert double["lstm/layer0"].capturable and not double["childsum/node"].capturable
    table = launch_count.steps_table(list(double.values()))
    assert table.count("\n") == len(double) + 1 and "| `lstm/layer0` | 2 | 34 | 17 | 11 | 1 | 7 |" in table


def test_a_task_of_no_steps_is_refused():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch_count.py"), "--steps", "1", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr and not done.stdout
