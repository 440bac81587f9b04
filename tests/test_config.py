"""Config: YAML + overrides into typed sections; every mistake is one clear line."""
from __future__ import annotations

import dataclasses
import inspect
import re
import runpy
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, subprocess_env

from ancre_dit.errors import UserError
from ancre_dit.models.topologies import resolve_options
from ancre_dit.training.config import load_config, save_config
from ancre_dit.training.data import check_batch_layout
from ancre_dit.training.data import GlobalBatchSampler, advance_position, build_data

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_shipped_configs_load(tmp_path):
    names = {p.stem for p in CONFIGS}
    assert {"dit-s2-ancre", "dit-s2-cascaded", "dit-b2-ancre", "dit-b2-cascaded", "digits-ancre", "digits-cascaded"} <= names
    for path in CONFIGS:
        raw = yaml.safe_load(path.read_text())
        if raw["data"]["kind"] == "latents":  # the paper recipe; its data path is checked at load
            # ImageNet recipes compile, as their reference scripts do; ANCRe's take the current scripts' tau
            assert raw["train"]["compile"] is True, path.name
            if raw["model"]["topology"] == "ancre":
                assert raw["model"]["tau"] == 0.1 and "0.01" in path.read_text().split("run_dir:")[0], path.name
            (tmp_path / "lat").mkdir(exist_ok=True)
            if path.stem.startswith(("repa-", "lightningdit-")):  # their recipes: test_recipes.py
                continue
            c = load_config(path, [f"data.path={tmp_path / 'lat'}"])
            assert (c.train.global_batch_size, c.train.max_steps, c.train.lr, c.train.ema_decay) == (256, 400000, 1e-4, 0.9999)
            # learn_sigma: on for DiT's DDPM, off for SiT's flow objective (sit-*.yaml).
            assert (c.train.mixed_precision, c.train.ckpt_every, c.model.learn_sigma, c.model.class_dropout) == \
                ("bf16", 50000, c.diffusion.objective == "ddpm", 0.1)
            assert c.diffusion.objective == ("flow" if path.stem.startswith("sit-") else "ddpm")
        else:
            c = load_config(path)
            assert c.data.kind == "digits" and c.train.mixed_precision == "no"
        # the name says the topology; quickstart.yaml is the README's first command, with ANCRe
        assert c.model.topology in path.stem or (path.stem == "quickstart" and c.model.topology == "ancre")


def test_overrides_types_and_round_trip(tmp_path):
    c = load_config(ROOT / "configs" / "digits-ancre.yaml",
                    ["train.max_steps=20", "train.lr=1e-4", "model.depth=3", "run_dir=results/x", "train.grad_clip=2", "log.wandb=false"])
    assert (c.train.max_steps, c.train.lr, c.model.depth, c.run_dir, c.train.grad_clip) == (20, 1e-4, 3, "results/x", 2.0)
    assert isinstance(c.train.lr, float) and isinstance(c.train.grad_clip, float)
    save_config(c, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == c


@pytest.mark.parametrize("overrides, message", [
    (["train.max_step=5"], "unknown config key train.max_step"),
    (["optim.lr=1"], "unknown config key optim"),
    (["train.max_steps=ten"], "train.max_steps must be a valid integer, got 'ten'"),
    (["train.max_steps=2.5"], "train.max_steps must be a valid integer, got 2.5"),
    (["model.learn_sigma=3"], "model.learn_sigma must be a valid boolean, got 3"),
    (["model.hidden_size=30", "model.num_heads=4"], "hidden size 30 is not divisible by 4 heads"),
    (["model.norm=bogus"], "unknown norm 'bogus'; choose one of layernorm, rmsnorm"),
    (["model.name=DiT-Q/2"], "unknown model 'DiT-Q/2'"),
    (["model.topology=spaghetti"], "unknown topology"),
    (["data.kind=latents", "data.path=/nonexistent/latents"], "data path /nonexistent/latents does not exist"),
    (["data.kind=images"], "data.kind=images needs data.path"),
    (["train.mixed_precision=fp8"], "train.mixed_precision must be 'no', 'bf16' or 'fp16', got 'fp8'"),
    (["train.max_steps"], "is not key=value"),
])
def test_bad_configs_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as err:
        load_config(ROOT / "configs" / "digits-ancre.yaml", overrides)
    assert "\n" not in str(err.value)


def test_batch_layout_and_patch_checks(tmp_path):
    c = load_config(None, ["data.kind=digits", "data.image_size=8", "train.global_batch_size=24", "train.grad_accum=2"])
    assert check_batch_layout(c, 3) == 4
    with pytest.raises(UserError, match="not divisible by 5 process"):
        check_batch_layout(c, 5)
    # an image folder whose size the patch size does not divide
    from PIL import Image
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        Image.new("RGB", (12, 12)).save(tmp_path / "imgs" / cls / "0.png")
    c = load_config(None, ["data.kind=images", f"data.path={tmp_path / 'imgs'}", "data.image_size=10", "model.name=DiT-S/4"])
    with pytest.raises(UserError, match="data.image_size 10 is not divisible by the patch size 4"):
        build_data(c, 4)
    assert build_data(c, 2).num_classes == 2


def test_data_order_is_the_same_global_batch_for_any_layout():
    def global_batches(world, accum, steps, epoch=0, offset=0):
        its = [iter(GlobalBatchSampler(50, 12, world, r, accum, seed=7, epoch=epoch, offset=offset)) for r in range(world)]
        out = []
        for _ in range(steps):
            out.append(sorted(i for it in its for _ in range(accum) for i in next(it)))
        return out

    one = global_batches(1, 1, 9)
    assert one == global_batches(2, 1, 9) == global_batches(2, 3, 9) == global_batches(4, 1, 9)
    assert len(set(i for b in one[:4] for i in b)) == 48  # an epoch: 4 disjoint batches (2 dropped)
    assert one[:4] != one[4:8]  # a new permutation each epoch
    # resuming from a saved position continues the same stream
    epoch, offset = 0, 0
    for _ in range(6):
        epoch, offset = advance_position(epoch, offset, 12, 50)
    assert global_batches(2, 1, 3, epoch, offset) == one[6:9]


@pytest.mark.slow
def test_bad_configs_from_the_command_line(tmp_path):
    """train.py prints one line starting with 'error:' for each mistake named in the issue."""
    cases = {
        "unknown model": ["model.name=DiT-Z/2"],
        "not divisible": ["train.global_batch_size=10", "train.grad_accum=4"],
        "does not exist": ["data.kind=latents", f"data.path={tmp_path / 'missing'}"],
    }
    procs = {
        key: subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
                               f"run_dir={tmp_path / key.replace(' ', '_')}", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=ROOT)
        for key, args in cases.items()
    }
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (key, err)
        assert len(lines) == 1 and lines[0].startswith("error:") and key in lines[0], (key, err)


# -- round trip, old files, declared ranges, error lines ---------------------------------------------
TINY = ["data.kind=digits", "data.image_size=8", "model.name=DiT-T/2", "model.depth=2", "model.hidden_size=32",
        "model.num_heads=2", "train.mixed_precision=no"]


@pytest.mark.parametrize("overrides", [
    ["model.tau=0.05", "eval.cfg_scales=1.5", "eval.metrics=digits", "train.lr=1e-4"],
    ["model.topology=hc", "model.hc_streams=3"],
    ["model.topology=mhc", "model.sinkhorn_iters=5", "model.tau=0.2"],  # tau: not mhc's, kept as given
    ["model.topology=cascaded", "diffusion.objective=flow", "model.learn_sigma=false", "eval.sampler=euler"],
])
def test_save_then_load_is_exact(tmp_path, overrides):
    c = load_config(None, [*TINY, *overrides])
    save_config(c, tmp_path / "a.yaml")
    again = load_config(tmp_path / "a.yaml")
    assert again == c
    save_config(again, tmp_path / "b.yaml")
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()
    model = yaml.safe_load((tmp_path / "a.yaml").read_text())["model"]
    assert "topology_options" not in model  # options are written flat, as they are given
    assert {k: model[k] for k in c.model.topology_options} == c.model.topology_options


def test_the_chosen_topology_options_and_their_defaults(tmp_path):
    from ancre_dit.models.topologies import ANCReTopology, all_topology_options
    from ancre_dit.training.config_sections import ModelConfig
    from ancre_dit.training.model_setup import topology_options_of

    default_tau = all_topology_options()["tau"].default
    recorded = load_config(None, TINY).model.topology_options  # ancre's options, defaults included
    assert recorded == resolve_options("ancre", {}) and recorded["tau"] == default_tau
    assert inspect.signature(ANCReTopology).parameters["tau"].default == default_tau  # one default, the registry's
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not {"tau", "hc_streams", "sinkhorn_iters", "topology_path"} & fields  # one way in: model.<option>
    c = load_config(None, [*TINY, "model.topology=mhc", "model.hc_streams=2"])
    assert topology_options_of(c.model) == c.model.topology_options == resolve_options("mhc", {"hc_streams": 2})
    assert c.model.topology_options["hc_streams"] == 2
    assert topology_options_of(ModelConfig(topology="hc")) == resolve_options("hc", {})  # built in code: defaults


def test_yaml_quirks_users_rely_on(tmp_path):
    (tmp_path / "c.yaml").write_text("train: {mixed_precision: no, lr: 1e-4, grad_clip: 2}\n"
                                     "eval: {cfg_scales: 1.5, metrics: digits}\n"
                                     "data: {kind: digits, image_size: 8}\n")
    c = load_config(tmp_path / "c.yaml")
    assert c.train.mixed_precision == "no"  # YAML 1.1 reads an unquoted no as false
    assert c.train.lr == 1e-4 and isinstance(c.train.lr, float)  # PyYAML reads 1e-4 (no dot) as a string
    assert c.train.grad_clip == 2.0 and isinstance(c.train.grad_clip, float)
    assert c.eval.cfg_scales == [1.5] and c.eval.metrics == ["digits"]  # a scalar where a list goes
    assert load_config(None, [*TINY, "eval.cfg_scales=2", "train.mixed_precision=false"]).eval.cfg_scales == [2.0]


def test_every_number_declares_its_range():
    from ancre_dit.training.config import Config

    # any finite location is valid; a guidance scale's rule is the sampler's (test_one_guidance_scale_rule)
    unranged = {"diffusion.logit_mean", "train.cfg_scale_for_grids"}
    numbers = 0
    for name, section in Config.__pydantic_fields__.items():
        if name == "run_dir":
            continue
        for key, info in section.annotation.__pydantic_fields__.items():
            if any(t in str(info.annotation) for t in ("int", "float")) and f"{name}.{key}" not in unranged:
                assert info.metadata, f"{name}.{key} declares no range"
                numbers += 1
    assert numbers >= 35


@pytest.mark.parametrize("override, message", [
    ("train.lr=0", "train.lr must be greater than 0, got 0"),
    ("train.lr=.inf", "train.lr must be a finite number, got inf"),
    ("train.seed=-1", "train.seed must be greater than or equal to 0, got -1"),
    ("eval.seed=-1", "eval.seed must be greater than or equal to 0, got -1"),
    ("eval.steps=0", "eval.steps must be greater than or equal to 1, got 0"),
    ("eval.heldout_max=0", "eval.heldout_max must be greater than or equal to 1, got 0"),
    ("data.num_workers=-1", "data.num_workers must be greater than or equal to 0, got -1"),
    ("data.image_size=0", "data.image_size must be greater than or equal to 1, got 0"),
    ("train.adam_beta1=1", "train.adam_beta1 must be less than 1, got 1"),
    ("train.ema_decay=-0.5", "train.ema_decay must be greater than or equal to 0, got -0.5"),
    ("train.ema_decay=1.5", "train.ema_decay must be less than or equal to 1, got 1.5"),
    ("train.nonfinite_max_skips=-1", "train.nonfinite_max_skips must be greater than or equal to 0"),
    ("train.sample_steps=0", "train.sample_steps must be greater than or equal to 1, got 0"),
    ("model.hidden_size=0", "model.hidden_size must be greater than or equal to 1, got 0"),
    ("diffusion.logit_std=0", "diffusion.logit_std must be greater than 0, got 0"),
    ("diffusion.logit_mean=.nan", "diffusion.logit_mean must be a finite number, got nan"),
    ("model.tau=-1", "model.tau must be greater than 0, got -1"),
    ("model.tau=true", "model.tau must be a valid number, got True"),
    ("model.sinkhorn_iters=0", "model.sinkhorn_iters must be greater than or equal to 1, got 0"),
    ("data.kind=video", "data.kind must be 'digits', 'latents' or 'images', got 'video'"),
    ("train.nonfinite=ignore", "train.nonfinite must be 'skip' or 'stop', got 'ignore'"),
    ("diffusion.time_sampling=beta", "diffusion.time_sampling must be 'uniform' or 'logit-normal', got 'beta'"),
    ("eval.metrics=[digits,fidd]", "unknown metric 'fidd' in eval.metrics"),
    ("eval.sampler=bogus", "eval.sampler bogus is unknown for diffusion.objective=ddpm; choose ddpm, ddim or dpm-solver"),
])
def test_declared_ranges_and_choices(override, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        load_config(None, [*TINY, override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["eval.sampler=heun"], "eval.sampler heun does not fit diffusion.objective=ddpm; choose ddpm, ddim or dpm-solver"),
    (["eval.steps=5000"], "eval.steps 5000 must be between 1 and the model's 1000 training timesteps"),
    (["eval.metrics=[fid]"], "eval.metrics fid need eval.ref"),
    (["eval.metrics=[fid,is]", "eval.ref=/nonexistent/ref.npz"], "eval.ref /nonexistent/ref.npz does not exist"),
    (["data.kind=images", "data.path=.", "eval.metrics=[digits]"], "eval.metrics=digits scores 8x8 digits"),
    (["eval.cfg_scales=[1.5,-1]"], "eval.cfg_scales -1.0 is negative"),
    (["train.cfg_scale_for_grids=-2"], "train.cfg_scale_for_grids -2.0 is negative"),
    (["eval=5"], "the eval section must be a mapping of its keys (eval: {key: value, ...}), got 5"),
])
def test_eval_settings_are_checked_at_load(overrides, message):
    """What the evaluator would refuse once the run folder exists is refused by load_config."""
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, [*TINY, *overrides])


def test_eval_files_are_checked_at_load(tmp_path):
    ref, weights = tmp_path / "ref.npz", tmp_path / "inception.pth"
    ref.write_bytes(b"")
    fid = [*TINY, "eval.metrics=[fid]"]
    with pytest.raises(UserError, match="eval.ref .*missing.npz does not exist") as err:
        load_config(None, [*fid, f"eval.ref={tmp_path / 'missing.npz'}",
                           f"eval.inception_weights={tmp_path / 'no.pth'}"])
    assert "Inception" not in str(err.value)  # the missing reference is named, not the weights
    with pytest.raises(UserError, match="eval.inception_weights is not set"):
        load_config(None, [*fid, f"eval.ref={ref}"])
    with pytest.raises(UserError, match="eval.inception_weights .*no.pth does not exist"):
        load_config(None, [*fid, f"eval.ref={ref}", f"eval.inception_weights={tmp_path / 'no.pth'}"])
    weights.write_bytes(b"")
    assert load_config(None, [*fid, f"eval.ref={ref}", f"eval.inception_weights={weights}"]).eval.metrics == ["fid"]
    # eval.ref alone asks for FID on latents (eval.metrics null), so the weights are needed too
    with pytest.raises(UserError, match="eval.inception_weights is not set"):
        load_config(None, [*TINY, "data.kind=latents", f"data.path={tmp_path}", f"eval.ref={ref}"])


def test_one_guidance_scale_rule():
    from ancre_dit.sampling.guidance import Guidance

    for bad, message in ((-1.0, "is negative"), (float("nan"), "not a finite number")):
        with pytest.raises(UserError, match=message):
            Guidance(bad)
    assert Guidance(0.0).scale == 0.0  # 0 = the unconditional model, 1 = no guidance
    c = load_config(None, [*TINY, "eval.cfg_scales=[0,1,4]", "train.cfg_scale_for_grids=0"])
    assert c.eval.cfg_scales == [0.0, 1.0, 4.0] and c.train.cfg_scale_for_grids == 0.0


def test_metric_names_come_from_the_evaluation_package():
    from ancre_dit.evaluation.metric_registry import metric_names
    from ancre_dit.evaluation.pipeline import ADM_METRICS, DEFAULT_METRICS, METRICS

    # what eval.metrics accepts (check_evaluation reads the table at each check)
    assert metric_names(training=True) == ("digits", *ADM_METRICS, "fd_dinov2") and DEFAULT_METRICS == ADM_METRICS
    assert set(ADM_METRICS) < set(METRICS)


@pytest.mark.parametrize("overrides, message", [
    (["train.foo=1"], "unknown config key train.foo; valid keys of train: global_batch_size, max_steps"),
    (["model.gian=1"], "unknown config key model.gian; valid keys of model: name, topology"),
    (["eval.bogus.x=1"], "unknown config key eval.bogus; valid keys of eval: num_samples"),
    (["train.max_steps=abc"], "train.max_steps must be a valid integer, got 'abc'"),
    (["train.lr=fast"], "train.lr must be a valid number, got 'fast'"),
    (["train.lr=true"], "train.lr must be a valid number, got True"),
    (["model.tau=abc"], "model.tau must be a valid number, got 'abc'"),
    (["model.hc_streams=2.5"], "model.hc_streams must be a valid integer, got 2.5"),
    (["run_dir={a: 1}"], "run_dir must be a valid string, got {'a': 1}"),
    (["model.name.x=1"], "model.name must be a valid string"),
    (["run_dir="], "run_dir must be a valid string, got null"),
    (["eval.cfg_scales=[a]"], "eval.cfg_scales must be a valid number, got 'a'"),
    (["eval.cfg_scales={a: 1}"], "eval.cfg_scales must be a valid number"),
    (["eval.metrics=[]"], "eval.metrics must have at least 1 item, got []"),
    (["data.vae=false"], "data.vae must be a valid string, got False"),
    (["train.mixed_precision=true"], "train.mixed_precision must be 'no', 'bf16' or 'fp16', got True"),
    (["model=3"], "the model section must be a mapping of its keys"),
    (["model.topology_options=5"], "model.topology_options is not a config key; set each topology option as "
                                   "model.<option>"),
])
def test_type_errors_are_one_user_error_line(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        load_config(None, [*TINY, *overrides])
    assert "\n" not in str(err.value) and type(err.value).__module__.startswith("ancre_dit")


def test_errors_in_a_config_file_name_the_key(tmp_path):
    (tmp_path / "c.yaml").write_text("train: {max_steps: many}\n")
    with pytest.raises(UserError, match="train.max_steps must be a valid integer, got 'many'"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("train: {max_stepz: 3}\n")
    with pytest.raises(UserError, match="unknown config key train.max_stepz"):
        load_config(tmp_path / "c.yaml", ["train.max_steps=4"])
    (tmp_path / "c.yaml").write_text("train: {max_steps: 3}\n")  # a later override wins, and names its value
    with pytest.raises(UserError, match="got 'x'"):
        load_config(tmp_path / "c.yaml", ["train.max_steps=x"])


def test_bad_eval_settings_stop_train_py_before_the_run_folder(tmp_path, monkeypatch):
    """train.py builds the Trainer (which makes the run folder) only from a config that passed."""
    main = runpy.run_path(str(ROOT / "train.py"), run_name="config_test")["main"]
    run = tmp_path / "run"
    for bad in ("eval.sampler=bogus", "eval.steps=5000", "eval.metrics=[fid]", "eval.seed=-1", "eval=5"):
        monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(ROOT / "configs" / "digits-ancre.yaml"),
                                          f"run_dir={run}", bad])
        with pytest.raises(UserError):
            main()
        assert not run.exists(), bad
