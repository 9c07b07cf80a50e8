"""Pictures the tooling draws (the simulator's, the serving sweep's): matplotlib, the `plots` extra."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a ValueError naming the extra when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'openinfer[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
