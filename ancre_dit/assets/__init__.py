"""Files the package reads but never downloads when it runs (weights, VAEs, reference batches): where
each comes from, and the fetcher `scripts/fetch_assets.py` runs on a networked node."""
from .catalog import ASSETS, Asset
from .download import fetch, fetch_all, format_listing
