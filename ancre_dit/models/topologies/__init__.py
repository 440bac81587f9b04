"""Residual topologies: the interface (base.py), the name -> builder registry (registry.py), ANCRe and
its ablations (ancre.py), DenseFormer, HC and mHC (peers.py), DAR and AttnRes (depth_attention.py).
Importing the package registers them all."""
from . import ancre, peers, depth_attention  # noqa: F401  (registers the built-in topologies, in this order)
from .ancre import (ANCReTopology, LearnableScalarsTopology, OutgoingANCReTopology, UnnormalizedTopology,
                    first_previous_weights, fixed_dense_weights)
from .depth_attention import DepthAttentionTopology
from .aggregation import AGGREGATION_KERNELS
from .base import (HISTORY_DTYPES, CascadedTopology, FixedTopology, ResidualTopology, TopologyNotDefined,
                   WeightedHistoryTopology, configure_aggregation, load_topology_json, save_topology_json)
from .peers import DenseFormerTopology, HyperConnectionTopology, ManifoldHyperConnectionTopology, sinkhorn_knopp
from .registry import (TOPOLOGIES, TopologyEntry, TopologyOption, all_topology_options, build_topology,
                       register_topology, resolve_options, restore_topology, topology_entry, unregister_topology)
