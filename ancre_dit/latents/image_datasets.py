"""Where extraction reads its images: an image folder, a Hugging Face dataset (save_to_disk folder or
parquet files) or WebDataset tar shards, behind one interface (`open_source` picks it from the path).

Each yields a listing (a name and a label per image, in a fixed order, and the class names) and a Dataset
of LoadedImage decoded by the image folder's own `load_and_crop`: the same images give bitwise the same
crops, hence latents, whatever container they come in.
"""
from __future__ import annotations

import bisect
import io
import itertools
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset

from ancre_dit.data.image_folder import CroppedImages, LoadedImage, list_image_folder, load_and_crop
from ancre_dit.errors import MissingFileError, UserError

FORMATS = ("imagefolder", "hf", "wds")
WDS_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")  # first present wins, in this order
WDS_LABEL_KEY = "cls"
_HF_DISK_FILES = ("state.json", "dataset_info.json")
_HF_DICT_FILE = "dataset_dict.json"


@dataclass
class ImageSource:
    """A listed container: `files[i]` names image i (report, fingerprint), `labels[i]` its class;
    `images(image_size, min_side)` is the Dataset position -> LoadedImage (a bad image is reported, not raised);
    `format`, `path` and `options` are the manifest's record of where the images came from."""
    format: str
    path: str
    files: list[str]
    labels: list[int]
    class_names: list[str]
    images: Callable[[int, int], Dataset] = field(repr=False)
    options: dict[str, Any] = field(default_factory=dict)


def detect_format(path: str) -> str:
    """imagefolder | hf | wds from what the path holds (see `open_source`)."""
    root = Path(path)
    if not root.is_dir() and ("{" in path or path.endswith(".tar")):  # a folder named imgs{v1} is a folder
        return "wds"
    if not root.is_dir():
        raise MissingFileError(f"--data-path {path} is not a folder, a .tar file or a brace pattern of tars")
    if any((root / name).is_file() for name in (*_HF_DISK_FILES, _HF_DICT_FILE)):
        return "hf"
    if any(root.glob("*.tar")):
        return "wds"
    if next(root.rglob("*.parquet"), None) is not None:
        return "hf"
    return "imagefolder"


def open_source(path: str, fmt: str | None = None, image_column: str = "image",
                label_column: str = "label") -> ImageSource:
    """Lists the images at `path`; without `fmt`, the format `detect_format` finds: tar files or a brace pattern
    are WebDataset, a folder with save_to_disk's or parquet files Hugging Face, any other an image folder."""
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt}")
    if fmt == "imagefolder":
        listing = list_image_folder(path, require_classes=True)
        return ImageSource("imagefolder", str(path), listing.files, listing.labels, listing.class_names,
                           lambda size, min_side: CroppedImages(listing, size, min_side))
    if fmt == "hf":
        return _open_hf(path, image_column, label_column)
    return _open_wds(path)


def _check_labels(labels: list[int], class_names: list[str], where: Callable[[int], str]) -> None:
    for i, y in enumerate(labels):
        if y < 0:
            raise UserError(f"{where(i)} has label {y}, an unlabelled row (e.g. a test split's -1); remove such rows")
        if y >= len(class_names):
            raise UserError(f"{where(i)} has label {y}, beyond the {len(class_names)} classes of the class list "
                            f"({', '.join(class_names[:5])}{', ...' if len(class_names) > 5 else ''}); every file must "
                            "share one class list: fix the labels or the list")


def _class_indices(values: list[Any], where: str) -> list[int]:
    """Label column values as class indices (None: -1, unlabelled); anything that is not an integer
    is refused rather than cast (a float 1.7 would become class 1, a string cannot be placed)."""
    for i, y in enumerate(values):
        if y is not None and (isinstance(y, bool) or not isinstance(y, int)):
            raise UserError(f"{where} row {i}: the label column holds {y!r} ({type(y).__name__}), not a class index; "
                            "store integer labels (or a ClassLabel feature), or name the right --label-column")
    return [-1 if y is None else y for y in values]


def _decode(position: int, value: Any, image_size: int, min_side: int) -> LoadedImage:
    """A row's image, a datasets Image struct (bytes and path) or plain bytes -> LoadedImage."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data, path = bytes(value), None
    else:
        raise UserError(f"the image column holds {type(value).__name__} values, not encoded images; "
                        "store it as a datasets Image feature (bytes) or name the right --image-column")
    source = io.BytesIO(data) if data is not None else path
    if source is None:
        return LoadedImage(position, None, "skipped", "no image bytes")
    return LoadedImage(position, *load_and_crop(source, image_size, min_side))


def _numbered_classes(labels: list[int]) -> list[str]:
    """The class list of plain integer labels: "0".."max"."""
    return [str(k) for k in range(max(labels, default=-1) + 1)]


# -- Hugging Face datasets -----------------------------------------------------------------------

def _check_columns(names: list[str], image_column: str, label_column: str, where: str) -> None:
    if missing := [c for c in (image_column, label_column) if c not in names]:
        raise UserError(f"{where} has no column {', '.join(map(repr, missing))} (columns: {', '.join(names)}); "
                        "name them with --image-column / --label-column")


def _image_paths(column: Any) -> list[str | None]:
    """The `path` field of an Image column (struct of bytes and path), read without the bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_struct(column.type) and column.type.get_field_index("path") >= 0:
        return pc.struct_field(column, "path").to_pylist()
    return [None] * len(column)


def _open_hf(path: str, image_column: str, label_column: str) -> ImageSource:
    import datasets  # only when a Hugging Face dataset is read

    root = Path(path)
    options = {"image_column": image_column, "label_column": label_column}
    if (root / _HF_DICT_FILE).is_file():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise UserError(f"{path} holds a DatasetDict with splits {', '.join(splits)}; pass one split's folder, "
                        f"e.g. --data-path {root / (splits[0] if splits else 'train')}")
    if any((root / name).is_file() for name in _HF_DISK_FILES):
        try:
            ds = datasets.load_from_disk(str(root))
        except Exception as err:  # noqa: BLE001 - any failure means "not a readable saved dataset"
            raise UserError(f"{path} is not a readable save_to_disk dataset ({str(err).splitlines()[0]})") from None
        _check_columns(ds.column_names, image_column, label_column, path)
        table = ds.with_format("arrow").select_columns([image_column, label_column])[:]
        labels = _class_indices(table.column(label_column).to_pylist(), path)
        feature = ds.features.get(label_column) if ds.features is not None else None
        names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else _numbered_classes(labels)
        files = [f"{i}" + (f" {p}" if p else "") for i, p in enumerate(_image_paths(table.column(image_column)))]
        _check_labels(labels, names, lambda i: f"{path} row {i}")
        return ImageSource("hf", path, files, labels, names,
                           lambda size, min_side: _ArrowRows(ds, image_column, size, min_side), options)
    return _open_parquet(root, image_column, label_column, options)


def _open_parquet(root: Path, image_column: str, label_column: str, options: dict[str, Any]) -> ImageSource:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = sorted(root.rglob("*.parquet"))
    if not paths:
        raise MissingFileError(f"{root} holds no parquet files nor a save_to_disk dataset")
    labels, files, names, groups = [], [], None, []
    for n, p in enumerate(paths):
        try:
            f = pq.ParquetFile(p)
        except (pa.ArrowException, OSError) as err:
            raise UserError(f"{p} is not a readable parquet file ({str(err).splitlines()[0]}): empty, cut short or "
                            "not parquet; copy it again, or move it out of --data-path") from None
        _check_columns(f.schema_arrow.names, image_column, label_column, str(p))
        part = f.read(columns=[label_column]).column(label_column).to_pylist()
        labels += _class_indices(part, str(p))
        rel = p.relative_to(root)
        has_paths = f.schema_arrow.field(image_column).type.num_fields > 0  # an Image struct, not plain bytes
        paths_here = (_image_paths(f.read(columns=[f"{image_column}.path"]).column(image_column)) if has_paths
                      else [None] * len(part))  # only the path field: the image bytes are not read here
        files += [f"{rel}:{i}" + (f" {q}" if q else "") for i, q in enumerate(paths_here)]
        groups += [(n, g, f.metadata.row_group(g).num_rows) for g in range(f.num_row_groups)]
        # the class list each file's features carry (HF writes them in the schema): one for all files
        feature = datasets.Features.from_arrow_schema(f.schema_arrow).get(label_column)
        here = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
        if names is not None and here is not None and here != names:
            k = next((k for k, (a, b) in enumerate(zip(names, here)) if a != b), min(len(names), len(here)))
            theirs = lambda n: repr(n[k]) if k < len(n) else f"absent ({len(n)} classes)"  # noqa: E731
            raise UserError(f"{p} and {paths[0]} disagree on their ClassLabel names (class {k}: {theirs(here)} vs "
                            f"{theirs(names)}): one index would mean two classes; write every file with one class list")
        names = names if names is not None else here
    names = names if names is not None else _numbered_classes(labels)
    _check_labels(labels, names, lambda i: f"{root} image {files[i]}")
    parquet = [str(p) for p in paths]
    return ImageSource("hf", str(root), files, labels, names,
                       lambda size, min_side: _ParquetRows(parquet, groups, image_column, size, min_side), options)


class _ArrowRows(Dataset):
    """Rows of a save_to_disk dataset (memory-mapped Arrow) -> LoadedImage, bytes decoded by PIL."""

    def __init__(self, ds: Any, column: str, image_size: int, min_side: int):
        self.ds = ds.with_format("arrow").select_columns([column])
        self.column, self.image_size, self.min_side = column, image_size, min_side

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, position: int) -> LoadedImage:
        return _decode(position, self.ds[position].column(self.column)[0].as_py(), self.image_size, self.min_side)


class _ParquetRows(Dataset):
    """Rows of parquet files -> LoadedImage, given each row group as (file, group, rows) in order; reads one
    row group at a time and keeps the last one, since extraction asks for consecutive positions."""

    def __init__(self, paths: list[str], groups: list[tuple[int, int, int]], column: str, image_size: int,
                 min_side: int):
        self.paths, self.groups, self.column = paths, groups, column
        self.image_size, self.min_side = image_size, min_side
        self.starts = [0, *itertools.accumulate(rows for _, _, rows in groups)]
        self._files: dict[int, Any] = {}
        self._group: tuple[int | None, list] = (None, [])  # (row group, values) of the last one read

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # open files stay in the process that opened them
        return {**self.__dict__, "_files": {}, "_group": (None, [])}

    def __getitem__(self, position: int) -> LoadedImage:
        import pyarrow.parquet as pq

        g = bisect.bisect_right(self.starts, position) - 1  # an empty row group shares its start with the next
        if self._group[0] != g:
            k, group, _ = self.groups[g]
            if k not in self._files:
                self._files[k] = pq.ParquetFile(self.paths[k])
            self._group = g, self._files[k].read_row_group(group, columns=[self.column]).column(self.column).to_pylist()
        return _decode(position, self._group[1][position - self.starts[g]], self.image_size, self.min_side)


# -- WebDataset tar shards -----------------------------------------------------------------------

def _wds_urls(path: str) -> list[str]:
    from webdataset.shardlists import expand_urls  # webdataset's own brace expansion

    if Path(path).is_dir():
        urls = sorted(str(p) for p in Path(path).glob("*.tar"))
        if not urls:
            raise MissingFileError(f"{path} holds no .tar files")
        return urls
    urls = expand_urls(path)
    if missing := [u for u in urls if not Path(u).is_file()]:
        hint = ("; a folder whose name holds a brace is read as a pattern of tars: give --format imagefolder "
                "or --format hf for a folder" if "{" in path and ".." not in path else "")
        raise MissingFileError(f"{missing[0]} (from --data-path {path}) does not exist; "
                               f"{len(missing)} of {len(urls)} tar files are missing{hint}")
    return urls


def _index_tar(url: str) -> list[tuple[str, int, int, int]]:
    """(key, byte offset, size of the image member, label) of each sample of one tar, in order, grouped as
    webdataset groups them (`base_plus_ext`, suffixes case-insensitive). Indexed, not streamed, because
    extraction reads by position (shards split between processes, a resumed run reads only what it misses)."""
    from webdataset.tariterators import base_plus_ext

    samples: list[tuple[str, int, int, int]] = []
    try:
        with open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
            members = tar.getmembers()
            # A tar cut at a member boundary reads as a shorter tar (tarfile stops at the end of the file without
            # a word; a cut inside a member it does report): the two zero blocks ending an archive must follow.
            end = max((m.offset_data + m.size for m in members), default=0)
            raw.seek(-(-end // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE)
            if raw.read(2 * tarfile.BLOCKSIZE) != bytes(2 * tarfile.BLOCKSIZE):
                raise UserError(f"{url} ends after its last member without the end-of-archive blocks: the file was "
                                "cut short (samples may be missing); copy it again, or leave it out of --data-path")
            named = [(*base_plus_ext(m.name), m) for m in members if m.isfile()]
            for key, parts in itertools.groupby([n for n in named if n[0] is not None], key=lambda n: n[0]):
                group = {ext.lower(): member for _, ext, member in parts}
                image = next((group[k] for k in WDS_IMAGE_KEYS if k in group), None)
                if image is None:
                    continue  # not an image sample (e.g. a lone metadata file)
                if WDS_LABEL_KEY not in group:
                    raise UserError(f"{url}: sample {key} has an image but no .{WDS_LABEL_KEY} label; every sample "
                                    f"needs a {key}.{WDS_LABEL_KEY} member holding its class index")
                text = tar.extractfile(group[WDS_LABEL_KEY]).read().decode(errors="replace").strip()
                try:
                    label = int(text)
                except ValueError:
                    raise UserError(f"{url}: {key}.{WDS_LABEL_KEY} holds {text[:20]!r}, not a class index") from None
                samples.append((key, image.offset_data, image.size, label))
    except (tarfile.TarError, EOFError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"{url} is not a readable tar ({reason}); it is damaged or cut short: "
                        "copy it again, or leave it out of --data-path") from None
    return samples


def _open_wds(path: str) -> ImageSource:
    urls = _wds_urls(path)
    files, labels, where = [], [], []
    for t, url in enumerate(urls):
        for key, offset, size, label in _index_tar(url):
            files.append(f"{Path(url).name}/{key}")
            labels.append(label)
            where.append((t, offset, size))
    if not files:
        raise MissingFileError(f"no {'/'.join(WDS_IMAGE_KEYS)} samples in the tar files of {path}")
    names = _numbered_classes(labels)
    _check_labels(labels, names, files.__getitem__)
    return ImageSource("wds", path, files, labels, names,
                       lambda size, min_side: _TarMembers(urls, where, size, min_side))


class _TarMembers(Dataset):
    """Indexed tar members -> LoadedImage: one seek and read per image."""

    def __init__(self, urls: list[str], where: list[tuple[int, int, int]], image_size: int, min_side: int):
        self.urls, self.where, self.image_size, self.min_side = urls, where, image_size, min_side
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.where)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def __getitem__(self, position: int) -> LoadedImage:
        t, offset, size = self.where[position]
        if t not in self._handles:
            self._handles[t] = open(self.urls[t], "rb")
        return _decode(position, os.pread(self._handles[t].fileno(), size, offset), self.image_size, self.min_side)
