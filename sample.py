"""Class-conditional samples from a trained DiT, in the ADM .npz layout.

    python sample.py --ckpt RUN/checkpoints/<step> --num-samples 100 --cfg-scale 1.5 --out samples.npz --grid grid.png
    accelerate launch sample.py --ckpt RUN/checkpoints/<step> --num-samples 50000 --out samples.npz

Each process samples its own share; finished batches are kept in OUT.parts/ so rerunning the same
command resumes an interrupted job; sample i depends only on (seed, i).
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from ancre_dit.cli import COLLECTIVE_TIMEOUT_S, CommandParser, output_file, output_folder, run_cli
from ancre_dit.diffusion import LAST_STEPS, SAMPLERS
from ancre_dit.diffusion.sampler_registry import sampler_help, steps_help
from ancre_dit.sampling import JobSettings, run_job
from ancre_dit.sampling.guidance import PRECISIONS, parse_interval
from ancre_dit.sampling.protocols import PROTOCOLS, apply_protocol, describe


def _classes(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of class ids, e.g. 1,2,3") from None


def _ema_weights(name: str) -> str:
    return name if name.startswith(("ema-", "phema-")) else f"ema-{name}"


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint folder RUN/checkpoints/<step>")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weights", choices=("ema", "model"), default="ema", help="EMA (default) or raw weights")
    weights.add_argument("--ema", default=None, metavar="NAME",
                         help="another EMA the run kept: a decay of train.ema_decays (0.999: ema-0.999.safetensors) "
                              "or a post-hoc EMA's file name (phema-0.05)")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--out", default="samples.npz", help="merged ADM .npz (arr_0 uint8 NHWC images, arr_1 labels)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward (per process)")
    p.add_argument("--sampler", choices=tuple(SAMPLERS), default=None, help=sampler_help())
    p.add_argument("--steps", type=int, default=None, help=steps_help())
    p.add_argument("--sde-last-step", choices=LAST_STEPS, default="mean", help="SiT's last SDE step (--sampler sde)")
    p.add_argument("--sde-last-step-size", type=float, default=0.04, help="time covered by the last SDE step")
    p.add_argument("--sde-diffusion-norm", type=float, default=1.0,
                   help="scale of SiT's SDE diffusion coefficient w(t) = norm * (1 - t)")
    p.add_argument("--time-shift", type=float, default=1.0,
                   help="LightningDiT's timestep shift of the euler / heun grid, t' = s t / (1 + (s - 1) t) with t = 0 "
                        "noise; s < 1 puts more steps near the noise (LightningDiT: 0.3; SD3's shift k is 1 / k); "
                        "default 1 = none")
    p.add_argument("--cfg-scale", type=float, default=None,
                   help="classifier-free guidance scale; 1 = none (default 1.5, or the --protocol's headline scale)")
    p.add_argument("--cfg-channels", type=int, default=None,
                   help="guide only the first N latent channels (3 = original DiT); default all")
    p.add_argument("--guidance-interval", default=None, metavar="LO,HI",
                   help="guide only at normalised times LO <= u <= HI, u in [0, 1] with 0 = data and 1 = noise, "
                        "for every objective (DDPM timestep t is u = t/999)")
    p.add_argument("--guide-ckpt", default=None, metavar="CKPT",
                   help="autoguidance: guide with this weaker model (a smaller one, or an earlier checkpoint of the "
                        "same run; same latent space, classes and objective) instead of the unconditional one: "
                        "D_weak + w (D - D_weak) with w = --cfg-scale, within --guidance-interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=tuple(PROTOCOLS), default=None,
                   help="a source's sampling protocol for its headline FID: " + "; ".join(
                       f"{name}: {p.describes}" for name, p in PROTOCOLS.items()) +
                   " (docs/sampling.md lists what each sets); flags that contradict it are refused")
    labels = p.add_mutually_exclusive_group()
    labels.add_argument("--classes", type=_classes, default=None, help="class ids cycled over the samples, e.g. 1,2,3")
    labels.add_argument("--random-classes", action="store_true",
                        help="draw each sample's class at random (default: balanced, sample i gets class i %% K)")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32", help="autocast dtype of the DiT")
    p.add_argument("--vae", default=None, help="local AutoencoderKL folder (overrides the one the run names)")
    p.add_argument("--png-dir", default=None, help="also write one PNG per sample here")
    p.add_argument("--grid", default=None, help="also write a grid PNG of the first --grid-max samples")
    p.add_argument("--grid-max", type=int, default=100)
    p.add_argument("--keep-parts", action="store_true", help="keep OUT.parts/ after merging")
    p.add_argument("--cpu", action="store_true", help="sample on the CPU even if a GPU is present")
    p.add_argument("--collective-timeout-s", type=float, default=COLLECTIVE_TIMEOUT_S,
                   help="under a launcher, seconds a process waits for the others in a collective (default %(default)g)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the DiT with static shapes (the last batch is padded); worth it for large "
                        "jobs such as FID-50K, where the compile time is small next to the sampling")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="full fp32 matrix products on CUDA (default TF32, as train.tf32 and DiT's sampler)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    output_file(a.out, (".npz",))
    if a.grid:
        output_file(a.grid, (".png",), "--grid")
    if a.png_dir:
        output_folder(a.png_dir, "sample PNG folder", "000000.png", "--png-dir")
    flags = {f.name: getattr(a, f.name) for f in fields(JobSettings) if hasattr(a, f.name)}  # flags named as the fields
    if a.cfg_scale is None:  # the protocol's headline scale, else the default
        flags["cfg_scale"] = PROTOCOLS[a.protocol].cfg_scale if a.protocol else JobSettings.cfg_scale
    settings = apply_protocol(JobSettings(**{
        **flags, "weights": _ema_weights(a.ema) if a.ema else a.weights,
        "guidance_interval": parse_interval(a.guidance_interval),
        "label_mode": "random" if a.random_classes else "balanced"}), a.protocol)
    if a.protocol:
        print(describe(a.protocol))
    run_job(settings)
    return 0


if __name__ == "__main__":
    run_cli(main)
