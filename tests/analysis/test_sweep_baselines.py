"""A --ccq-attach unit stored before sweeps named their baseline pairs with the plain model of the same
checkpoint fingerprint, and with nothing when the fingerprint is ambiguous or absent."""

from ccq_eval.analysis import tables


def _meta(checkpoint: str | None, lam: float | None = None, baseline: str | None = None) -> dict:
    spec: dict = {"checkpoint": {"sha256": {"model.safetensors": checkpoint}} if checkpoint else None}
    if lam is not None:
        spec["ccq_attach"] = {"sweep": "m+ccq", "lambda": lam, "fields": {}}
        if baseline:
            spec["ccq_attach"]["baseline"] = baseline
    return {"spec": spec}


def test_old_attach_units_pair_with_the_plain_model_of_their_checkpoint():
    metas = [("m", _meta("aa")), ("other", _meta("bb")), ("m+ccq-lambda1", _meta("aa", 1.0)),
             ("m+ccq-lambda2", _meta("aa", 2.0))]
    attachments = tables.sweep_attachments(metas)
    assert {name: a["baseline"] for name, a in attachments.items()} == {"m+ccq-lambda1": "m", "m+ccq-lambda2": "m"}
    points = tables.sweep_points(attachments, [name for name, _ in metas])
    assert points.set_index("model")["lambda"].to_dict() == {"m": 0.0, "m+ccq-lambda1": 1.0, "m+ccq-lambda2": 2.0}


def test_a_named_baseline_wins_and_ambiguity_pairs_nothing():
    named = tables.sweep_attachments([("m", _meta("aa")), ("x+ccq-lambda1", _meta("aa", 1.0, baseline="x"))])
    assert named["x+ccq-lambda1"]["baseline"] == "x"
    twins = tables.sweep_attachments([("m", _meta("aa")), ("copy", _meta("aa")), ("m+ccq-lambda1", _meta("aa", 1.0))])
    assert "baseline" not in twins["m+ccq-lambda1"]
    unknown = tables.sweep_attachments([("m", _meta(None)), ("m+ccq-lambda1", _meta(None, 1.0))])
    assert "baseline" not in unknown["m+ccq-lambda1"]
