"""A matplotlib figure without pyplot's global state, for every picture eval/ draws
(viz.py, neighbours.py, patch_pca.py)."""
from __future__ import annotations


def wrap(text: str, width: int) -> str:
    """Each line of a figure title wrapped to `width` characters."""
    import textwrap
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def new_figure(w: float, h: float, dpi: float = 100):
    """A matplotlib Figure on its own Agg canvas (no pyplot state), w x h inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig
