"""DiT backbones and residual topologies (no diffusion, data or Accelerate in here)."""
from .convert import architecture_of, convert_official_state_dict, load_state_dict_checked, official_logit_layout
from .dit import DIT_MODELS, DiT, DiTBlock, create_model
from .topologies import (TOPOLOGIES, ResidualTopology, TopologyNotDefined, build_topology, load_topology_json,
                         register_topology, save_topology_json)
