"""Throughput where users look: metrics.jsonl (and the progress bar) carry images/s in all and per
process, the model's FLOP/s per process and the MFU against the device's peak."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_DIT, TINY_NAME, reset_accelerate, tiny_config

from ancre_dit import create_model
from ancre_dit.hardware import peak_tflops
from ancre_dit.models.flops import count_training_flops, flops_per_training_image
from ancre_dit.training import Trainer


@pytest.mark.slow
def test_metrics_carry_the_rate_per_process_and_the_mfu(tmp_path):
    reset_accelerate()
    try:
        trainer = Trainer(tiny_config(tmp_path / "run", "train.max_steps=4", "train.log_every=2", "train.peak_tflops=0.002"))
        trainer.run()
    finally:
        reset_accelerate()
    # The count made on the meta device is the count of the real model on a real image.
    model = create_model(TINY_NAME, **{k: v for k, v in TINY_DIT.items()}, topology="ancre", learn_sigma=True)
    x = torch.randn(1, TINY_DIT["in_channels"], TINY_DIT["input_size"], TINY_DIT["input_size"])
    expected = count_training_flops(model, x, torch.tensor([10]), torch.tensor([1]), autocast_dtype=None)
    assert trainer.flops_per_image == expected > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["images_per_s"] == pytest.approx(r["images_per_sec"])  # one process
        assert r["tflops_per_s"] == pytest.approx(r["images_per_s"] * expected / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.002)
        assert r["lr"] == pytest.approx(1e-3)


def test_the_peak_comes_from_the_device_table_or_the_setting():
    assert peak_tflops("cpu") == (None, "no peak known for a CPU: set it to get an MFU")
    assert peak_tflops("cpu", 123.0) == (123.0, "given")


@pytest.mark.parametrize("topology", ["hc", "mhc", "ancre"])
def test_the_count_on_the_meta_device_equals_the_real_models(topology):
    # Large models are counted there. HC and mHC leave autocast in their fp32 regions; the meta
    # device has none to leave.
    kwargs = dict(TINY_DIT, topology=topology, learn_sigma=True)
    devices = []

    def build(device):
        devices.append(device)
        return create_model(TINY_NAME, **kwargs)

    counted = flops_per_training_image(build, TINY_DIT["in_channels"], TINY_DIT["input_size"], batch=2, device="meta")
    assert flops_per_training_image(build, TINY_DIT["in_channels"], TINY_DIT["input_size"], batch=2) == counted
    x = torch.randn(2, TINY_DIT["in_channels"], TINY_DIT["input_size"], TINY_DIT["input_size"])
    real = count_training_flops(create_model(TINY_NAME, **kwargs), x, torch.tensor([10, 20]), torch.tensor([1, 2]),
                                autocast_dtype=None)
    assert devices == ["meta", "meta", "cpu"] and counted == real / 2 > 0  # a model this small: on the CPU
