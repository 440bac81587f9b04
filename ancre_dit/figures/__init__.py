"""Every figure ancre-dit draws, on matplotlib's Agg backend (no display needed).

    curves         metric curves (one panel per metric, a band per group)
    depth_profile  the depth profile of a run (forward inflation, backward decay, redundancy, routing)
    grids          sample grids (ADM uint8 NHWC or float NCHW images)
    topology       learned-topology heatmaps: one, side by side, or animated

Callers import this package inside the function that draws: commands that draw nothing never pay
matplotlib's import."""
from .curves import plot_panels
from .depth_profile import plot_diagnosis, plot_diagnostics
from .grids import save_image_grid
from .topology import plot_topology_heatmap, plot_topology_panels, save_topology_gif

__all__ = ["plot_panels", "plot_diagnostics", "plot_diagnosis", "save_image_grid",
           "plot_topology_heatmap", "plot_topology_panels", "save_topology_gif"]
