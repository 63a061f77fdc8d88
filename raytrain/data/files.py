"""Which file a read error comes from, and what is wrong with it.

Ray Data reports a file that cannot be read from deep inside its read tasks, often as a
pyarrow error that names neither the file nor the column ("buffer is too small for
requested array" for a renamed column). When reading a dataset of files fails, the units
being read are looked at again, from their footers only: the first that is gone, that is not
Parquet, or whose columns differ from the dataset's first file is named with the fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

from raytrain.errors import DataError
from raytrain.text import first_line

# Files looked at after a failure: the units being read then (a read task reads a few files,
# and a few tasks run ahead of training), far fewer than a dataset may hold.
FILES_LOOKED_AT = 64
PATH_KEY = "__path"  # a Parquet manifest row's path (Ray Data's file listing)


def explain_read_error(units: Any, ids: Sequence[int], name: str) -> DataError | None:
    """A DataError naming the file behind a failed read of `units` (from unit `ids[0]` on),
    or None when the dataset is not files or none of them explains the failure."""
    if getattr(units, "kind", None) != "files":
        return None
    every, filesystem = _paths(units.payload), getattr(units.source, "filesystem", None)
    paths = _paths(units.payload[i] for i in ids)[:FILES_LOOKED_AT]
    schemas: dict[str, Any] = {}
    for path in paths:
        try:
            schemas[path] = _schema(path, filesystem)
        except FileNotFoundError:
            return DataError(
                f"dataset {name!r}: file {path} is gone (it was there when the run listed its files: deleted or "
                "moved since?); put it back and continue with --resume, or start a new run over the files there now"
            )
        except Exception as exc:
            return DataError(
                f"dataset {name!r}: file {path} cannot be read as Parquet ({first_line(exc)}): it is truncated, "
                "damaged or not Parquet. Replace it, or move it out of the dataset's directory"
            )
    for path in every[:3]:  # a few more, so that the columns most files have are known
        if path not in schemas:
            with contextlib.suppress(Exception):
                schemas[path] = _schema(path, filesystem)
    return _odd_one_out(schemas, paths, name)


def odd_columns(units: Any, name: str) -> DataError | None:
    """A file among the dataset's first FILES_LOOKED_AT whose columns differ from those most of
    them have, named (None: none, or not a dataset of files). Ray Data reads every file with
    the columns of all, so such a file can show only as nulls in a column of another."""
    if getattr(units, "kind", None) != "files":
        return None
    paths, filesystem = _paths(units.payload)[:FILES_LOOKED_AT], getattr(units.source, "filesystem", None)
    schemas = {}
    for path in paths:
        with contextlib.suppress(Exception):  # a file that cannot be read is named where it is read
            schemas[path] = _schema(path, filesystem)
    return _odd_one_out(schemas, list(schemas), name) if schemas else None


def _odd_one_out(schemas: dict[str, Any], paths: list[str], name: str) -> DataError | None:
    """The first of `paths` whose columns differ from those most of `schemas` have (a tie: the
    dataset's first file's), named with the difference and the fix."""
    keys = {path: tuple((field.name, str(field.type)) for field in schema) for path, schema in schemas.items()}
    counts: dict[tuple, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    usual = max(counts, key=lambda key: counts[key])  # the first seen wins a tie
    reference = next(path for path, key in keys.items() if key == usual)
    for path in paths:
        differs = schema_difference(schemas[reference], schemas[path]) if keys[path] != usual else None
        if differs:
            return DataError(
                f"dataset {name!r}: file {path} {differs} compared with {reference}; every file of a dataset must "
                "have the same columns and types: rewrite that file with them (e.g. table.rename_columns(...) in "
                "pyarrow), or move it out of the dataset's directory"
            )
    return None


def schema_difference(expected: Any, schema: Any) -> str | None:
    """How a file's pyarrow schema differs from the expected one, in words (None: it does
    not): `lacks column 'image', has column 'img' instead` or `has column 'label' as string,
    not int64`."""
    expected_types = {field.name: field.type for field in expected}
    types = {field.name: field.type for field in schema}
    missing = [column for column in expected_types if column not in types]
    extra = [column for column in types if column not in expected_types]
    parts = []
    if missing:
        parts.append(f"lacks column(s) {', '.join(map(repr, missing))}")
    if extra:
        parts.append(f"has column(s) {', '.join(map(repr, extra))}" + (" instead" if missing else " besides"))
    for column, kind in expected_types.items():
        if column in types and not types[column].equals(kind):
            parts.append(f"has column {column!r} as {types[column]}, not {kind}")
    return ", ".join(parts) or None


def _schema(path: str, filesystem: Any) -> Any:
    import pyarrow.parquet as pq

    return pq.read_schema(path, filesystem=filesystem)


def _paths(rows: Iterable[Any]) -> list[str]:
    """The files of Parquet manifest rows, each once, in order."""
    return list(dict.fromkeys(row[PATH_KEY] for row in rows if isinstance(row, dict) and row.get(PATH_KEY)))
