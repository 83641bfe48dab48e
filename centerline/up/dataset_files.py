"""The records of a dataset file as users keep them, each with where it is (for the messages of
``centerline/up/user_task.py``): JSONL, and whatever the Hugging Face ``datasets`` library reads
(parquet, arrow, CSV, JSON, a ``save_to_disk`` directory).

JSONL is read line by line: each row is its own JSON object (rows may differ in their keys and
their ``meta``, which one Arrow schema could not hold), and a bad line is named by its number.
Every other form is read with ``datasets``: ``load_from_disk`` for a directory, the packaged
builder of the file's suffix (``load_dataset("parquet", data_files=...)``) for a file; a row is
then named by its index (``dataset[i]``). Arrow gives every row every column, so a value that is
``None`` there is a column another row has: it counts as absent. A ``DatasetDict`` directory
gives its ``train`` split to train on, and its ``test`` (else ``validation``) split as the held-out
rows where nothing else names them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import orjson

# the packaged ``datasets`` builder of each file suffix
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".tsv": "csv", ".json": "json"}
HELDOUT_SPLITS = ("test", "validation")


class DatasetFileError(ValueError):
    """A dataset path that cannot be read; the message names the path and the fix."""


def read_records(path: Path) -> tuple[list[tuple[str, object]], list[tuple[str, object]] | None]:
    """``(records, heldout)``: each record as ``(where, value)``, ``where`` naming the file and the
    line or row; ``heldout``: a ``DatasetDict``'s held-out split, else None."""
    path = Path(path)
    if is_jsonl(path):
        return _jsonl(path), None
    if path.is_dir():
        return _from_disk(path)
    if not path.exists():
        raise DatasetFileError(f"dataset {path}: cannot be read (No such file or directory); give an existing file")
    return _rows(path, _load_file(path)), None


def is_jsonl(path: Path) -> bool:
    """Whether ``path`` is read line by line as JSONL (else with ``datasets``, whose columns are typed)."""
    path = Path(path)
    return path.suffix == ".jsonl" or (path.is_file() and path.suffix not in BUILDERS)


def _jsonl(path: Path) -> list[tuple[str, object]]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise DatasetFileError(
            f"dataset {path}: cannot be read ({exc.strerror}); give an existing JSONL file, parquet file or "
            "save_to_disk directory"
        ) from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            out.append((where, orjson.loads(line)))
        except orjson.JSONDecodeError as exc:
            raise DatasetFileError(f"{where}: not JSON ({exc}); write one JSON object per line") from None
    return out


def _load_file(path: Path):
    import datasets

    datasets.disable_progress_bars()
    builder = BUILDERS[path.suffix]
    kwargs = {"delimiter": "\t"} if path.suffix == ".tsv" else {}
    with tempfile.TemporaryDirectory(prefix="centerline-datasets-") as cache:
        try:
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True, **kwargs
            )
        except Exception as exc:  # noqa: BLE001 (pyarrow's, datasets' or the parser's: each says what broke)
            raise DatasetFileError(
                f"dataset {path}: the datasets library cannot read it as {builder} ({type(exc).__name__}: "
                f"{str(exc)[:300]}); give a valid {builder} file"
            ) from None


def _from_disk(path: Path):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except (FileNotFoundError, ValueError) as exc:
        raise DatasetFileError(
            f"dataset {path}: a directory, but no datasets save_to_disk output ({exc}); give a directory written "
            "by Dataset.save_to_disk or DatasetDict.save_to_disk, or a file"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetFileError(
                f"dataset {path}: a DatasetDict with splits {sorted(loaded)} and no 'train'; name the split to "
                "train on 'train', or save that split alone with Dataset.save_to_disk"
            )
        held = next((s for s in HELDOUT_SPLITS if s in loaded), None)
        heldout = _rows(path, loaded[held], held) if held else None
        return _rows(path, loaded["train"], "train"), heldout
    return _rows(path, loaded), None


def _rows(path: Path, dataset, split: str | None = None) -> list[tuple[str, object]]:
    """Each row of a ``datasets.Dataset`` with its index; ``None`` columns (absent in the row) dropped."""
    name = f"{path} (split {split})" if split else str(path)
    return [(f"{name} row {i}", {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(dataset)]
