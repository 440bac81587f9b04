"""The layer rules, kept as a test so that no change breaks them silently.

Read from the source with `ast` (every import, the lazy ones inside functions included), so a rule
broken only on a rarely taken path is caught too:
- the package-level dependencies stay within `ALLOWED` (data flows down, imports point down:
  models and diffusion import no higher layer, the model knows nothing of diffusion or data, and
  diffusion nothing of data);
- no module imports another that (directly or not) imports it back;
- the library never imports benchmarks/ or scripts/;
- the only top-level modules are the genuinely shared ones.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT as REPO, TINY_TRAIN, subprocess_env

PACKAGE = REPO / "ancre_dit"
TOP_LEVEL_MODULES = {"__init__", "cli", "errors", "files", "hardware", "vae"}
# What each part of the package may import (besides itself and the standard or third-party libraries).
SHARED = {"errors", "files", "hardware"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "files": {"errors"},
    "hardware": set(),
    "cli": {"errors"},
    "assets": SHARED,
    "models": SHARED,
    "data": SHARED,
    "diffusion": SHARED | {"models"},
    "vae": SHARED | {"data"},
    "checkpoint": SHARED | {"models", "diffusion"},
    "figures": SHARED | {"models"},
    "latents": SHARED | {"cli", "data", "vae"},
    "sampling": SHARED | {"cli", "data", "models", "diffusion", "vae", "checkpoint", "figures"},
    "evaluation": SHARED | {"cli", "data", "models", "diffusion", "vae", "checkpoint", "figures", "sampling"},
    "training": SHARED | {"cli", "data", "models", "diffusion", "vae", "checkpoint", "figures", "sampling",
                          "evaluation"},
    "studies": SHARED | {"cli", "data", "models", "diffusion", "vae", "checkpoint", "figures", "sampling",
                         "evaluation", "training"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(module: str, path: Path) -> set[str]:
    """Absolute names of everything `module` imports (a submodule where one exists, else the package)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names - {module}


GRAPH = {m: imported_names(m, p) for m, p in MODULES.items()}


def part_of(module: str) -> str:
    """ancre_dit.training.trainer -> training; ancre_dit.cli -> cli."""
    return module.split(".")[1]


def test_package_dependencies_point_down():
    broken = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if m != "ancre_dit"
                    for d in deps if d.startswith("ancre_dit.")
                    and part_of(d) != part_of(m) and part_of(d) not in ALLOWED[part_of(m)])
    assert not broken, "\n".join(broken)


def test_every_part_of_the_package_has_a_rule():
    parts = {part_of(m) for m in MODULES if m != "ancre_dit"}
    assert parts == set(ALLOWED)


def test_no_import_cycle():
    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(d for d in GRAPH.get(node, ()) if d in MODULES)
        return False

    cycles = sorted(f"{m} <-> {d}" for m, deps in GRAPH.items() for d in deps
                    if d in MODULES and not d.startswith(m + ".") and not m.startswith(d + ".") and reaches(d, m)
                    and d != "ancre_dit")
    assert not cycles, "\n".join(cycles)


def test_library_never_imports_benchmarks_or_scripts():
    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                 if d.split(".")[0] in ("benchmarks", "scripts"))
    assert not bad, "\n".join(bad)


def test_only_shared_modules_at_the_top():
    assert {p.stem for p in PACKAGE.glob("*.py")} == TOP_LEVEL_MODULES


def test_the_rules_catch_a_broken_layer(tmp_path):
    """The checks above read real imports: a model module that imported the trainer would be caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..training import trainer\n")
    names = imported_names("ancre_dit.models.probe", probe)
    assert "ancre_dit.training.trainer" in names
    assert "training" not in ALLOWED[part_of("ancre_dit.models.probe")]


def _fresh_python(code: str) -> str:
    """What `code` prints in a fresh interpreter (nothing imported yet), as the commands start."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_commands_that_need_no_model_start_without_the_model_stack():
    """`import ancre_dit` and the evaluation's tables load neither timm nor torchvision (seconds of
    imports at every start of evaluate.py or study.py's status), the digits load without
    scikit-learn; the model names still resolve."""
    code = ("import sys, ancre_dit, ancre_dit.cli, ancre_dit.evaluation.metric_registry\n"
            "heavy = sorted(m for m in ('timm', 'torchvision') if m in sys.modules)\n"
            "create = ancre_dit.create_model\n"
            "from ancre_dit import DiT\n"
            "from ancre_dit.data.digits import DigitsDataset\n"
            "DigitsDataset('train'), DigitsDataset('heldout')\n"
            "heavy += ['sklearn'] if 'sklearn' in sys.modules else []  # the digits load without it\n"
            "print(heavy, create.__module__, DiT.__name__)\n")
    assert _fresh_python(code).split() == ["[]", "ancre_dit.models.dit", "DiT"]


@pytest.mark.slow
def test_a_training_that_does_not_evaluate_starts_without_scipy(tmp_path):
    """scipy (the FID's matrix root) is imported by the evaluation only: a training process (and
    every torchrun rank) that does not evaluate starts without it."""
    overrides = [*TINY_TRAIN, f"run_dir={tmp_path / 'run'}", "train.max_steps=2"]
    code = ("import sys\n"
            "from ancre_dit.training import Trainer, load_config\n"
            f"Trainer(load_config(None, {overrides!r})).run()\n"
            "print('scipy' in sys.modules)\n")
    assert _fresh_python(code).split("\n")[-2:] == ["False", ""]
