"""One side of a comparison (the samples, or the reference): what the metric functions of the
table (metric_registry.py) read, its features and/or its FID statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .inception import InceptionFeatures
from .metrics import feature_statistics

_STAT_KEYS = {"pool": ("mu", "sigma"), "spatial": ("mu_s", "sigma_s")}  # the FID statistics' npz keys


@dataclass
class Side:
    """One side of the comparison: its features (when it has images) and its FID statistics."""
    name: str
    features: InceptionFeatures | None = None
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    num_images: int = 0
    stats_source: str = "features"
    image_size: int | None = None  # height of the images, when the side has images of one size

    def statistics(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) of the "pool" or "spatial" features: the stored ones, else the features'."""
        mu_key, sigma_key = _STAT_KEYS[kind]
        if mu_key not in self.stats:
            if self.features is None:
                raise UserError(f"{self.name} has no images and no stored {mu_key}/{sigma_key}; "
                                 f"add them (python evaluate.py --save-ref-stats) or pass images")
            self.stats[mu_key], self.stats[sigma_key] = feature_statistics(getattr(self.features, kind))
        return self.stats[mu_key], self.stats[sigma_key]

    def raw_features(self, kind: str) -> np.ndarray | None:
        """The side's own features of `kind` when its statistics are not stored ones, else None."""
        if self.features is None or (_STAT_KEYS[kind][0] in self.stats and self.stats_source == "stored"):
            return None
        return getattr(self.features, kind)

    def require_features(self, metric: str) -> InceptionFeatures:
        if self.features is None:
            raise UserError(f"{metric} needs images but {self.name} holds statistics only "
                             f"(no arr_0); pass a file with images, or drop {metric} from --metrics")
        return self.features
