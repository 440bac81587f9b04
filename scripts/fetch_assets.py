#!/usr/bin/env python3
"""Downloads the weights, VAEs and reference batches the package reads, on a machine with a network.

    python scripts/fetch_assets.py --list                                  # every asset; downloads nothing
    python scripts/fetch_assets.py --out assets                            # all of them into assets/<name>/
    python scripts/fetch_assets.py --only inception adm-ref-256 --out assets

Run it on a cluster's login node: the compute nodes then read local paths only (nothing else in the
package downloads). Each file is checked against its checksum; a cut download resumes when the same
command runs again. The last lines printed are the settings that point configs and commands at them.
"""
from __future__ import annotations

from ancre_dit.assets import ASSETS, fetch_all, format_listing
from ancre_dit.cli import CommandParser, run_cli


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder to fetch into (one subfolder per asset)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help=f"these assets only: {', '.join(ASSETS)}")
    p.add_argument("--list", action="store_true", help="print every asset with its source and checksum, and stop")
    p.add_argument("--endpoint", default=None, help="the Hugging Face hub's address (default: HF_ENDPOINT, else the hub)")
    a = p.parse_args(argv)
    if a.list:
        print(format_listing())
        return 0
    if not a.out:
        p.error("pass --out ASSETS (where to fetch into), or --list")
    fetch_all(a.out, a.only, endpoint=a.endpoint)
    return 0


if __name__ == "__main__":
    run_cli(main)
