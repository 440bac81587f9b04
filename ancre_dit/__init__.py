"""ancre-dit: Diffusion Transformers whose residual connections are learned with ANCRe."""
__version__ = "0.1.0"
__all__ = ["DIT_MODELS", "DiT", "create_model", "convert_official_state_dict", "__version__"]


def __getattr__(name: str):
    """The model names load on first use: a command needing no model starts without timm and torchvision."""
    if name in __all__:
        from . import models
        return getattr(models, name)
    raise AttributeError(f"module 'ancre_dit' has no attribute {name!r}")
