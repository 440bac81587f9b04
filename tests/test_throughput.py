"""Throughput where users look: metrics.jsonl (and the progress bar) carry images/s in all and per
process, the model's FLOP/s per process and the MFU against the device's peak."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_DIT, TINY_NAME, tiny_config

from ancre_dit import create_model
from ancre_dit.hardware import peak_tflops
from ancre_dit.models.flops import count_training_flops, flops_per_training_image
from ancre_dit.training import Trainer


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerate")
def test_metrics_carry_the_rate_per_process_and_the_mfu(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run", "train.max_steps=4", "train.log_every=2", "train.peak_tflops=0.002"))
    trainer.run()
    # The count made on the meta device is the count of the real model on a real image.
    model = create_model(TINY_NAME, **{k: v for k, v in TINY_DIT.items()}, topology="ancre", learn_sigma=True)
    x = torch.randn(1, TINY_DIT["in_channels"], TINY_DIT["input_size"], TINY_DIT["input_size"])
    expected = count_training_flops(model, x, torch.tensor([10]), torch.tensor([1]), autocast_dtype=None)
    assert trainer.flops_per_image == expected > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["images_per_s_per_process"] == pytest.approx(r["images_per_s_total"])  # one process
        assert r["tflops_per_s"] == pytest.approx(r["images_per_s_per_process"] * expected / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.002)
        assert (r["peak_tflops"], r["peak_source"]) == (0.002, "given")  # which peak the MFU is against
        assert r["lr"] == pytest.approx(1e-3)


def test_the_peak_comes_from_the_device_table_or_the_setting(monkeypatch):
    assert peak_tflops("cpu") == (None, "no peak known for a CPU: set it to get an MFU")
    assert peak_tflops("cpu", 123.0) == (123.0, "given")
    # what torch.cuda.get_device_name says of each part, the most specific entry first
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0,
             "NVIDIA H200 NVL": 835.0, "NVIDIA H800 PCIe": 756.0, "NVIDIA H800": 989.0, "NVIDIA H20": 148.0,
             "NVIDIA GH200 480GB": 989.0, "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L40": 181.0,
             "NVIDIA L4": 121.0, "NVIDIA B200": 2250.0}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        value, source = peak_tflops("cuda:0")
        assert value == peak and name in source, (name, value, source)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_tflops("cuda:0") == (None, "unknown device 'Some Future GPU': set its peak to get an MFU")


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
