"""The repository stands on its own: no file in it names a path outside it, and every relative link in
its markdown leads to a file (and heading) in it.

The files checked are those git tracks or would track (`git ls-files --cached --others
--exclude-standard`, as they are in the working tree), read as text; binary files (a NUL byte in their
first 8 KiB), compressed archives and weights (.xz, .gz, .tgz, .safetensors, images) are skipped.

A path outside the repository is:
- an absolute path, unless it starts at a location every machine has in the same place: /tmp, /dev,
  /proc, /sys, /usr, /etc, /bin, /lib, /opt, /var (so `-o /tmp/run`, /dev/null and /usr/bin/chromium may
  be named). Tests may also name /nonexistent/..., a path that exists on no machine, to test what happens
  when a path is missing. `<output>/lm_eval`, `$OUT/x` and `${HOME}/x` are templates, not paths;
- a `file://` URL with a path in it;
- a Windows user folder (C:\\Users\\...);
- a relative path starting with `../` that, followed from the folder of the file naming it, leaves the
  repository (`../notes/...` in README.md).
.gitignore is skipped (its patterns are relative to the repository by definition), and so are token
lists (tokenizer.json, vocab.*, merges.txt), where `../` is a token, not a path, and this file, whose
examples name such paths on purpose.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_SUFFIXES = {".xz", ".gz", ".tgz", ".safetensors", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".ico"}
SKIPPED_NAMES = {".gitignore", "tokenizer.json", "merges.txt"}
SYSTEM_ROOTS = {"tmp", "dev", "proc", "sys", "usr", "etc", "bin", "lib", "opt", "var"}
TEST_ONLY_ROOTS = {"nonexistent"}

# An absolute path: a slash that starts a path (not inside a word, a URL, a template such as <output>/x or
# $OUT/x, nor a relative path), then at least one more component.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~\\>}\])$*@-])/(?!/)([A-Za-z0-9_.+-]+)(?:/[A-Za-z0-9_.+-]*)+")
FILE_URL = re.compile(r"file://(?:localhost)?/+[A-Za-z0-9_.~-][^\s\"'<>)\]]*")
WINDOWS_USER = re.compile(r"\b[A-Za-z]:\\(?:Users|home)\\", re.IGNORECASE)
PARENT_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+)([A-Za-z0-9_.+/-]*)")


def repository_files(root: Path = ROOT) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(root / name for name in listed if name and (root / name).is_file())


def text_of(path: Path) -> str | None:
    """The file's text, or None for the files this test skips."""
    if path.suffix.lower() in SKIPPED_SUFFIXES or path.name in SKIPPED_NAMES or path.name.startswith("vocab."):
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def outside_paths(text: str, where: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, path) for each path outside `root` that `text`, the content of file `where`, names."""
    in_tests = where.relative_to(root).parts[0] == "tests"
    allowed = SYSTEM_ROOTS | (TEST_ONLY_ROOTS if in_tests else set())
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in ABSOLUTE_PATH.finditer(line):
            if match.group(1) not in allowed:
                found.append((number, match.group(0)))
        for pattern in (FILE_URL, WINDOWS_USER):
            found += [(number, match.group(0)) for match in pattern.finditer(line)]
        for match in PARENT_PATH.finditer(line):
            target = os.path.normpath(os.path.join(where.parent, match.group(1) + match.group(2)))
            if not (target == str(root) or target.startswith(str(root) + os.sep)):
                found.append((number, match.group(0)))
    return found


FILES = repository_files()


def test_no_file_names_a_path_outside_the_repository():
    assert len(FILES) > 100 and ROOT / "README.md" in FILES
    found = []
    for path in FILES:
        text = text_of(path) if path != Path(__file__).resolve() else None
        if text is not None:
            found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in outside_paths(text, path)]
    assert not found, f"{len(found)} paths outside the repository:\n" + "\n".join(found[:200])


@pytest.mark.parametrize(("text", "where", "expected"), [
    ("see ../notes/design.md", "README.md", ["../notes/design.md"]),
    ("[card](../../notes/x.md)", "docs/usage.md", ["../../notes/x.md"]),
    ('"init_from": "/work/main/models"', "models/tiny/train_log.json", ["/work/main/models"]),
    ("cache in /home/someone/.cache/x", "docs/usage.md", ["/home/someone/.cache/x"]),
    ("open file:///root/report.html", "docs/usage.md", ["file:///root/report.html"]),
    (r"C:\Users\me\ccq", "docs/usage.md", ["C:\\Users\\"]),
    ("ccq-eval run -o /shared/out", "docs/usage.md", ["/shared/out"]),
    ("Path('/nonexistent/model')", "ccq_eval/model/loading.py", ["/nonexistent/model"]),
])
def test_paths_outside_are_found(text, where, expected):
    assert [name for _, name in outside_paths(text, ROOT / where)] == expected


@pytest.mark.parametrize(("text", "where"), [
    ("ccq-eval run -o /tmp/run && cat /dev/null; /usr/bin/chromium", "docs/usage.md"),
    ("include: ../s_niah/_s_niah_template_yaml", "tasks/ruler_niah/_ruler_niah_template_yaml"),
    ("see [layout](../docs/layout.md)", "benchmarks/README.md"),
    ("<output>/lm_eval/<model>/results.json and $OUT/results.tgz and ${WORK}/paper", "ccq_eval/x.py"),
    ("https://github.com/NVIDIA/RULER/blob/main/scripts/x.py and tokens/s", "tasks/ruler_niah/README.md"),
    ("ModelEntry('tiny', '/nonexistent/tiny')", "tests/cli/test_cli_run.py"),
    ("f'file://{path}'", "tests/analysis/test_report_browser.py"),
])
def test_paths_inside_or_generic_pass(text, where):
    assert outside_paths(text, ROOT / where) == []


# --- markdown links ------------------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
FENCE = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+).*?\1", re.DOTALL)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def without_code(text: str) -> str:
    """The markdown with code blocks and code spans blanked (line numbers kept)."""
    text = FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    return INLINE_CODE.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), text)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text: lower case, punctuation other than `-`
    and `_` dropped, spaces to `-`; a repeated anchor gets -1, -2..."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for match in re.finditer(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", text), re.MULTILINE):
        title = re.sub(r"[`*_]{1,2}(.+?)[`*_]{1,2}", r"\1", match.group(1))
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        number = counts.get(slug, 0)
        counts[slug] = number + 1
        anchors.add(slug if number == 0 else f"{slug}-{number}")
    anchors |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return anchors


def broken_links(text: str, where: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, target) for each relative link in the markdown `text` of file `where` that leads to no file
    in `root`, or to a heading that the markdown file it names does not have."""
    plain = without_code(text)
    found = []
    for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK):
        for match in pattern.finditer(plain):
            target = match.group(1)
            if SCHEME.match(target) or target.startswith("//"):
                continue
            line = plain.count("\n", 0, match.start(1)) + 1
            path_part, _, anchor = target.partition("#")
            path_part = re.sub(r"%20", " ", path_part.split("?")[0])
            if path_part:
                resolved = (root / path_part.lstrip("/")) if path_part.startswith("/") else where.parent / path_part
                resolved = Path(os.path.normpath(resolved))
                inside = resolved == root or str(resolved).startswith(str(root) + os.sep)
                if not inside or not resolved.exists():
                    found.append((line, target))
                    continue
            else:
                resolved = where
            if (anchor and resolved.suffix == ".md" and resolved.is_file()
                    and anchor.lower() not in heading_anchors(resolved.read_text(encoding="utf-8", errors="replace"))):
                found.append((line, target))
    return sorted(found)


MARKDOWN = [path for path in FILES if path.suffix.lower() == ".md"]


def test_every_relative_markdown_link_resolves():
    assert ROOT / "README.md" in MARKDOWN and len(MARKDOWN) > 5
    found = []
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{line}: {target}" for line, target in broken_links(text, path)]
    assert not found, "markdown links that lead nowhere:\n" + "\n".join(found)


def test_link_checker_on_small_texts(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n\n## Run a sweep\n\n## Run a sweep\n")
    (tmp_path / "figure.png").write_bytes(b"")
    text = ("[ok](docs/usage.md) [ok](docs/usage.md#run-a-sweep) [ok](docs/usage.md#run-a-sweep-1)\n"
            "![fig](figure.png) [web](https://example.org/x) [mail](mailto:a@b.c) [top](#title)\n"
            "`[not a link](missing.md)`\n```\n[also not](missing.md)\n```\n"
            "[gone](docs/missing.md) [bad anchor](docs/usage.md#nowhere)\n"
            "[out](../outside.md)\n[ref]: docs/gone.md\n<img src=\"nothing.png\">\n# Title\n")
    assert broken_links(text, tmp_path / "README.md", tmp_path) == [
        (7, "docs/missing.md"), (7, "docs/usage.md#nowhere"), (8, "../outside.md"), (9, "docs/gone.md"),
        (10, "nothing.png")]
