"""Tiny image datasets in each container extraction reads (image folder, Hugging Face dataset,
WebDataset tars), built from the same images so their latents can be compared."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from ancre_dit.data.image_folder import list_image_folder

CLASSES = ["ant", "bee", "cat"]


def make_image_folder(root: Path) -> Path:
    """3 classes x 2 images of odd sizes, JPEG and PNG."""
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i, ext in enumerate(("jpg", "png")):
            h, w = rng.integers(17, 40, size=2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i}.{ext}")
    return root


def _rows(folder: Path) -> list[tuple[str, bytes, int]]:
    listing = list_image_folder(folder, require_classes=True)
    return [(f, (folder / f).read_bytes(), y) for f, y in zip(listing.files, listing.labels)]


def make_hf(folder: Path, out: Path, parquet: bool = False, image_column: str = "image") -> Path:
    import datasets

    rows = _rows(folder)
    names = list_image_folder(folder, require_classes=True).class_names
    features = datasets.Features({image_column: datasets.Image(), "label": datasets.ClassLabel(names=names)})
    ds = datasets.Dataset.from_dict({image_column: [{"bytes": b, "path": f} for f, b, _ in rows],
                                     "label": [y for _, _, y in rows]}, features=features)
    if parquet:
        out.mkdir(parents=True)
        ds.to_parquet(str(out / "train-00000-of-00001.parquet"))
    else:
        ds.save_to_disk(str(out))
    return out


def relabel_parquet(src: Path, dst: Path, label: int) -> Path:
    """A copy of an HF parquet folder whose first row has `label` (the schema's ClassLabel kept)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.parquet")):
        table = pq.read_table(path)
        labels = table.column("label").to_pylist()
        labels[0] = label
        table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int64()))
        pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), dst / path.name)
    return dst


def make_wds(folder: Path, out: Path, per_tar: int = 4, drop_label_of: int | None = None) -> Path:
    out.mkdir(parents=True)
    rows = _rows(folder)
    for t in range(0, len(rows), per_tar):
        with tarfile.open(out / f"train-{t // per_tar:04d}.tar", "w") as tar:
            for i, (f, data, y) in enumerate(rows[t:t + per_tar], start=t):
                key = f"sample{i:06d}"
                members = [(f"{key}.{f.rsplit('.', 1)[1]}", data)]
                if i != drop_label_of:
                    members.append((f"{key}.cls", str(y).encode()))
                for name, payload in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return out




def replace_in_tar(src: Path, dst: Path, pick: Callable[[tarfile.TarInfo], bool], payload: bytes) -> Path:
    """A copy of tar `src` at `dst` whose first member that `pick` accepts holds `payload` instead."""
    done = False
    with tarfile.open(src) as tar_in, tarfile.open(dst, "w") as tar_out:
        for member in tar_in.getmembers():
            data = tar_in.extractfile(member).read()
            if not done and pick(member):
                data, done = payload, True
            member.size = len(data)
            tar_out.addfile(member, io.BytesIO(data))
    return dst


def rewrite_parquet(src: Path, dst: Path, labels: list | None = None, class_names: list[str] | None = None) -> Path:
    """A copy of an HF parquet folder with other label values (written as they are, without the
    ClassLabel schema: floats, strings) or another ClassLabel name list for the same labels."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.parquet")):
        table = pq.read_table(path)
        if labels is not None:
            table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels[:len(table)]))
            pq.write_table(table.replace_schema_metadata(None), dst / path.name)
            continue
        features = datasets.Features.from_arrow_schema(table.schema)
        features["label"] = datasets.ClassLabel(names=class_names)
        datasets.Dataset(table.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features)).to_parquet(
            str(dst / path.name))
    return dst
