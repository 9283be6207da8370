"""`weft report --heatmap RESULTS.jsonl [...]`: a task's accuracy by depth x length, the picture
long-context retrieval is judged by (the needle-in-a-haystack heat map).

Reads `weft eval --task`'s per-question results (``--results``), grouping the questions by their
line's ``meta.depth`` (where the needle sits, 0 = the start of the context, 1 = its end) and
``meta.length`` (the context's tokens): one cell per (depth, length), its colour and number the
share answered right, red (0) to green (1). Several files: one panel each, side by side (one
rotary scaling each, say), titled by the file's name. A results row without both keys is a
message naming the file and line (exit 2).
"""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

from weft.core.errors import WeftError


def read_cells(path: pathlib.Path) -> dict[tuple[float, int], tuple[int, int]]:
    """(depth, length) -> (right, questions) of one results file."""
    if not path.is_file():
        raise WeftError(f"no such file: {path}; --heatmap takes `weft eval --task --results` files",
                        where="--heatmap")
    cells: dict[tuple[float, int], list[int]] = defaultdict(lambda: [0, 0])
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
            meta = row["meta"]
            key = (float(meta["depth"]), int(meta["length"]))
            right = bool(row["right"])
        except (ValueError, KeyError, TypeError):
            raise WeftError("not a results row with meta.depth and meta.length (a task line's \"meta\": {\"depth\": "
                            "0.5, \"length\": 4096} is copied into its row)", where=f"{path}:{number}") from None
        cells[key][0] += right
        cells[key][1] += 1
    if not cells:
        raise WeftError(f"{path} holds no results row", where="--heatmap")
    return {key: (right, total) for key, (right, total) in cells.items()}


def draw_heatmaps(paths: list[pathlib.Path], out: pathlib.Path) -> pathlib.Path:
    """One panel per results file, accuracy by depth (rows) and length (columns), as a PNG."""
    tables = [(path.stem, read_cells(path)) for path in paths]
    try:
        import matplotlib
    except ImportError:
        raise WeftError("weft report draws with matplotlib, which is not installed: pip install 'weft[report]'",
                        where="weft report") from None
    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables) + 1.2, 3.8), squeeze=False)
    image = None
    for ax, (name, cells) in zip(axes[0], tables):
        depths = sorted({d for d, _ in cells})
        lengths = sorted({n for _, n in cells})
        grid = [[cells[(d, n)][0] / cells[(d, n)][1] if (d, n) in cells else float("nan") for n in lengths]
                for d in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                if (d, n) in cells:
                    ax.text(j, i, f"{grid[i][j]:.0%}".replace("%", ""), ha="center", va="center", fontsize=8)
        right = sum(r for r, _ in cells.values())
        total = sum(t for _, t in cells.values())
        ax.set_title(f"{name}: {right}/{total}", fontsize=10)
        ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
        ax.set_xlabel("context (tokens)")
        if ax is axes[0][0]:  # the panels share their rows: one label, not one over the panel beside it
            ax.set_ylabel("depth of the needle")
    fig.colorbar(image, ax=list(axes[0]), label="accuracy", fraction=0.03)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def heatmap_lines(paths: list[pathlib.Path]) -> list[str]:
    """Each file's accuracy by length, for the terminal."""
    lines = []
    for path in paths:
        cells = read_cells(path)
        by_length: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for (_, n), (right, total) in cells.items():
            by_length[n][0] += right
            by_length[n][1] += total
        parts = ", ".join(f"{_tokens(n)} {r / t:.0%}" for n, (r, t) in sorted(by_length.items()))
        lines.append(f"{path.name}: {parts}")
    return lines


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
