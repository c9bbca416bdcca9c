"""`compare --summary` across families: rows that set a CCQ model against a baseline of another family are
grouped by the variant's backbone (meta.json's model_type without `ccq_`); a summary of twins alone is as
it was."""

from __future__ import annotations

import pandas as pd

from ccq_eval.analysis import comparison_tables
from ccq_eval.harness.store.reader import StoredUnit


def _frame(delta: float) -> pd.DataFrame:
    return pd.DataFrame([{"task": "ccq_s_niah_1", "length": "all", "metric": "acc", "delta": delta,
                          "ci_low": delta - 1, "ci_high": delta + 1, "p_value": 0.01, "protocol": ""}])


BACKBONES = {"tiny-gdn": "gated_deltanet", "tiny-gdn-ccq": "gated_deltanet", "tiny-gla": "gla",
             "tiny-gla-ccq": "gla", "tiny-kda": "kda", "tiny-deltanet": "delta_net"}


def test_cross_family_rows_are_grouped_by_the_variants_backbone():
    comparisons = [("tiny-kda", "tiny-gla-ccq", _frame(1.0)), ("tiny-gdn", "tiny-gdn-ccq", _frame(2.0)),
                   ("tiny-deltanet", "tiny-gla-ccq", _frame(3.0)), ("tiny-kda", "tiny-gdn-ccq", _frame(4.0))]
    table = comparison_tables.comparison_summary(comparisons, p_adjust="holm", backbones=BACKBONES)
    assert list(table.index) == ["tiny-gdn-ccq vs tiny-gdn", "tiny-gdn-ccq vs tiny-kda",
                                 "tiny-gla-ccq vs tiny-deltanet", "tiny-gla-ccq vs tiny-kda"]
    assert list(table["backbone"]) == ["gated_deltanet", "gated_deltanet", "gla", "gla"]
    assert table.attrs["p_family"] == 4  # Holm over every cell, whatever the order
    assert table.at["tiny-gla-ccq vs tiny-kda", "S-NIAH-1"].startswith("+1 [+0, +2]")


def test_twins_alone_and_unknown_backbones_keep_the_table_as_it_was():
    twins = [("tiny-gla", "tiny-gla-ccq", _frame(1.0)), ("tiny-gdn", "tiny-gdn-ccq", _frame(2.0))]
    plain = comparison_tables.comparison_summary(twins, p_adjust="holm")
    assert comparison_tables.comparison_summary(twins, p_adjust="holm", backbones=BACKBONES).equals(plain)
    assert "backbone" not in plain.columns
    older = [("tiny-kda", "tiny-gla-ccq", _frame(1.0))]  # units that do not record their model_type
    assert "backbone" not in comparison_tables.comparison_summary(older, backbones={}).columns


def test_a_unit_reads_its_backbone_from_its_meta(tmp_path):
    unit = StoredUnit(tmp_path / "results.json", {}, meta={"model_type": "ccq_gated_deltanet"})
    assert unit.backbone == "gated_deltanet"
    assert StoredUnit(tmp_path / "results.json", {}, meta={}).backbone is None
