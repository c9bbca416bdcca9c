"""The format of unit.json and meta.json: the version a file is in, and one reader per version.

Both files carry the version they are written in under "format" (FORMAT_VERSION, the first key). Each
version has its reader, which returns the file's content in the current form:

    version 1   the files written before the key existed (no "format" key): a unit's settings may record
                its dtype as given on the command line (null for float32, or an alias such as "bf16"),
                and a finished unit may lack unit.json, its settings being the copy in meta.json ("spec")
    version 2   unit.json and meta.json in the current form
    version 3   the same files; a finished unit also holds checksums.json (vouch.py), written last, so a
                version-3 unit with results.json but no checksums.json is one whose write did not finish
    version 4   the same files; checksums.json is written before results.json (the last file, the mark of a
                finished unit), so a version-4 unit with results.json always has its record: one without it,
                or whose record leaves out meta.json, results.json, unit.json or a samples file results.json
                names, has lost part of its record and is refused (vouch.required_files)

A unit's version is its meta.json's (the file every version writes), else its unit.json's.

A file of a version later than this package knows is refused with one line: its fields may mean
something this version would misread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ccq_eval.harness.store.files import ResultsError, read_json

FORMAT_KEY = "format"
FORMAT_VERSION = 4
RECORD_SINCE = 3  # the first version whose finished units hold checksums.json
COMPLETE_RECORD_SINCE = 4  # the first version whose results.json is written after the record, never before
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # meta.json's started_at / finished_at (time.strftime, local time)


def stamped(content: dict[str, Any]) -> dict[str, Any]:
    """`content` as it is written: the current format version first."""
    return {FORMAT_KEY: FORMAT_VERSION, **{key: value for key, value in content.items() if key != FORMAT_KEY}}


def format_version(path: Path, content: Any) -> int:
    """The format version of a unit.json / meta.json `content` read from `path` (1 when it names none)."""
    if not isinstance(content, dict):
        raise ResultsError(f"{path} should hold a JSON object. The file was left as it is: fix or delete it")
    version = content.get(FORMAT_KEY, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ResultsError(f"{path}: \"{FORMAT_KEY}\": {version!r} is not a format version (a whole number "
                           "from 1). The file was left as it is: fix or delete it")
    if version > FORMAT_VERSION:
        raise ResultsError(f"{path} is in results format {version}, newer than this ccq-eval reads (up to "
                           f"{FORMAT_VERSION}); upgrade ccq-eval (pip install -U ccq-eval) to read it")
    return version


# ---------------------------------------------------------------------------------------------- version 1

# The dtypes version-1 files may record: null was float32, an alias its torch name.
_V1_DTYPE_NAMES = {None: "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64",
                   "auto": "float32"}


def _spec_v1(content: dict[str, Any]) -> dict[str, Any]:
    if "dtype" in content and content["dtype"] in _V1_DTYPE_NAMES:
        return dict(content, dtype=_V1_DTYPE_NAMES[content["dtype"]])
    return dict(content)


def _meta_v1(content: dict[str, Any]) -> dict[str, Any]:
    spec = content.get("spec")
    return dict(content, spec=_spec_v1(spec)) if isinstance(spec, dict) else dict(content)


# ---------------------------------------------------------------------------------------------- version 2


def _spec_v2(content: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in content.items() if key != FORMAT_KEY}


def _meta_v2(content: dict[str, Any]) -> dict[str, Any]:
    return dict(content)


_SPEC_READERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _spec_v1, 2: _spec_v2, 3: _spec_v2,
                                                                        4: _spec_v2}
_META_READERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _meta_v1, 2: _meta_v2, 3: _meta_v2,
                                                                        4: _meta_v2}


def read_spec(path: Path) -> dict[str, Any]:
    """A unit.json as the settings of its unit, in the current form (no "format" key)."""
    content = read_json(path)
    return _SPEC_READERS[format_version(path, content)](content)


def read_meta(path: Path) -> dict[str, Any]:
    """A meta.json in the current form (its "spec" as read_spec returns one)."""
    content = read_json(path)
    return _META_READERS[format_version(path, content)](content)


def stored_spec(spec_path: Path, meta_path: Path) -> dict[str, Any] | None:
    """The settings a unit folder records: its unit.json, else (a version-1 unit finished without one) the
    copy in its meta.json; None when neither holds them."""
    if spec_path.is_file():
        return read_spec(spec_path)
    if meta_path.is_file():
        spec = read_meta(meta_path).get("spec")
        return spec if isinstance(spec, dict) else None
    return None


def unit_format(spec_path: Path, meta_path: Path) -> int | None:
    """The format version a unit folder was written in: its meta.json's, else (meta.json lost) its unit.json's;
    None when it holds neither file. A newer version than this package reads is refused (format_version)."""
    for path in (meta_path, spec_path):
        if path.is_file():
            return format_version(path, read_json(path))
    return None
