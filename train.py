"""Trains a class-conditional DiT (ANCRe or cascaded residuals) from a YAML config.

    accelerate launch train.py --config configs/digits-ancre.yaml [train.max_steps=20 ...] [--resume auto|PATH]
"""
from __future__ import annotations

from ancre_dit.cli import CommandParser, run_cli


def main() -> int:
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--resume", default=None, metavar="auto|PATH",
                        help="'auto': newest complete checkpoint of run_dir (fresh start if none); or a checkpoint folder")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. train.max_steps=20 run_dir=results/try")
    args = parser.parse_intermixed_args()  # overrides may come before and after --resume
    from ancre_dit.training import load_config, train  # after argparse: --help stays fast
    from ancre_dit.training.config import check_unique_overrides

    config = load_config(args.config, check_unique_overrides(args.overrides))
    train(config, resume=args.resume)
    return 0


if __name__ == "__main__":
    run_cli(main)
