"""Samplers and metrics are extension points: one entry in their table (SAMPLERS, METRICS) reaches
the command lines' choices and help, the config checks, the sampling API and the in-training
evaluator, with no other file changed; an unknown name is one line listing the table."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import TINY_TRAIN, load_script, one_torch_thread, tiny_model
from helpers import ROOT

from ancre_dit.diffusion import FlowObjective
from ancre_dit.diffusion.sampler_registry import SAMPLERS, SamplerEntry, resolve_sampler, sampler_entry
from ancre_dit.errors import UserError
from ancre_dit.evaluation import digits_metric as digits_classifier
from ancre_dit.evaluation.evaluator import Evaluator
from ancre_dit.evaluation.inception import InceptionFeatures
from ancre_dit.evaluation.metrics import feature_statistics, frechet_distance
from ancre_dit.evaluation.metric_registry import METRICS, MetricEntry, Side, lower_is_better, metric_entry
from ancre_dit.evaluation.pipeline import EvaluationResult, format_table, parse_metrics, score
from ancre_dit.sampling import sample_latents
from ancre_dit.sampling.api import SampleNoise, decode_pixels
from ancre_dit.training.config import load_config

FLOW_TINY = [*TINY_TRAIN, "diffusion.objective=flow", "model.learn_sigma=false"]


def toy_sampler(objective, denoiser, x, y, noise, *, steps, sde):
    """Halves the initial noise `steps` times and adds the network's output once: a result that
    shows the step count and that the network was called."""
    for _ in range(steps):
        x = x / 2
    return x + 0 * denoiser(x, objective.times_at(0.5, len(x)), y)[:, : x.shape[1]]


def toy_metric(samples, ref, options):
    features, predictions, labels = samples
    return {"toy": float(np.abs(features).mean())}


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(SAMPLERS, "toy", SamplerEntry(toy_sampler, ("flow",), 3, "halves the noise per step"))
    monkeypatch.setitem(METRICS, "toy", MetricEntry(toy_metric, "digits", "features", True, "Toy", "a toy metric"))


def test_a_new_sampler_reaches_the_command_line_the_config_and_the_sampling_api(toys):
    parser = load_script(ROOT / "sample.py").build_parser()
    assert parser.parse_args(["--ckpt", "c", "--sampler", "toy"]).sampler == "toy"
    text = parser.format_help().replace("\n", " ")
    assert "toy (halves the noise per step)" in " ".join(text.split()) and "toy 3" in text
    assert load_config(None, [*FLOW_TINY, "eval.sampler=toy"]).eval.sampler == "toy"
    with pytest.raises(UserError, match="eval.sampler toy does not fit diffusion.objective=ddpm; choose ddpm, ddim"):
        load_config(None, [*TINY_TRAIN, "eval.sampler=toy"])
    assert resolve_sampler(FlowObjective(), "toy", None) == ("toy", 3)  # its default steps
    with one_torch_thread():
        got = sample_latents(tiny_model("ancre", learn_sigma=False), FlowObjective().spec(), [0, 1], seed=3,
                             sampler="toy")
    assert torch.equal(got, SampleNoise(3, [0, 1], (1, 8, 8), "cpu").next() / 8)  # 3 halvings of each sample's noise


def test_a_new_metric_reaches_the_command_line_the_config_the_scores_and_the_comparisons(toys, monkeypatch):
    parser = load_script(ROOT / "evaluate.py").build_parser()
    assert "toy: a toy metric" in " ".join(parser.format_help().split())
    assert parse_metrics("fid,toy") == ("fid", "toy")
    assert load_config(None, [*TINY_TRAIN, "eval.metrics=[toy]"]).eval.metrics == ["toy"]
    assert lower_is_better("toy/cfg1.5") is True
    assert format_table(EvaluationResult({"toy": 2.0}, {})).startswith("Toy ")
    # One on Inception features goes through the same scoring as FID, next to it.
    monkeypatch.setitem(METRICS, "logit_sum", MetricEntry(lambda s, r, o: {"logit_sum": float(s.features.logits.sum())},
                                                          "inception", "features", False, "Logit sum", "a toy"))
    rng = np.random.default_rng(0)
    features = InceptionFeatures(rng.normal(size=(5, 4)), rng.normal(size=(5, 6)), np.ones((5, 3)))
    ref_pool = rng.normal(size=(5, 4)) + 1
    ref = Side("reference", features=InceptionFeatures(ref_pool, features.spatial, features.logits))
    got = score(Side("samples", features=features), ref, ["logit_sum", "fid"])
    fid = frechet_distance(*feature_statistics(features.pool), *feature_statistics(ref_pool))
    assert got == {"logit_sum": 15.0, "fid": pytest.approx(fid)}

def test_a_new_metric_and_sampler_reach_the_evaluator(toys, monkeypatch, tmp_path):
    """The evaluator samples with the toy sampler and scores with the toy metric; the digits
    classifier (the toy metric's feature network) is stood in for by the pixels themselves."""
    monkeypatch.setattr(digits_classifier, "classify",
                        lambda images: (images.reshape(len(images), -1).astype(np.float64), np.zeros(len(images))))
    monkeypatch.setattr(digits_classifier, "digits_reference_scores", lambda: {})
    config = load_config(None, [*FLOW_TINY, f"run_dir={tmp_path}", "eval.sampler=toy", "eval.metrics=[toy]",
                                "eval.num_samples=4", "eval.batch_size=2", "eval.cfg_scales=[1]",
                                "eval.heldout_loss=false"])
    state = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True, device="cpu")
    objective = FlowObjective()
    evaluator = Evaluator(config.eval, data_kind="digits", num_classes=10, objective=objective, heldout=None,
                          decoder=decode_pixels, state=state)
    assert (evaluator.sampler, evaluator.steps) == ("toy", 3)
    with one_torch_thread():
        model = tiny_model("ancre", learn_sigma=False)
        result = evaluator.evaluate(model)
        latents = sample_latents(model, objective.spec(), np.arange(4) % 10, seed=config.eval.seed, sampler="toy")
    expected = float(np.abs(decode_pixels(latents).astype(np.float64)).mean())
    assert result["metrics"] == {"toy/cfg1": pytest.approx(expected)}


def test_unknown_names_are_one_line_listing_the_table(toys):
    for lookup, names in ((sampler_entry, SAMPLERS), (metric_entry, METRICS)):
        with pytest.raises(UserError) as err:
            lookup("nope")
        message = str(err.value)
        assert "\n" not in message and "nope" in message and ", ".join(names) in message and "toy" in message
    with pytest.raises(UserError, match=r"eval.sampler nope is unknown for diffusion.objective=flow; choose .*dopri5.*toy"):
        load_config(None, [*FLOW_TINY, "eval.sampler=nope"])
    with pytest.raises(UserError, match=r"unknown metric 'nope' in eval.metrics; choose digits, fid.*toy"):
        load_config(None, [*TINY_TRAIN, "eval.metrics=[nope]"])
    with pytest.raises(UserError, match="unknown metric.*nope.*choose from fid, sfid.*toy"):
        parse_metrics("fid,nope")
    with pytest.raises(UserError, match="its direction is unknown"):
        lower_is_better("nope/cfg1")
