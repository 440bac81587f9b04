"""The files the package reads but never downloads when it runs (weights, VAEs, reference batches):
a table of where each comes from, and the fetcher `scripts/fetch_assets.py` runs where there is a
network (a login node), so that compute nodes read local paths only.

    catalog   ASSETS: name -> source, files, checksums and the settings that point at them
    download  fetch(): resumable, checksum-verified downloads (plain URLs and the Hugging Face hub)
"""
from .catalog import ASSETS, Asset
from .download import fetch, fetch_all, format_listing

__all__ = ["ASSETS", "Asset", "fetch", "fetch_all", "format_listing"]
