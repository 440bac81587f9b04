"""The training configuration's schema: one dataclass per section (run_dir, model, data, train,
diffusion, repa, eval, log), each field with its default and, declared beside it, what it accepts
beyond its type (`ranged`, `choice`, `checked`: a `Rule` of ancre_dit/ranges.py, the language topology
options are declared in too), which one loop checks (`check_fields`).

Reading a YAML file and overrides into these is config.py's job; the checks that involve several
fields or the file system are config_checks.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..diffusion import ALL_SAMPLERS, OBJECTIVES, TIME_SAMPLINGS
from ..data.latent_norm import LATENT_NORMS
from ..errors import UserError
from ..evaluation.metric_registry import TRAINING_METRICS
from ..models import DIT_MODELS, TOPOLOGIES
from ..models.layers import DEFAULTS as BLOCK_DEFAULTS
from ..models.layers import MLPS, NORMS, POS_EMBEDS
from ..models.topologies import AGGREGATION_KERNELS, HISTORY_DTYPES, topology_entry
from ..ranges import Rule, check_value, or_list  # noqa: F401  (or_list: config_checks' wording)
from ..sampling.guidance import check_guidance_scale

DATA_KINDS = ("digits", "latents", "images")
PRECISIONS = ("no", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "stop")  # train.nonfinite (training/guards.py)
RULE_KEY = "rule"  # the dataclasses.field metadata key of a field's Rule


def _declared(default: Any, rule: Rule) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={RULE_KEY: rule})
    return field(default=default, metadata={RULE_KEY: rule})


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, hint: str = "") -> Any:
    """A numeric field with its valid range, e.g. `lr: float = ranged(1e-4, gt=0)`."""
    return _declared(default, Rule(ge=ge, gt=gt, le=le, lt=lt, hint=hint))


def choice(default: Any, choices: Iterable[str], noun: str | None = None) -> Any:
    """A field that names one of `choices`, e.g. `kind: str = choice("latents", DATA_KINDS, "data kind")`."""
    return _declared(default, Rule(choices=choices, noun=noun))


def checked(default: Any, check: Callable[[str, Any], None]) -> Any:
    """A field whose rule is defined where the value is used (e.g. the guidance scale's)."""
    return _declared(default, Rule(check=check))


@dataclass
class ModelConfig:
    name: str = choice("DiT-S/2", DIT_MODELS, "model")
    topology: str = choice("ancre", TOPOLOGIES, "topology")
    learn_sigma: bool = True
    class_dropout: float = ranged(0.1, ge=0, lt=1)
    # Overrides of the named size (small custom models); null = the named size's.
    depth: int | None = ranged(None, ge=1, hint="null = the named size's")
    hidden_size: int | None = ranged(None, ge=1, hint="null = the named size's")
    num_heads: int | None = ranged(None, ge=1, hint="null = the named size's")
    # The block's layers: the 2022 DiT by default; rmsnorm + swiglu + rope2d + qk_norm is LightningDiT's.
    norm: str = choice(BLOCK_DEFAULTS["norm"], NORMS)
    mlp: str = choice(BLOCK_DEFAULTS["mlp"], MLPS)
    pos_embed: str = choice(BLOCK_DEFAULTS["pos_embed"], POS_EMBEDS)
    qk_norm: bool = BLOCK_DEFAULTS["qk_norm"]
    # Weight of the Tsallis-entropy (q = 2) penalty on ANCRe's incoming weights, added to the loss
    # to push toward sparse topologies (ancre_dit.models.topologies.analysis.tsallis_entropy); 0 = off.
    topology_entropy_weight: float = ranged(0.0, ge=0, hint="0 = off")
    # The dtype of a weighted-history topology's kept history under bf16 autocast (the stream
    # itself keeps its own): bfloat16 halves the bytes of the history reads where the sums run
    # fused (compiled); the eager form then sums edge by edge (BENCHMARKS.md, traffic model).
    history_dtype: str = choice("float32", HISTORY_DTYPES, "history dtype")
    # The eager aggregation's sums as Triton kernels (the extra `triton`): auto = on CUDA when triton
    # is installed, triton = the same with the package required, torch = never; compiled: the chain.
    aggregation_kernel: str = choice("torch", AGGREGATION_KERNELS, "aggregation kernel")
    # Sparse ANCRe: from train.topology_sparsify_step on, each block keeps its K strongest incoming
    # edges (the softmax renormalised over them, the others skipped); 0 = dense throughout.
    topology_topk: int = ranged(0, ge=0, hint="0 = dense")
    # Topology options, set as `model.<option>=value` (model.tau, model.hc_streams, ...): the ones
    # given, plus the chosen topology's defaults once loaded. The registry declares them.
    topology_options: dict[str, Any] = field(default_factory=dict)


# Model fields recorded in a run's model spec only where they differ from these, so that the specs
# of runs from before they existed stay what they were (and those runs resume).
AGGREGATION_DEFAULTS = {"history_dtype": "float32", "topology_topk": 0, "aggregation_kernel": "torch"}


def topology_options_of(m: ModelConfig) -> dict[str, Any]:
    """The options the chosen topology is built with: those given, else its defaults (checked where
    they are resolved: once when the config loads, once when create_model builds the topology)."""
    options = topology_entry(m.topology).options
    return {key: m.topology_options.get(key, option.default) for key, option in options.items()}


@dataclass
class DataConfig:
    kind: str = choice("latents", DATA_KINDS, "data kind")
    path: str | None = None           # latent dir (latents) or ImageFolder root (images)
    image_size: int = ranged(256, ge=1)  # pixels of the decoded image
    num_workers: int = ranged(4, ge=0, hint="0 = load in the main process")
    vae: str | None = None            # local VAE folder for sample grids (latents; default: manifest's)
    in_memory: bool = False           # latents: load every shard into RAM once (batches are then an index_select)
    # latents: scale = as stored (VAE scaling/shift); channel = also (x - mean) / std per channel (manifest stats)
    latent_norm: str = choice("scale", LATENT_NORMS, "latent normalisation")


@dataclass
class TrainConfig:
    global_batch_size: int = ranged(256, ge=1)
    max_steps: int = ranged(400_000, ge=1)
    lr: float = ranged(1.0e-4, gt=0)
    weight_decay: float = ranged(0.0, ge=0)
    adam_beta1: float = ranged(0.9, ge=0, lt=1)
    adam_beta2: float = ranged(0.999, ge=0, lt=1)
    warmup_steps: int = ranged(0, ge=0)
    # The routing parameters' own optimizer settings (each topology declares which of its parameters
    # route across depth): their lr is lr x topology_lr_mult (under Adam, tau acts as one more such
    # multiplier on the logits), they are held at their initial values for the first
    # topology_warmup_steps steps, and decay by topology_weight_decay (0: the logits never decay).
    topology_lr_mult: float = ranged(1.0, ge=0, hint="0 = routing held at its initial values")
    topology_warmup_steps: int = ranged(0, ge=0, hint="steps with the routing held at its initial values")
    topology_weight_decay: float = ranged(0.0, ge=0)
    # With model.topology_topk: the step after which the topology is sparsified (dense up to it).
    topology_sparsify_step: int = ranged(0, ge=0, hint="0 = never")
    grad_clip: float = ranged(0.0, ge=0, hint="max global grad norm; 0 = off")
    ema_decay: float = ranged(0.9999, ge=0, le=1)
    ema_warmup: bool = False          # ramp the decay up from 0 (timm's warmup), for short runs
    mixed_precision: str = choice("bf16", PRECISIONS)
    grad_accum: int = ranged(1, ge=1)
    ckpt_every: int = ranged(50_000, ge=1)
    keep_last: int = ranged(0, ge=0, hint="keep the newest N checkpoints; 0 = keep all")
    log_every: int = ranged(100, ge=1)
    # Depth diagnostics (forward inflation, backward decay, redundancy, routing) of a fixed batch
    # every log_every steps: logs/diagnostics.jsonl, TensorBoard, diagnostics.png.
    diagnostics: bool = True
    sample_every: int = ranged(10_000, ge=0, hint="EMA sample grid every N steps; 0 = never")
    num_sample_images: int = ranged(16, ge=0)
    cfg_scale_for_grids: float = checked(4.0, check_guidance_scale)
    sample_steps: int = ranged(50, ge=1)  # steps of the grid sampler (the objective's default one)
    # Evaluation (see EvalConfig) every N steps and at the end; 0 = never.
    eval_every: int = ranged(0, ge=0, hint="0 = no evaluation")
    seed: int = ranged(0, ge=0)
    # Non-finite loss / grad norm: skip the update, or stop the run; with skip, stop after more
    # than nonfinite_max_skips in a row.
    nonfinite: str = choice("skip", NONFINITE_POLICIES)
    nonfinite_max_skips: int = ranged(10, ge=0)
    compile: bool = False
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~1 more forward)
    tf32: bool = True
    # Ranks agree on a stop signal every N steps (a host-side all-reduce, no GPU wait): the stop
    # latency is at most N steps plus the checkpoint's write (docs/cluster.md).
    stop_check_every: int = ranged(10, ge=1)
    # Seconds a rank waits in a collective before the job fails (NCCL's own default is 600): the main
    # rank may work alone for minutes (filling a node's in-memory latents, the evaluation's reference
    # features, a large checkpoint on a slow filesystem) while the others wait for it.
    collective_timeout_s: float = ranged(1800.0, gt=0)
    # Peak dense bf16 TFLOP/s of one device, for the logged MFU; null = from the GPU's name
    # (ancre_dit.hardware), none for a CPU.
    peak_tflops: float | None = ranged(None, gt=0, hint="null = from the device's name")


@dataclass
class EvalConfig:
    """What an evaluation measures (run every train.eval_every steps, and by `evaluate.py --run`).

    Samples come from the EMA weights with a fixed seed, sampler and step count, once per cfg scale.
    `metrics`: "digits" (held-out classifier accuracy + Fréchet distance on that classifier's
    features; NOT FID) and/or Inception metrics (fid, sfid, is, precision, recall) and fd_dinov2
    (DINOv2 features, `dinov2_weights`) against `ref`;
    null = digits on digits data, fid when `ref` is set, else none (held-out loss only)."""
    num_samples: int = ranged(1000, ge=1)
    batch_size: int = ranged(250, ge=1)  # images per sampling part (part j goes to process j % world)
    # null: the objective's default sampler (DDPM: ddpm; flow: heun), and that sampler's default step count
    sampler: str | None = choice(None, ALL_SAMPLERS, "sampler")
    steps: int | None = ranged(None, ge=1, hint="null = the sampler's default")
    cfg_scales: list[float] = checked([1.0], check_guidance_scale)
    seed: int = ranged(0, ge=0)
    metrics: list[str] | None = choice(None, TRAINING_METRICS, "metric")
    ref: str | None = None            # ADM reference npz, or one from evaluate.py --save-ref-stats
    inception_weights: str | None = None
    dinov2_weights: str | None = None  # fd_dinov2: local timm weights file of dinov2_model
    dinov2_model: str = "vit_large_patch14_dinov2"
    heldout_loss: bool = True         # loss on fixed held-out examples with fixed noise and times
    heldout_draws: int = ranged(4, ge=1)    # (noise, time) pairs per held-out example
    heldout_max: int = ranged(1000, ge=1)   # at most this many held-out examples (the first ones)
    val_path: str | None = None       # latents: a latent directory of held-out examples
    # latents: hold out the last N training samples (training skips them)
    heldout_from_train: int = ranged(0, ge=0, hint="0 = none")


@dataclass
class DiffusionConfig:
    objective: str = choice("ddpm", OBJECTIVES, "objective")  # ddpm (DiT) or flow (SiT's linear interpolant)
    time_sampling: str = choice("uniform", TIME_SAMPLINGS, "time sampling")  # flow: uniform (SiT) or logit-normal (SD3)
    logit_mean: float = 0.0           # logit-normal location
    logit_std: float = ranged(1.0, gt=0)  # logit-normal scale


@dataclass
class RepaConfig:
    """Representation alignment (REPA, training/repa.py): a frozen pretrained encoder's patch tokens of
    the clean image are matched, through a trained projector, by the DiT's state after block `depth`.
    Off at weight 0; the sampled model never holds the projector."""
    weight: float = ranged(0.0, ge=0, hint="0 = off; REPA's recipe uses 0.5")
    depth: int = ranged(8, ge=1, hint="the block whose output is aligned, 1..model depth")
    encoder: str = "vit_base_patch14_dinov2.lvd142m"  # a timm model name
    encoder_weights: str | None = None  # a local file of the encoder's weights (nothing is downloaded)
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments
    projector_dim: int = ranged(2048, ge=1)
    encoder_resolution: int | None = ranged(None, ge=1, hint="null = the DiT token grid x the encoder's patch size")


@dataclass
class LogConfig:
    tensorboard: bool = True
    # The PNG figures: topology heatmaps at checkpoints, loss.png, quality.png, diagnostics.png
    # (their data, topology.json and the jsonl logs, is written either way).
    figures: bool = True
    wandb: bool = False
    project: str = "ancre-dit"


@dataclass
class Config:
    run_dir: str = "results/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    repa: RepaConfig = field(default_factory=RepaConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)



def check_fields(section: Any, prefix: str = "") -> None:
    """Every field's declared rule (range, choices or check), and every float finite."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{key}.")
        else:
            check_value(key, value, f.metadata.get(RULE_KEY))
