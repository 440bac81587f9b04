"""Every figure ancre-dit draws (Agg, no display), imported inside the function that draws (matplotlib is slow)."""
from .curves import plot_panels
from .depth_profile import plot_diagnosis, plot_diagnostics
from .grids import save_image_grid
from .topology import plot_topology_heatmap, plot_topology_panels, save_topology_gif
