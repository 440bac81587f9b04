"""ancre-dit: Diffusion Transformers whose residual connections are learned with ANCRe."""
from .models import DIT_MODELS, DiT, convert_official_state_dict, create_model

__version__ = "0.1.0"
__all__ = ["DIT_MODELS", "DiT", "create_model", "convert_official_state_dict", "__version__"]
