"""Every figure ancre-dit draws (Agg backend, no display). Callers import this package inside the
function that draws: commands that draw nothing never pay matplotlib's import."""
from .curves import plot_panels
from .depth_profile import plot_diagnosis, plot_diagnostics
from .grids import save_image_grid
from .topology import plot_topology_heatmap, plot_topology_panels, save_topology_gif

__all__ = ["plot_panels", "plot_diagnostics", "plot_diagnosis", "save_image_grid",
           "plot_topology_heatmap", "plot_topology_panels", "save_topology_gif"]
