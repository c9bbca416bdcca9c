"""A timing stand-in for jieba, for benchmarks/paper_suite.py on machines without jieba (the GPU lease: its
19 MB source does not fit in what a device call may carry).

LongBench's Chinese metrics (qa_f1_zh_score, rouge_zh_score) segment text with jieba.cut. The paper suite
measures wall time, and a metric's share of it is small beside generating the answer, so there the suite
puts this folder on the child process's PYTHONPATH: the three datasets then run and are timed, and the
report says their scores come from this stand-in. It splits into single CJK characters and runs of other
non-space characters; those are not jieba's words, so scores made with it are not LongBench's. Nothing
outside the paper suite puts this folder on a path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

STANDIN = True  # lets a caller tell this module from the real jieba

# One CJK unified ideograph (the basic block and extension A), or a run of anything else but whitespace.
_PIECE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]|[^\s\u3400-\u4dbf\u4e00-\u9fff]+")


def cut(sentence: str, cut_all: bool = False, HMM: bool = True) -> Iterator[str]:
    """Pieces of `sentence` in order: each CJK character alone, other characters in whitespace-free runs."""
    del cut_all, HMM  # jieba's modes; the stand-in has one
    return iter(_PIECE.findall(sentence))


def setLogLevel(level: int) -> None:
    """jieba's logging switch; the stand-in logs nothing."""
    del level
