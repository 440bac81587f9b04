"""Metric name -> its function, what it reads, its direction and label: the one place a metric
name is interpreted.

evaluate.py's --metrics (choices, default, help), the config's eval.metrics checks, the
in-training evaluation, `pipeline.score` and the run comparisons (which direction is better) all
read `METRICS`. A new metric is its function and one entry here.

A metric function is `compute(samples, reference, options) -> {value name: value}`; what the two
sides are depends on the network whose features it reads (`features`):
- "inception": two `Side` (Inception features and/or FID statistics); the reference may be
  `Side("reference (none)")` for a metric that needs nothing of it;
- "dinov2": the samples' DINOv2 features (N, D), and the reference's (mu, sigma) or its features;
- "digits": (features, predicted classes, labels) of the samples from the digits classifier, and
  None (the classifier's own held-out digits are the reference).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..errors import UserError
from .inception import InceptionFeatures
from .metrics import (
    feature_statistics, frechet_distance, frechet_distance_to_features, inception_score, kernel_inception_distance,
    precision_recall,
)

FEATURES = ("digits", "inception", "dinov2")
_STAT_KEYS = {"pool": ("mu", "sigma"), "spatial": ("mu_s", "sigma_s")}  # the FID statistics' npz keys


@dataclass
class Side:
    """One side of a comparison (the samples, or the reference), as the Inception metrics read it:
    its features (when it has images) and/or its FID statistics."""
    name: str
    features: InceptionFeatures | None = None
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    num_images: int = 0
    stats_source: str = "features"
    image_size: int | None = None  # height of the images, when the side has images of one size
    images: Any = None  # what holds its images, read for its features: an (N, H, W[, C]) array or image files

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


@dataclass(frozen=True)
class MetricOptions:
    """The metric settings evaluate.py exposes (defaults are ADM's)."""
    is_split_size: int = 5000
    pr_k: int = 3
    pr_batch_size: int = 10000
    fid_method: str = "sqrtm"
    kid_subsets: int = 100
    kid_subset_size: int = 1000
    device: str | torch.device | None = None


@dataclass(frozen=True)
class Value:
    """One number a metric reports."""
    label: str
    lower_is_better: bool


@dataclass(frozen=True)
class MetricEntry:
    compute: Callable[[Any, Any, MetricOptions], dict[str, float]]
    features: str          # the network whose features it reads: one of FEATURES
    # What it needs of the reference: "features" (nothing: the samples' features alone), "statistics"
    # (the reference's, stored in its npz or computed from its images) or "reference images".
    needs: str
    lower_is_better: bool  # of its main value
    label: str             # of its main value, as tables print it
    help: str              # one line
    key: str | None = None  # the name of its main value when not the metric's own
    also: Mapping[str, Value] = field(default_factory=dict)  # further values it reports
    stats: tuple[str, ...] = ()  # the reference npz keys that stand in for the reference's images
    evaluate: bool = True   # offered by evaluate.py --metrics
    default: bool = False   # in evaluate.py's default set (ADM's five)
    training: bool = True   # offered as eval.metrics
    only_for: tuple[str, str] | None = None  # (data.kind, in words) of the only data it scores; None: any

    def values(self, name: str) -> dict[str, Value]:
        """Every value this metric (registered as `name`) reports, main one first."""
        return {self.key or name: Value(self.label, self.lower_is_better), **self.also}


# -- the metric functions ------------------------------------------------------------------------
def frechet(name: str, kind: str, samples: Side, ref: Side, o: MetricOptions) -> dict[str, float]:
    """FID ("pool" features) or sFID ("spatial"); "eigh" takes the N-dim route when a side has
    N <= D images of its own."""
    if o.fid_method == "eigh":
        for side, other in ((samples, ref), (ref, samples)):
            feats = side.raw_features(kind)
            if feats is not None and len(feats) <= feats.shape[1]:
                return {name: frechet_distance_to_features(feats, *other.statistics(kind))}
    return {name: frechet_distance(*samples.statistics(kind), *ref.statistics(kind), method=o.fid_method)}


def inception_score_metric(samples: Side, ref: Side, o: MetricOptions) -> dict[str, float]:
    return {"is": inception_score(samples.require_features("is").logits, split_size=o.is_split_size)}


def precision_and_recall(samples: Side, ref: Side, o: MetricOptions) -> dict[str, float]:
    """Both in one pass (the neighbourhoods of both sets are needed for either)."""
    precision, recall = precision_recall(ref.require_features("precision").pool,
                                         samples.require_features("precision").pool,
                                         k=o.pr_k, batch_size=o.pr_batch_size, device=o.device)
    return {"precision": precision, "recall": recall}


def kid(samples: Side, ref: Side, o: MetricOptions) -> dict[str, float]:
    mean, std = kernel_inception_distance(ref.require_features("kid").pool, samples.require_features("kid").pool,
                                          subsets=o.kid_subsets, subset_size=o.kid_subset_size)
    return {"kid": mean, "kid_std": std}


def fd_dinov2(samples: np.ndarray, ref: tuple[np.ndarray, np.ndarray] | np.ndarray,
              o: MetricOptions) -> dict[str, float]:
    """Against the reference's (mu, sigma) (stored, or computed once from its features) or its features."""
    if isinstance(ref, tuple):
        mu, sigma = ref
        value = (frechet_distance_to_features(samples, mu, sigma) if o.fid_method == "eigh"
                 else frechet_distance(*feature_statistics(samples), mu, sigma, method=o.fid_method))
    else:
        value = frechet_distance(*feature_statistics(samples), *feature_statistics(ref), method=o.fid_method)
    return {"fd_dinov2": value}


def digits(samples: tuple[np.ndarray, np.ndarray, np.ndarray], ref: None, o: MetricOptions) -> dict[str, float]:
    from .digits_metric import digits_metric
    return digits_metric(*samples)


METRICS: dict[str, MetricEntry] = {
    "digits": MetricEntry(digits, "digits", "features", False, "digits accuracy",
                          "class accuracy and feature FD of the digits classifier (8x8 digits data only)",
                          key="digits_acc", also={"digits_fd": Value("digits FD", True)}, evaluate=False,
                          only_for=("digits", "8x8 digits")),
    "fid": MetricEntry(partial(frechet, "fid", "pool"), "inception", "statistics", True, "FID",
                       "Fréchet Inception distance (pool_3)", stats=("mu", "sigma"), default=True),
    "sfid": MetricEntry(partial(frechet, "sfid", "spatial"), "inception", "statistics", True, "sFID",
                        "spatial FID (mixed_6/conv)", stats=("mu_s", "sigma_s"), default=True),
    "is": MetricEntry(inception_score_metric, "inception", "features", False, "Inception Score",
                      "Inception Score of the samples", default=True),
    "precision": MetricEntry(precision_and_recall, "inception", "reference images", False, "Precision",
                             "improved precision (k-NN on pool_3)", default=True),
    "recall": MetricEntry(precision_and_recall, "inception", "reference images", False, "Recall",
                          "improved recall (k-NN on pool_3)", default=True),
    "kid": MetricEntry(kid, "inception", "reference images", True, "KID", "kernel Inception distance",
                       also={"kid_std": Value("KID std", True)}, training=False),
    "fd_dinov2": MetricEntry(fd_dinov2, "dinov2", "statistics", True, "FD-DINOv2",
                             "Fréchet distance of DINOv2 ViT-L/14 features", stats=("mu_dinov2", "sigma_dinov2")),
}


def metric_entry(name: str) -> MetricEntry:
    """The table's entry; an unknown name is one UserError listing the table."""
    if name not in METRICS:
        raise UserError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")
    return METRICS[name]


def metric_names(**where: bool | str) -> tuple[str, ...]:
    """The table's names (in table order) whose entries have the given values (evaluate=True, ...)."""
    return tuple(name for name, e in METRICS.items() if all(getattr(e, k) == v for k, v in where.items()))


def reported_values(metrics: Any) -> dict[str, Value]:
    """Every value the given metrics report, with its label and direction."""
    return {k: v for m in metrics for k, v in metric_entry(m).values(m).items()}


def stored_stat_keys(metrics: Any) -> tuple[str, ...]:
    """The reference npz keys that would spare the reference's images for these metrics."""
    return tuple(k for m in metrics for k in metric_entry(m).stats)


def lower_is_better(metric: str) -> bool:
    """Whether a lower value is better: a value a metric of the table reports (per cfg scale, e.g.
    "fid/cfg1.5"), or a training or held-out loss term ("train_loss", "heldout_mse_raw")."""
    name = metric.split("/")[0]
    values = reported_values(METRICS)
    if name in values:
        return values[name].lower_is_better
    if name.startswith(("train_", "heldout_")):
        return True
    raise UserError(f"{metric} is not a value any metric reports ({', '.join(values)}) nor a loss "
                    "(train_*, heldout_*); its direction is unknown")


def is_heldout_part(metric: str) -> bool:
    """heldout_mse* / heldout_vb* / heldout_cos*: the terms of heldout_loss, shown in tables but left out
    of figures and verdicts (heldout_loss stands for them)."""
    return metric.startswith(("heldout_mse", "heldout_vb", "heldout_cos"))


def value_label(name: str) -> str:
    """How tables print a value ("fid" -> "FID"); the name itself for values outside the table."""
    return reported_values(METRICS).get(name, Value(name, True)).label
