"""experiments/notebooks/ablations.ipynb executes at SIZE=smoke, and every section shows its table and figure."""

import json
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "ablations.ipynb")
SECTIONS = [
    "1. DiLoCo against data parallel at equal tokens",
    "2. Synchronisation interval H at equal tokens",
    "3. Number of islands M at equal total tokens",
    "4. Pseudo-gradient codec",
    "5. Streaming fragments",
    "6. Token against uniform weighting with unequal islands",
    "7. Outer optimizer",
    "8. Islands with different data (non-IID) against IID islands",
    "9. Top-k pseudo-gradients (SparseLoCo) against int8 and int4 with error feedback",
    "10. The outer learning rate against M (Scaling Laws for DiLoCo's sweep)",
    "11. Experts merged by the tokens routed to them, on non-IID islands",
]


def sections(nb) -> dict[str, list]:
    """{section heading: the outputs of the code cells under it}."""
    found, current = {}, None
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            current = cell.source.splitlines()[0][3:].strip()
            found[current] = []
        elif cell.cell_type == "code" and current is not None:
            found[current] += cell.outputs
    return found


def test_the_committed_notebook_has_a_parameters_cell_and_every_section():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].source.startswith('SIZE = "full"')
    assert list(sections(nb)) == SECTIONS


def test_the_committed_notebook_holds_no_widget_state():
    """Progress-bar widgets (tqdm) leave their state in the file: 1.0 MB of it before it was stripped.

    Without it the notebook weighs about 675 KB, nearly all of it the eleven sections' figures; the bound leaves
    room for figures that come out a little larger when the notebook is run again.
    """
    with open(NOTEBOOK, encoding="utf-8") as f:
        text = f.read()
    nb = json.loads(text)
    assert "widgets" not in nb["metadata"]
    mimetypes = {key for cell in nb["cells"] for o in cell.get("outputs", []) for key in o.get("data", {})}
    assert not {m for m in mimetypes if "jupyter.widget" in m}, mimetypes
    assert "application/vnd.jupyter.widget" not in text
    assert os.path.getsize(NOTEBOOK) < 720_000, os.path.getsize(NOTEBOOK)


@pytest.mark.slow
def test_the_notebook_executes_at_smoke_with_a_table_and_a_figure_per_section(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("ISLAND_JAX_NOTEBOOK_SIZE", "smoke")
    monkeypatch.setenv("ISLAND_JAX_NOTEBOOK_WORKDIR", str(tmp_path / "ablations"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a cell that raises fails execute() with CellExecutionError, naming the cell
    NotebookClient(nb, timeout=480, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    setup = next(c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
    assert "SIZE=smoke" in "".join(o.get("text", "") for o in setup.outputs)
    found = sections(nb)
    assert list(found) == SECTIONS
    for name, outputs in found.items():
        data = [o.get("data", {}) for o in outputs if o.output_type in ("display_data", "execute_result")]
        tables = [d for d in data if 'class="dataframe' in d.get("text/html", "")]
        figures = [d for d in data if d.get("image/png")]
        assert tables and figures, f"section {name!r}: {len(tables)} tables, {len(figures)} figures"
    # every variant ran in its own folder under the workdir the environment named
    assert sorted(os.listdir(tmp_path / "ablations")) == [
        "codec", "diloco_vs_dp", "expert_merge", "fragments", "inner_steps", "islands", "non_iid", "outer_optimizer",
        "topk", "weighting",
    ]
