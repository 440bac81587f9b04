"""Append-only logs (metrics.jsonl, evals.jsonl) survive a writer killed mid-record: the torn line
is cut off with a warning, no complete record is lost, the next record is kept, and the reader skips
and reports a line that does not parse instead of failing or merging it."""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from ancre_dit.training.run_evaluation import evals_path, read_evals
from ancre_dit.files import append_jsonl, read_jsonl

from helpers import subprocess_env

# A writer that appends complete records, then starts one more and is killed before finishing it.
KILLED_WRITER = """
import sys, time, json
from ancre_dit.files import append_jsonl
path = sys.argv[1]
for step in range(3):
    append_jsonl(path, {"step": step, "loss": 1.0 / (step + 1)})
with open(path, "ab", buffering=0) as f:
    f.write(json.dumps({"step": 3, "loss": 0.25, "padding": "x" * 100}).encode()[:40])  # half a record
print("torn", flush=True)
time.sleep(60)
"""


def kill_mid_record(path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    try:
        assert proc.stdout.readline().strip() == "torn"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not path.read_bytes().endswith(b"\n")  # the kill really left a torn line


def write_study_event(run, entry):
    from ancre_dit.studies.status import EVENTS, record_event

    record_event(run, "launched", step=entry["step"])
    return run / EVENTS


# Every append-only log and the writer that appends to it: (file under the run, write(run, entry) -> path).
LOGS = {
    "metrics": lambda run, entry: (append_jsonl(run / "logs" / "metrics.jsonl", entry), run / "logs" / "metrics.jsonl")[1],
    "evals": lambda run, entry: (append_jsonl(evals_path(run), entry), evals_path(run))[1],  # training and evaluate.py --run
    "diagnostics": lambda run, entry: (append_jsonl(run / "logs" / "diagnostics.jsonl", entry),
                                       run / "logs" / "diagnostics.jsonl")[1],
    "study status": write_study_event,
}


@pytest.mark.slow
@pytest.mark.parametrize("log", sorted(LOGS))
def test_a_writer_killed_mid_record_loses_nothing_complete(tmp_path, caplog, log):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    entry = {"step": 4, "loss": 0.2}
    path = LOGS[log](tmp_path / "probe", entry)  # where this writer writes, relative to its run
    path = run / path.relative_to(tmp_path / "probe")
    kill_mid_record(path)
    with caplog.at_level(logging.WARNING, logger="ancre_dit"):
        LOGS[log](run, entry)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 4]  # the complete ones and the new one
    assert f"{path}: line 4 was torn" in caplog.text
    if log == "evals":
        assert read_evals(run)[-1] == entry
    assert path.read_bytes().endswith(b"\n") and len(path.read_text().splitlines()) == 4


def test_appending_to_a_clean_log_neither_warns_nor_changes_earlier_bytes(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"a": 1})
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="ancre_dit"):
        append_jsonl(path, {"b": 2})
    assert path.read_bytes().startswith(before) and caplog.text == ""
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}]


def test_reader_skips_and_reports_lines_that_do_not_parse(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "lo\n[1, 2]\n\n{"step": 3}\n\xff\xfe\n')
    with caplog.at_level(logging.WARNING, logger="ancre_dit"):
        rows = read_jsonl(path)
    assert rows == [{"step": 1}, {"step": 3}]
    assert f"{path}: skipped 3 line(s)" in caplog.text and "(line 2, 3, 6)" in caplog.text


def test_a_torn_first_line_is_dropped_whole(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 0, "lo')
    with caplog.at_level(logging.WARNING, logger="ancre_dit"):
        append_jsonl(path, {"step": 1})
    assert path.read_text() == json.dumps({"step": 1}) + "\n"
    assert "line 1 was torn" in caplog.text
