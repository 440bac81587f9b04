"""One evaluation of a model in memory, on every process: held-out loss + sample metrics.

Used by the training loop (every train.eval_every steps) and by `evaluate.py --run` (every checkpoint
of a finished run), so both write the same numbers for the same weights:
- samples: `num_samples` images per cfg scale from the given (EMA) weights, with a fixed seed, sampler
  and step count, in parts of `batch_size` as a sampling job cuts them (part j on process j % world).
  Each process computes its parts' features; the main process gathers them in index order and scores;
- held-out loss: the training objective on fixed held-out rows, sharded the same way; no sampling, no
  Inception weights. Each example is repeated `draws` times at stratified times (examples x draws
  evenly spaced, shuffled with a fixed seed), with noise drawn once from a seeded generator, so two
  evaluations differ only by the weights.
Every draw comes from generators seeded here, inside a fork of the global RNGs: a run with evaluation
on trains the same weights as one without.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..checkpoint import SPEC_FILE
from ..diffusion import Objective, resolve_sampler
from ..diffusion.sampler_registry import check_time_shift
from ..errors import MissingFileError, UserError, or_list
from ..models.timm_weights import weights_hint as timm_weights_hint
from ..sampling.guidance import check_guidance_scale
from .inception import InceptionExtractor, InceptionFeatures, loaded
from .inception import weights_hint as inception_weights_hint
from .metric_registry import FEATURES, METRICS, Side, metric_names, stored_stat_keys
from .metrics import feature_statistics


def resolve_metrics(settings, data_kind: str) -> list[str]:
    """eval.metrics, or its default: digits on digits data, fid when a reference is given, else none."""
    if settings.metrics is not None:
        return list(settings.metrics)
    if data_kind == "digits":
        return ["digits"]
    return ["fid"] if settings.ref else []


def check_evaluation(e, data_kind: str, objective: Objective, found: Callable[..., bool]) -> None:
    """At config load: the eval section's sampler, scales and guide, and what the metrics asked for need
    (the metric table says): their data, a reference, the weights of the network whose features they
    read. `found(key, path, kind)`: whether a path exists, or counts as found where paths are not checked."""
    resolve_sampler(objective, e.sampler, e.steps, ("eval.sampler", "eval.steps"),
                    owner=f"diffusion.objective={objective.name}")
    check_time_shift(e.sampler or objective.default_sampler, e.time_shift, "eval.time_shift")
    for scale in e.cfg_scales:
        check_guidance_scale("eval.cfg_scales", scale)
    if e.guide_ckpt and not found("eval.guide_ckpt", str(Path(e.guide_ckpt) / SPEC_FILE)):
        raise MissingFileError(f"eval.guide_ckpt {e.guide_ckpt} is no checkpoint folder ({SPEC_FILE} missing); "
                               "point it at RUN/checkpoints/<step> of a model of the same data")
    metrics = resolve_metrics(e, data_kind)
    offered = metric_names(training=True)  # read now: the table may have grown since import
    for name in metrics:
        if name not in offered:
            raise UserError(f"unknown metric {name!r} in eval.metrics; choose {or_list(offered)}")
        only = METRICS[name].only_for
        if only is not None and only[0] != data_kind:
            raise UserError(f"eval.metrics={name} scores {only[1]}, but data.kind={data_kind}; use fid (with eval.ref)")
    on = {family: [m for m in metrics if METRICS[m].features == family] for family in FEATURES}
    dinov2, inception = ", ".join(on["dinov2"]), ", ".join(on["inception"])
    if dinov2:
        keys = " / ".join(stored_stat_keys(on["dinov2"]))
        if not e.ref or not found("eval.ref", e.ref, "any"):
            raise MissingFileError(f"eval.metrics {dinov2} needs eval.ref (an npz with images or {keys}, "
                                   f"or a folder of images); got {e.ref}")
        if not e.dinov2_weights or not found("eval.dinov2_weights", e.dinov2_weights):
            raise MissingFileError(f"eval.metrics {dinov2} needs eval.dinov2_weights (got {e.dinov2_weights}); "
                                   f"{timm_weights_hint(e.dinov2_model, 'eval.dinov2_weights=PATH')}")
    if not inception:
        return
    if not e.ref:
        raise UserError(f"eval.metrics {inception} need eval.ref (an ADM reference npz or one written by "
                        f"evaluate.py --save-ref-stats)")
    if not found("eval.ref", e.ref, "any"):
        raise MissingFileError(f"eval.ref {e.ref} does not exist; pass an ADM reference npz or a file written by "
                               f"evaluate.py --save-ref-stats")
    if not e.inception_weights or not found("eval.inception_weights", e.inception_weights):
        problem = (f"eval.inception_weights {e.inception_weights} does not exist" if e.inception_weights
                   else "eval.inception_weights is not set")
        raise MissingFileError(inception_weights_hint(f"{problem} ({inception})", "eval.inception_weights="))


def evaluation_identity(settings, data_kind: str) -> dict[str, Any]:
    """The settings that decide an evaluation's numbers (two entries compare only if these match)."""
    keep = ("num_samples", "batch_size", "sampler", "steps", "cfg_scales", "seed", "ref", "heldout_loss",
            "heldout_draws", "heldout_max", "val_path", "heldout_from_train")
    identity = {k: getattr(settings, k) for k in keep}
    if any(METRICS[m].features == "dinov2" for m in settings.metrics or []):  # only then: older entries keep matching
        identity["dinov2_model"] = settings.dinov2_model
    if list(settings.emas) != ["ema"]:  # only then: older entries keep matching
        identity["emas"] = list(settings.emas)
    if settings.guide_ckpt:
        identity["guide_ckpt"] = str(Path(settings.guide_ckpt).resolve())
    if settings.time_shift != 1:
        identity["time_shift"] = float(settings.time_shift)
    identity["metrics"] = resolve_metrics(settings, data_kind)
    identity["cfg_scales"] = [float(c) for c in settings.cfg_scales]
    return identity


def _ranks_parts(total: int, batch_size: int, rank: int, world: int) -> list[tuple[int, int]]:
    from ..sampling.job import part_ranges
    return part_ranges(total, batch_size)[rank::world]


def _gather_in_order(state, parts: list[tuple[int, Any]]) -> list[Any]:
    """Every process's (start, payload) parts, gathered on every process: the payloads in start order."""
    if state.num_processes > 1:
        out: list = [None] * state.num_processes
        torch.distributed.all_gather_object(out, parts)
        parts = [x for part in out for x in part]
    return [payload for _, payload in sorted(parts, key=lambda p: p[0])]


def _joined(features: list[dict[str, np.ndarray]], key: str) -> np.ndarray:
    return np.concatenate([f[key] for f in features])


@dataclass
class HeldOutSet:
    """Fixed inputs of the held-out loss, all on the CPU: row i is (x[i], y[i], t[i], noise[i])."""
    x: torch.Tensor
    y: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor
    num_examples: int

    def __len__(self) -> int:
        return len(self.y)


def build_heldout_set(dataset: Dataset, kind: str, *, max_examples: int, draws: int, seed: int,
                      objective: Objective, latent_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> HeldOutSet:
    """The first `max_examples` items of `dataset` (digits: the held-out split; latents: stored
    moments, turned into one fixed posterior draw per row, normalised as training normalises them),
    `draws` rows each."""
    n = min(len(dataset), max_examples)
    if n < 1:
        raise UserError("the held-out set is empty; raise eval.heldout_from_train or point eval.val_path at data")
    items = [dataset[i] for i in range(n)]
    x = torch.stack([torch.as_tensor(item[0]) for item in items]).repeat_interleave(draws, dim=0)
    y = torch.tensor([int(item[1]) for item in items], dtype=torch.long).repeat_interleave(draws)
    g = torch.Generator().manual_seed(int(seed))
    if kind == "latents":  # the same augmentation as training (flip + posterior draw), drawn once
        from ..data.latent_shards import draw_latents_from_moments
        x = draw_latents_from_moments(x, generator=g)
        if latent_norm is not None:
            x = latent_norm(x.float())
    x = x.float()
    m = len(y)
    t = objective.evaluation_times(m)  # evenly spread over the process (DDPM timesteps, flow t)
    t = t[torch.randperm(m, generator=g)]
    noise = torch.randn(x.shape, generator=g, dtype=torch.float32)
    return HeldOutSet(x, y, t, noise, n)


@torch.no_grad()
def heldout_terms(model: torch.nn.Module, objective: Objective, held: HeldOutSet, ranges: list[tuple[int, int]],
                  device: torch.device) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Per-row loss terms (float64) of the rows in `ranges`, one batch per range; the model is run
    in eval mode (no label dropout) and left in the mode it had."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for start, end in ranges:
            terms = objective.losses(model, held.x[start:end].to(device), held.y[start:end].to(device),
                                     (held.t[start:end].to(device), held.noise[start:end].to(device)))
            out.append((start, {k: v.detach().double().cpu().numpy() for k, v in terms.items()}))
    finally:
        model.train(was_training)
    return out


class EvaluationAbandoned(Exception):
    """A stop was requested (SIGTERM, Ctrl-C) during an evaluation: it is dropped unrecorded, so the
    run can checkpoint within a cluster's grace period, and is done again on resume."""


class Evaluator:
    """Built once per run; `evaluate(model, ...)` is collective: every process calls it, the main
    one gets the results."""

    def __init__(self, settings, *, data_kind: str, num_classes: int, objective: Objective,
                 heldout: HeldOutSet | None, decoder, state, guide: torch.nn.Module | None = None):
        self.settings, self.num_classes, self.objective, self.heldout = settings, num_classes, objective, heldout
        self.decoder, self.state, self.guide = decoder, state, guide
        self.sampler, self.steps = resolve_sampler(objective, settings.sampler, settings.steps)  # null: the default
        self.metrics = resolve_metrics(settings, data_kind)  # checked with the config, before the run folder existed
        self.identity = evaluation_identity(settings, data_kind)
        self.features = {METRICS[m].features for m in self.metrics}  # the networks run on each sampled part
        self.inception = [m for m in self.metrics if METRICS[m].features == "inception"]
        if self.metrics and decoder is None:
            raise UserError("the evaluation samples images but no decoder is available; set data.vae")
        self._ref_side = None
        self._dinov2_ref: tuple[np.ndarray, np.ndarray] | None = None

    def evaluate(self, model: torch.nn.Module, raw_model: torch.nn.Module | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """{"metrics": {...}, "reference": {...}, "seconds": s} on the main process, None elsewhere.
        `model`: the weights sampled from (EMA); `raw_model`: also scored on the held-out loss.
        `should_stop` (collective when several processes run) is asked between sampling parts;
        when it answers True the evaluation raises EvaluationAbandoned."""
        self._should_stop = should_stop
        start = time.perf_counter()
        devices = [self.state.device] if torch.device(self.state.device).type == "cuda" else []
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            with torch.random.fork_rng(devices=devices):
                metrics, reference = self._evaluate(model, raw_model)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        if not self.state.is_main_process:
            return None
        return {"metrics": metrics, "reference": reference, "seconds": round(time.perf_counter() - start, 3)}

    def prepare_reference(self) -> None:
        """Computes the reference side of every metric that has one, once: called at the run's start
        on the main process, which alone scores (see build_run_evaluator)."""
        if self.inception and self.settings.ref is not None:
            self._reference_side()
        if "dinov2" in self.features:
            self._dinov2_reference()

    def _evaluate(self, model, raw_model) -> tuple[dict[str, float], dict[str, float]]:
        metrics: dict[str, float] = {}
        reference: dict[str, float] = {}
        if self.settings.heldout_loss and self.heldout is not None:
            metrics.update(self._heldout(model, ""))
            if raw_model is not None:
                metrics.update(self._heldout(raw_model, "_raw"))
        if self.metrics:
            labels = np.arange(self.settings.num_samples) % self.num_classes  # balanced, as sample.py's default
            for cfg in self.settings.cfg_scales:
                scores = self._sample_metrics(model, labels, cfg)
                metrics.update({f"{k}/cfg{float(cfg):g}": v for k, v in scores.items()})
            if "digits" in self.features and self.state.is_main_process:
                from .digits_metric import digits_reference_scores
                reference.update(digits_reference_scores())
        return metrics, reference

    def _heldout(self, model, suffix: str) -> dict[str, float]:
        s, state = self.settings, self.state
        mine = _ranks_parts(len(self.heldout), s.batch_size, state.process_index, state.num_processes)
        parts = heldout_terms(model, self.objective, self.heldout, mine, torch.device(state.device))
        terms = _gather_in_order(state, parts)
        return {f"heldout_{k}{suffix}": float(np.concatenate([t[k] for t in terms]).mean()) for k in terms[0]}

    def _sample_metrics(self, model, labels: np.ndarray, cfg: float) -> dict[str, float]:
        from ..sampling.api import plan_sampling
        from ..sampling.guidance import Guidance
        from ..sampling.job import sample_parts

        s, state = self.settings, self.state
        mine = _ranks_parts(len(labels), s.batch_size, state.process_index, state.num_processes)
        # Every process draws at least this many parts: the stop check after each of them is collective.
        shared = len(_ranks_parts(len(labels), s.batch_size, 0, 1)) // state.num_processes
        plan = plan_sampling(model, self.objective, sampler=self.sampler, steps=self.steps,
                             time_shift=s.time_shift, guidance=Guidance(float(cfg)), guide=self.guide)
        local = []
        for k, (start, _end, images) in enumerate(sample_parts(plan, labels, mine, decoder=self.decoder, seed=s.seed)):
            local.append((start, self._features(images)))
            if k < shared and self._should_stop is not None and self._should_stop():
                raise EvaluationAbandoned
        features = _gather_in_order(state, local)
        if not state.is_main_process:
            return {}
        from .pipeline import score

        out: dict[str, float] = {}
        for family in FEATURES:
            names = [m for m in self.metrics if METRICS[m].features == family]
            if names:
                # eigh: the same Fréchet distance as sqrtm, stable with fewer samples than feature dimensions.
                out.update(score(*self._sides(family, features, labels), names, fid_method="eigh", device=state.device))
        return out

    def _sides(self, family: str, features: list[dict[str, np.ndarray]], labels: np.ndarray) -> tuple[Any, Any]:
        """The samples' and the reference's sides as the metrics on `family`'s features read them
        (see metric_registry)."""
        if family == "digits":
            return (_joined(features, "digits_features"), _joined(features, "digits_pred"), labels), None
        if family == "dinov2":
            return _joined(features, "dinov2"), self._dinov2_reference()
        feats = InceptionFeatures(*(_joined(features, k) for k in ("pool", "spatial", "logits")))
        return Side("samples", features=feats, num_images=len(feats)), self._reference_side()

    def _features(self, images: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if "digits" in self.features:
            from .digits_metric import classify
            out["digits_features"], out["digits_pred"] = classify(images)
        if self.inception:
            from ..data.adm_npz import to_rgb_uint8
            pool, spatial, logits = self._get_extractor().batch(to_rgb_uint8(images))
            out.update(pool=pool.numpy(), spatial=spatial.numpy(), logits=logits.numpy())
        if "dinov2" in self.features:
            out["dinov2"] = self._dinov2_extractor().batch(images).numpy()
        return out

    def _dinov2_extractor(self):
        from .dinov2 import DinoV2Extractor
        return loaded(DinoV2Extractor, self.settings.dinov2_weights, self.settings.dinov2_model, self.state.device)

    def _dinov2_reference(self) -> tuple[np.ndarray, np.ndarray]:
        """eval.ref's DINOv2 (mu, sigma): stored in it, else from its images (once per run)."""
        from .pipeline import default_batch_size, dinov2_reference, open_side

        if self._dinov2_ref is None:
            ref, _ = dinov2_reference(open_side(self.settings.ref, "reference"), self._dinov2_extractor(),
                                      default_batch_size(torch.device(self.state.device)))
            self._dinov2_ref = ref if isinstance(ref, tuple) else feature_statistics(ref)
        return self._dinov2_ref

    def _get_extractor(self):
        return loaded(InceptionExtractor, self.settings.inception_weights, self.state.device)

    def _reference_side(self):
        """eval.ref for the Inception metrics: its stored statistics, or its images' features (once per run)."""
        from .pipeline import default_batch_size, open_side, reference_features

        if self._ref_side is None:
            batch_size = default_batch_size(torch.device(self.state.device))
            self._ref_side = reference_features(open_side(self.settings.ref, "reference"), self.inception,
                                                self._get_extractor(), batch_size)
        return self._ref_side
