"""The GPU check's end-to-end item: a user's whole path on synthetic latents, timed.

train.py under torchrun (or alone), with no step limit in reach -> SIGTERM to the launcher once half the
steps are logged (it forwards it to the ranks, which checkpoint and exit) -> `--resume auto` for the other
half -> sample.py with DDPM-250 and DPM-Solver
(a random tiny VAE decodes) -> evaluate.py with random Inception weights (timing and plumbing, not
a real FID). Training runs as a user launches it (subprocesses); sample.py's and evaluate.py's
main() run in this process with their command lines. One row per stage, one table in gpu_check.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_check_plan import Deadline, ItemCut, kill_group, run_child

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE_STEP = 10**8


def tiny_vae(path: Path) -> Path:
    """A random AutoencoderKL with SD's layout (4 latent channels, 8x downsampling), tiny widths."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8).save_pretrained(path)
    return path


def _run(cmd: list[str], env: dict, cwd: Path, what: str, deadline: Deadline) -> float:
    start = time.perf_counter()
    proc = run_child(cmd, deadline, what, env=env, cwd=cwd)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"{what} exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
    return time.perf_counter() - start


def _in_process(script: str, argv: list[str]) -> float:
    """A command's main() in this process, with its argv: the same code path as the command line,
    without a second interpreter and torch import per stage."""
    import runpy
    from unittest import mock

    start = time.perf_counter()
    main = runpy.run_path(str(ROOT / script))["main"]
    with mock.patch.object(sys, "argv", [script, *argv]):
        main(argv) if script == "sample.py" else main()
    return time.perf_counter() - start


def _latest_step(run_dir: Path) -> int | None:
    from ancre_dit.training.checkpointing import list_checkpoints

    found = list_checkpoints(run_dir)
    return found[-1][0] if found else None


def _logged_step(run_dir: Path) -> int:
    from ancre_dit.files import read_jsonl

    rows = read_jsonl(run_dir / "logs" / "metrics.jsonl") if (run_dir / "logs" / "metrics.jsonl").is_file() else []
    return rows[-1]["step"] if rows else 0


def pipeline_run(cfg: dict, device, processes: int, env: dict, deadline: Deadline) -> list[dict]:
    """Rows: train (stopped), resume, sample ddpm, sample dpm-solver, evaluate. Every launch and wait
    ends at the deadline (the in-process stages are cut by the item's alarm)."""
    from ancre_dit.evaluation.inception import write_random_inception_weights
    from benchmarks import bench_loader

    p, t = cfg["pipeline"], cfg["trainer"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_pipeline_") as tmp:
        tmp = Path(tmp)
        data = bench_loader.write_synthetic_latents(tmp / "latents", t["shards"], t["per_shard"],
                                                    (4, t["side"], t["side"]))
        run_dir = tmp / "run"
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
                  if p["launcher"] == "torchrun" else [sys.executable])
        train = [str(ROOT / "train.py"), "--config", str(ROOT / "configs" / f"{p['model']}.yaml"),
                 f"run_dir={run_dir}", f"data.path={data}", f"data.image_size={8 * t['side']}",
                 f"data.num_workers={p['workers']}",
                 f"train.global_batch_size={t['batch'] * processes}", f"train.log_every={p['log_every']}",
                 "train.ckpt_every=1000000", "train.sample_every=0", "train.eval_every=0",
                 f"train.compile={str(t['compile']).lower()}", "log.tensorboard=false", "log.figures=false",
                 *t["model_overrides"]]
        launch_env = {**env, **({"ACCELERATE_USE_CPU": "1"} if device.type == "cpu" else {})}

        # 1. Train, and stop it half way with SIGTERM to the launcher (torchrun forwards it to the ranks).
        # Its step limit is out of reach: however fast the steps, only the signal can end this stage.
        start = time.perf_counter()
        child = subprocess.Popen([*launch, *train, f"train.max_steps={UNREACHABLE_STEP}"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=launch_env, cwd=tmp, start_new_session=True)
        try:
            while child.poll() is None and _logged_step(run_dir) < p["steps"] // 2:
                if not deadline.left():
                    raise ItemCut(f"the training to stop logged {_logged_step(run_dir)} of {p['steps'] // 2} steps "
                                  f"within the item's {deadline.seconds:.0f} s")
                time.sleep(0.2)
            signalled_at = _logged_step(run_dir)
            child.send_signal(signal.SIGTERM)  # to the launcher alone: it forwards the signal to its ranks
            out, _ = child.communicate(timeout=min(p["grace_s"], max(deadline.left(), 1.0)))
        except BaseException as err:
            kill_group(child)
            if isinstance(err, subprocess.TimeoutExpired):
                raise ItemCut(f"{p['launcher']} did not stop within the grace after SIGTERM") from None
            raise
        stop_s = time.perf_counter() - start
        stopped = _latest_step(run_dir)
        # torchrun re-raises a forwarded signal once its workers are done (exit 1 whatever they did); with
        # checkpoints switched off, the ranks' stop is seen in the checkpoint it leaves.
        if stopped is None:
            sys.stderr.write(out[-4000:])
            raise RuntimeError(f"SIGTERM at step {signalled_at}: {p['launcher']} exit {child.returncode} "
                               "and no checkpoint")
        rows.append({"stage": f"train, SIGTERM to {p['launcher']} at step {signalled_at}", "seconds": stop_s,
                     "result": f"checkpoint at step {stopped} ({p['launcher']} exit {child.returncode})"})

        # 2. Resume for the other half of the steps.
        end = stopped + p["steps"] - p["steps"] // 2
        seconds = _run([*launch, *train, f"train.max_steps={end}", "--resume", "auto"], launch_env, tmp,
                       "the resumed train.py", deadline)
        final = _latest_step(run_dir)
        if final != end:
            raise RuntimeError(f"the resumed run ended at step {final}, not {end}")
        rows.append({"stage": "train --resume auto", "seconds": seconds, "result": f"step {stopped} -> {final}"})

        # 3. Sample the final checkpoint with DDPM-250 and DPM-Solver, decoded by a random tiny VAE.
        ckpt = run_dir / "checkpoints" / f"{final:07d}"
        vae = tiny_vae(tmp / "vae")
        samples = {}
        for sampler, steps in (("ddpm", 250), ("dpm-solver", p["dpm_steps"])):
            out_npz = tmp / f"{sampler}.npz"
            argv = ["--ckpt", str(ckpt), "--vae", str(vae), "--sampler", sampler, "--steps", str(steps),
                    "--num-samples", str(p["images"]), "--batch-size", str(p["images"]), "--precision", "bf16",
                    "--out", str(out_npz), *(["--cpu"] if device.type == "cpu" else [])]
            seconds = _in_process("sample.py", argv)
            samples[sampler] = out_npz
            rows.append({"stage": f"sample.py {sampler}-{steps}, {p['images']} images", "seconds": seconds,
                         "result": f"{p['images'] / seconds:.2f} images/s with model and VAE loading"})

        # 4. Evaluate one sample set against the other with random Inception weights.
        weights = write_random_inception_weights(tmp / "random-inception.pth")
        report = tmp / "eval.json"
        seconds = _in_process("evaluate.py", ["--samples", str(samples["ddpm"]), "--ref", str(samples["dpm-solver"]),
                                              "--inception-weights", str(weights), "--metrics", "fid,is",
                                              "--fid-method", "eigh", "--json", str(report), "--device", device.type])
        metrics = json.loads(report.read_text()).get("metrics", {})
        rows.append({"stage": "evaluate.py fid,is (random Inception weights)", "seconds": seconds,
                     "result": ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())})
    return rows


def markdown_rows(rows: list[dict]) -> list[str]:
    lines = ["| stage | seconds | result |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('stage', '-')} | {r['seconds']:.1f} | {r['result']} |" if "seconds" in r
                     else f"| {r.get('stage', 'pipeline')} | - | {r.get('failed') or r.get('skipped')} |")
    return lines
