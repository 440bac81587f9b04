"""Worker for tests/test_evalrun.py: `evaluate.py --run RUN_DIR` under torchrun. argv: RUN_DIR.
(torchrun's own parser would read a `--run` after the script name as an abbreviation of its
--run-path option, so the flag is added here.)"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.argv = [str(ROOT / "evaluate.py"), "--run", *sys.argv[1:]]
runpy.run_path(str(ROOT / "evaluate.py"), run_name="__main__")
