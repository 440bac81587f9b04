"""`<out>/study.json` records the study owning the folder: a rerun continues its runs, another study is
refused before it mixes its runs in. The same study = same base config and common overrides, same
overrides for every arm both know; arms and seeds may be added and the baseline may change.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from ..cli import output_folder
from ..errors import UserError
from ..files import write_atomic
from .spec import Study

RECORD = "study.json"


def recorded(study: Study) -> dict[str, Any] | None:
    path = study.out / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is damaged (not JSON); repair it, or give the study another out:") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is damaged (not a study record); repair it, or give the study another out:")
    return record


def difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why the study `new` is not the one recorded as `old` (None when it is)."""
    if old.get("base") != new["base"]:
        return f"its base config is {old.get('base')}, not {new['base']}"
    if old.get("overrides") != new["overrides"]:
        return f"its overrides are {old.get('overrides')}, not {new['overrides']}"
    for arm, values in new["arms"].items():
        if arm in (old.get("arms") or {}) and old["arms"][arm] != values:
            return f"its arm {arm} is {old['arms'][arm]}, not {values}"
    return None


def check_folder(study: Study) -> None:
    """A UserError when `out` is a file, a non-empty folder of something else, or another study's."""
    output_folder(study.out, "study", RECORD, flag="out:")
    if (old := recorded(study)) is not None and (why := difference(old, study.record())):
        raise UserError(f"{study.out} holds another study ({old.get('name')}, from {old.get('source')}): {why}; "
                        f"give this study another out:, or remove that folder")


def claim_folder(study: Study) -> None:
    """Checks the folder, then writes its record; arms and seeds seen before are kept."""
    check_folder(study)
    old, record = recorded(study) or {}, study.record()
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record.update(arms={**(old.get("arms") or {}), **record["arms"]}, created=old.get("created") or now, updated=now,
                  seeds=sorted(set(old.get("seeds") or []) | set(record["seeds"])))
    study.out.mkdir(parents=True, exist_ok=True)
    write_atomic(study.out / RECORD, json.dumps(record, indent=1).encode())
