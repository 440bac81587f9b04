"""Benchmark harnesses: measurements of the product, not part of it (ancre_dit never imports them).

Run each one as a module from the repository root (`--help` lists its flags); results and the
commands that produced them are in BENCHMARKS.md, recorded outputs in benchmarks/results/.

    python -m benchmarks.bench_peer          ANCRe against cascaded, and our DiT against diffusers' DiT:
                                             paired step-time ratios with a 95% interval, saved memory
    python -m benchmarks.bench_aggregation   ANCRe's skip sums alone (blocks reduced to a scalar or a linear map)
    python -m benchmarks.bench_overhead      every residual topology against cascaded: step time and memory
    python -m benchmarks.bench_loader        images/s of the trainer's latent loader on synthetic shards
    python -m benchmarks.bench_quickstart    wall and CPU seconds of the quickstart's train / sample / evaluate
    python -m benchmarks.bench_objectives    flow matching against DDPM on digits, through train() and compare
    python -m benchmarks.bench_sampling      sampler images/s, and DPM-Solver-25 against DDPM-250 on digits
    python -m benchmarks.bench_extract       images/s of latent extraction (tiny VAE and SD-VAE architecture)
    python -m benchmarks.bench_evaluate      Inception feature throughput and the cost of each metric
    python -m benchmarks.gpu_check           the one GPU check: training MFU, loader, sampling, Inception
    bash benchmarks/gpu_check_device.sh      the same on a GPU machine without network (wheels fetched first)
    bash benchmarks/bench_eval_convergence.sh   cascaded against ANCRe through train.py + compare_runs.py

`benchmarks.profiling` holds the measurements the harnesses share (saved-activation bytes, the
aggregation's profiled share of a step); interval statistics live in `ancre_dit.evaluation.stats`,
where study reports can use them too.
"""
