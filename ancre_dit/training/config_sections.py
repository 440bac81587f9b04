"""The training configuration's schema: a pydantic dataclass per section, each field with its type,
default and range (what a value means is checked by building its user: config_checks.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from ..data.latent_norm import LATENT_NORMS
from ..diffusion import OBJECTIVES, TIME_SAMPLINGS
from ..diffusion.paths import LOSS_WEIGHTS, PATHS, PREDICTIONS
from ..models.dit import ARCHITECTURE_DEFAULTS as ARCH
from .guards import POLICIES

# Strict types: 3 is no bool, 2.5 no int, true no number, false no string.
Bool, Int, Float, Str = StrictBool, StrictInt, StrictFloat, StrictStr


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]  # eval.cfg_scales=1.5 is [1.5]


FloatList = Annotated[list[Float], BeforeValidator(_as_list), Field(min_length=1)]
StrList = Annotated[list[Str], BeforeValidator(_as_list), Field(min_length=1)]
# YAML 1.1 reads an unquoted `no` as false: as a precision it is the string "no".
Precision = Annotated[Literal["no", "bf16", "fp16"], BeforeValidator(lambda v: "no" if v is False else v)]
section = dataclass(config=ConfigDict(extra="forbid", allow_inf_nan=False))


@section
class ModelConfig:
    name: Str = "DiT-S/2"
    topology: Str = "ancre"
    learn_sigma: Bool = True
    class_dropout: Float = Field(0.1, ge=0, lt=1)
    # Overrides of the named size (small custom models); null = the named size's.
    depth: Int | None = Field(None, ge=1)
    hidden_size: Int | None = Field(None, ge=1)
    num_heads: Int | None = Field(None, ge=1)
    patch_size: Int | None = Field(None, ge=1)  # e.g. 1 for LightningDiT-XL/1 on f16 latents
    # The block's layers: DiT's by default; rmsnorm + swiglu + rope2d + qk_norm is LightningDiT's.
    norm: Str = ARCH["norm"]
    mlp: Str = ARCH["mlp"]
    pos_embed: Str = ARCH["pos_embed"]
    qk_norm: Bool = ARCH["qk_norm"]
    # Tsallis-entropy (q = 2) penalty on ANCRe's incoming weights, toward sparse topologies; 0 = off.
    topology_entropy_weight: Float = Field(0.0, ge=0)
    # The aggregation (see DiT): history dtype under bf16, kernels, sparse ANCRe's edges per block (0 = dense).
    history_dtype: Str = ARCH["history_dtype"]
    aggregation_kernel: Str = ARCH["aggregation_kernel"]
    topology_topk: Int = Field(ARCH["topology_topk"], ge=0)
    # Given as `model.<option>=value` (model.tau, ...); the chosen topology's defaults added at load.
    topology_options: dict[str, Any] = Field(default_factory=dict)


@section
class DataConfig:
    kind: Literal["digits", "latents", "images"] = "latents"
    path: Str | None = None           # latent dir (latents) or ImageFolder root (images)
    image_size: Int = Field(256, ge=1)  # pixels of the decoded image
    num_workers: Int = Field(4, ge=0)   # 0 = load in the main process
    vae: Str | None = None            # local VAE folder for sample grids (latents; default: manifest's)
    in_memory: Bool = False           # latents: load every shard into RAM once (batches are then an index_select)
    # latents: scale = the VAE's scaling/shift; channel = also (x - mean) / std per channel (manifest stats)
    latent_norm: Literal[tuple(LATENT_NORMS)] = "scale"


@section
class PhemaConfig:
    """Post-hoc EMA (EDM2, training/phema.py): power-function EMAs of these relative stds, snapshots
    every snapshot_every steps; scripts/reconstruct_ema.py rebuilds any std."""
    stds: list[Float] = Field(default_factory=list)
    snapshot_every: Int = Field(0, ge=0)


@section
class TrainConfig:
    global_batch_size: Int = Field(256, ge=1)
    max_steps: Int = Field(400_000, ge=1)
    lr: Float = Field(1.0e-4, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    adam_beta1: Float = Field(0.9, ge=0, lt=1)
    adam_beta2: Float = Field(0.999, ge=0, lt=1)
    warmup_steps: Int = Field(0, ge=0)  # linear warm-up of the lr, before any schedule
    # After the warm-up: constant, cosine / linear to min_lr at max_steps, or EDM2's 1/sqrt after lr_decay_start.
    lr_schedule: Literal["constant", "cosine", "linear", "inverse-sqrt"] = "constant"
    min_lr: Float = Field(0.0, ge=0)
    lr_decay_start: Int = Field(0, ge=0)
    # The routing parameters: lr x topology_lr_mult (0 = held), held for topology_warmup_steps, own decay.
    topology_lr_mult: Float = Field(1.0, ge=0)
    topology_warmup_steps: Int = Field(0, ge=0)
    topology_weight_decay: Float = Field(0.0, ge=0)
    topology_sparsify_step: Int = Field(0, ge=0)  # with model.topology_topk: dense up to it, then sparsified
    grad_clip: Float = Field(0.0, ge=0)  # max global grad norm; 0 = off
    ema_decay: Float = Field(0.9999, ge=0, le=1)
    ema_warmup: Bool = False          # ramp the decay up from 0 (timm's warmup), for short runs
    # More EMAs of other decays beside ema_decay's, each saved as ema-<decay>.safetensors (sample.py --ema).
    ema_decays: Annotated[list[Annotated[Float, Field(ge=0, le=1)]], BeforeValidator(_as_list)] = Field(
        default_factory=list)
    phema: PhemaConfig = Field(default_factory=PhemaConfig)
    mixed_precision: Precision = "bf16"
    grad_accum: Int = Field(1, ge=1)
    ckpt_every: Int = Field(50_000, ge=1)
    keep_last: Int = Field(0, ge=0)   # keep the newest N checkpoints; 0 = keep all
    log_every: Int = Field(100, ge=1)
    diagnostics: Bool = True  # depth diagnostics of a fixed batch every log_every steps (logs/diagnostics.jsonl)
    sample_every: Int = Field(10_000, ge=0)  # EMA sample grid every N steps; 0 = never
    num_sample_images: Int = Field(16, ge=0)
    cfg_scale_for_grids: Float = 4.0
    sample_steps: Int = Field(50, ge=1)  # steps of the grid sampler (the objective's default one)
    eval_every: Int = Field(0, ge=0)  # evaluation (see EvalConfig) every N steps and at the end; 0 = never
    seed: Int = Field(0, ge=0)
    # Non-finite loss / grad norm: skip the update or stop; skip stops after nonfinite_max_skips in a row.
    nonfinite: Literal[POLICIES] = "skip"
    nonfinite_max_skips: Int = Field(10, ge=0)
    compile: Bool = False
    grad_checkpointing: Bool = False  # recompute each block's activations in backward (less memory, ~1 more forward)
    tf32: Bool = True
    stop_check_every: Int = Field(10, ge=1)  # ranks agree on a stop signal (a host all-reduce; docs/cluster.md)
    # Seconds a rank waits in a collective (NCCL's 600 is short for the main rank's lone work at start-up).
    collective_timeout_s: Float = Field(1800.0, gt=0)
    # Peak dense bf16 TFLOP/s of one device for the logged MFU; null = from the GPU's name (hardware.py).
    peak_tflops: Float | None = Field(None, gt=0)


@section
class EvalConfig:
    """An evaluation (every train.eval_every steps, and `evaluate.py --run`): EMA samples with a fixed
    seed, sampler and steps per cfg scale. `metrics` (evaluation/metric_registry.py) null: digits on
    digits data, fid when `ref` is set, else none (held-out loss only)."""
    num_samples: Int = Field(1000, ge=1)
    batch_size: Int = Field(250, ge=1)  # images per sampling part (part j goes to process j % world)
    # null: the objective's default sampler and that sampler's default steps
    sampler: Str | None = None
    steps: Int | None = Field(None, ge=1)
    time_shift: Float = Field(1.0, gt=0)  # euler / heun: LightningDiT's timestep shift (sample.py --time-shift)
    cfg_scales: FloatList = Field(default_factory=lambda: [1.0])
    seed: Int = Field(0, ge=0)
    metrics: StrList | None = None
    # ema, ema-<decay> (train.ema_decays), phema-<std> (train.phema.stds); others log <metric>@<name>.
    emas: StrList = Field(default_factory=lambda: ["ema"])
    # Autoguidance: guide at cfg_scales with this checkpoint folder's EMA instead of the unconditional model.
    guide_ckpt: Str | None = None
    ref: Str | None = None            # ADM reference npz, or one from evaluate.py --save-ref-stats
    inception_weights: Str | None = None
    dinov2_weights: Str | None = None  # fd_dinov2: local timm weights file of dinov2_model
    dinov2_model: Str = "vit_large_patch14_dinov2"
    heldout_loss: Bool = True         # loss on fixed held-out examples with fixed noise and times
    heldout_draws: Int = Field(4, ge=1)    # (noise, time) pairs per held-out example
    heldout_max: Int = Field(1000, ge=1)   # at most this many held-out examples (the first ones)
    val_path: Str | None = None       # latents: a latent directory of held-out examples
    heldout_from_train: Int = Field(0, ge=0)  # latents: hold out the last N training samples (training skips them)


@section
class DiffusionConfig:
    objective: Literal[OBJECTIVES] = "ddpm"  # ddpm (DiT) or flow (SiT)
    time_sampling: Literal[TIME_SAMPLINGS] = "uniform"  # flow: uniform (SiT) or logit-normal (SD3)
    logit_mean: Float = 0.0           # logit-normal location
    logit_std: Float = Field(1.0, gt=0)  # logit-normal scale
    # flow: LightningDiT's cosine loss 1 - cos(v_pred, v) beside the MSE, with this weight (its recipe: 1)
    cosine_loss_weight: Float = Field(0.0, ge=0)
    # flow: SiT's interpolant (gvp = REPA's cosine path), prediction and loss weight (diffusion/paths.py)
    path: Literal[tuple(PATHS)] = "linear"
    prediction: Literal[PREDICTIONS] = "velocity"
    loss_weight: Literal[LOSS_WEIGHTS] = "none"


@section
class RepaConfig:
    """REPA (training/repa.py): the state after block `depth` is aligned, through a trained projector,
    with a frozen encoder's patch tokens of the clean image. Off at weight 0 (REPA's recipe: 0.5)."""
    weight: Float = Field(0.0, ge=0)
    depth: Int = Field(8, ge=1)       # the block whose output is aligned, 1..model depth
    encoder: Str = "vit_base_patch14_dinov2.lvd142m"  # a timm model name
    encoder_weights: Str | None = None  # a local file of the encoder's weights (nothing is downloaded)
    encoder_kwargs: dict[str, Any] = Field(default_factory=dict)  # extra timm.create_model arguments
    projector_dim: Int = Field(2048, ge=1)
    encoder_resolution: Int | None = Field(None, ge=1)  # null = the DiT token grid x the encoder's patch size


@section
class LogConfig:
    tensorboard: Bool = True
    figures: Bool = True  # the PNG figures (their data, topology.json and the jsonl logs, is written either way)
    wandb: Bool = False
    project: Str = "ancre-dit"


@section
class Config:
    run_dir: Str = "results/run"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    repa: RepaConfig = Field(default_factory=RepaConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
