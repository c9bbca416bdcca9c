"""The read as a sum over tokens (GLA, Gated DeltaNet) against brute-force recurrences and fla's own
reference, hand-built needle shares, the key covariance against the CCQ operator, and the capture on
the embedded models: the decomposition reproduces each layer's kernel output."""

from __future__ import annotations

import math

import pytest
import torch

from ccq_eval.inspection.measure import CCQSettings, measure_layer, sample_positions
from ccq_eval.inspection.prompts import NeedlePrompt
from ccq_eval.inspection.reads import (
    ReadRecorder,
    ccq_query_from_sigma,
    decayed_moments,
    gdn_read_weights,
    gla_read_weights,
    key_covariance,
    read_from_weights,
    token_shares,
)
from ccq_eval.model.ccq import ccq_read_reference, unit_keys

H, T, K, V = 2, 23, 5, 3


def _batch_first(x):
    """[H, T, ...] -> [1, T, H, ...] (fla's layout)."""
    return x.transpose(0, 1).unsqueeze(0)


def _gla_brute_force(q, k, v, log_alpha, scale):
    """S_t = diag(alpha_t) S_{t-1} + k_t v_t^T, o_t = scale q_t^T S_t; heads first [H, T, .]."""
    S = torch.zeros(q.shape[0], q.shape[-1], v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        S = log_alpha[:, t].exp().unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        out.append(scale * (q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(out, 1)


def _gdn_brute_force(q, k, v, log_g, beta, scale):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale q_t^T S_t."""
    S = torch.zeros(q.shape[0], q.shape[-1], v.shape[-1], dtype=q.dtype)
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        kk = k[:, t].unsqueeze(-1) * k[:, t].unsqueeze(-2)
        A = log_g[:, t].exp()[:, None, None] * (eye - beta[:, t, None, None] * kk)
        S = A @ S + beta[:, t, None, None] * k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        out.append(scale * (q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(out, 1)


def _random_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, T, K, generator=g, dtype=torch.float64)
    k = torch.randn(H, T, K, generator=g, dtype=torch.float64)
    v = torch.randn(H, T, V, generator=g, dtype=torch.float64)
    log_alpha = -torch.rand(H, T, K, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(H, T, generator=g, dtype=torch.float64)
    return q, k, v, log_alpha, beta


def test_gla_weights_reproduce_the_recurrence_and_fla_cpu_chunk():
    from ccq_eval.model.fla_cpu.linear_attention import torch_chunk_gla

    q, k, v, log_alpha, _ = _random_inputs()
    scale = K ** -0.5
    brute = _gla_brute_force(q, k, v, log_alpha, scale)
    # the op the model runs on CPU agrees with the recurrence (so c below is the model's read)
    q_, k_, v_, g_ = (_batch_first(x) for x in (q, k, v, log_alpha))
    chunk, _ = torch_chunk_gla(q=q_, k=k_, v=v_, g=g_, scale=scale)
    torch.testing.assert_close(chunk[0].transpose(0, 1), brute, rtol=1e-10, atol=1e-10)
    for t in (0, 7, T - 1):
        c = gla_read_weights(q[:, t], k, log_alpha, t, scale)
        assert c.shape == (H, t + 1)
        torch.testing.assert_close(read_from_weights(c, v), brute[:, t], rtol=1e-12, atol=1e-12)


def test_gdn_weights_reproduce_the_recurrence_and_fla_reference():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, log_alpha, beta = _random_inputs(1)
    k = unit_keys(k)
    log_g = log_alpha.mean(-1)
    scale = K ** -0.5
    brute = _gdn_brute_force(q, k, v, log_g, beta, scale)
    # fla's own reference fixes the convention (decay, then the delta update); it computes in fp32
    fla_o, _ = naive_recurrent_gated_delta_rule(*(_batch_first(x) for x in (q, k, v, beta, log_g)), scale)
    torch.testing.assert_close(fla_o[0].transpose(0, 1).double(), brute, rtol=1e-5, atol=1e-5)
    for t in (0, 7, T - 1):
        c = gdn_read_weights(q[:, t], k, log_g, beta, t, scale)
        torch.testing.assert_close(read_from_weights(c, v), brute[:, t], rtol=1e-12, atol=1e-12)
    # two queries at once (CCQ on and off) give each query's weights
    both = gdn_read_weights(torch.stack([q[:, -1], 2 * q[:, -1]]), k, log_g, beta, T - 1, scale)
    torch.testing.assert_close(both[1], 2 * both[0])


def _hand_built(a=3.0, b=1.0):
    """Five tokens; token 2 (the needle) has key e1, the others e2; q = a e1 + b e2; ||v_needle|| = 2, else 1."""
    e1, e2 = torch.eye(2, dtype=torch.float64)
    k = torch.stack([e2, e2, e1, e2, e2]).unsqueeze(0)  # [1, 5, 2]
    v = torch.tensor([[1.0, 0], [0, 1], [0, 2], [1, 0], [0, 1]], dtype=torch.float64).unsqueeze(0)
    q = (a * e1 + b * e2).unsqueeze(0)
    needle = torch.tensor([False, False, True, False, False])
    return q, k, v, needle


def test_hand_built_needle_share_gla():
    q, k, v, needle = _hand_built()
    # no decay: c = q . k_i, |c| ||v||: needle 3 * 2 = 6, four others 1 each -> 6 / 10
    c = gla_read_weights(q, k, torch.zeros(1, 5, 2, dtype=torch.float64), 4, 1.0)
    assert token_shares(c, v)[0, needle].sum().item() == pytest.approx(0.6, abs=1e-12)
    # channel e1 decays by 1/2 per step: the needle's weight is 3 / 4 two steps later -> 1.5 / 5.5
    log_alpha = torch.zeros(1, 5, 2, dtype=torch.float64)
    log_alpha[..., 0] = math.log(0.5)
    c = gla_read_weights(q, k, log_alpha, 4, 1.0)
    assert token_shares(c, v)[0, needle].sum().item() == pytest.approx(1.5 / 5.5, abs=1e-12)


def test_hand_built_needle_share_gated_deltanet():
    q, k, v, needle = _hand_built()
    beta = torch.ones(1, 5, dtype=torch.float64)
    # beta = 1: each write of e2 replaces the previous e2 value, so only the last e2 token (weight 1)
    # and the needle (orthogonal, untouched, weight 3) are read: 6 / (6 + 1)
    c = gdn_read_weights(q, k, torch.zeros(1, 5, dtype=torch.float64), beta, 4, 1.0)
    torch.testing.assert_close(c[0], torch.tensor([0, 0, 3, 0, 1], dtype=torch.float64))
    assert token_shares(c, v)[0, needle].sum().item() == pytest.approx(6 / 7, abs=1e-12)
    # decay 1/2 per step: the needle is read with 3 / 4 -> 1.5 / 2.5
    c = gdn_read_weights(q, k, torch.full((1, 5), math.log(0.5), dtype=torch.float64), beta, 4, 1.0)
    assert token_shares(c, v)[0, needle].sum().item() == pytest.approx(0.6, abs=1e-12)


@pytest.mark.parametrize(("order", "centered", "form"), [(1, True, "series"), (2, False, "series"),
                                                       (3, True, "resolvent")])
def test_covariance_gives_the_ccq_operators_query(order, centered, form):
    q, k, _, log_alpha, _ = _random_inputs(2)
    kappa, log_gamma = unit_keys(k), log_alpha.mean(-1)
    lam = torch.rand(H, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 4
    expected, _ = ccq_read_reference(*(_batch_first(x) for x in (q, kappa, log_gamma, lam)), order, centered,
                                     form=form)
    expected = expected[0].transpose(0, 1)
    positions = [0, 4, 5, 17, T - 1]
    n, m, second = decayed_moments(kappa, log_gamma, positions)
    sigma = key_covariance(n, m, second, centered)
    got = ccq_query_from_sigma(sigma, q[:, positions], lam[:, positions], order, form)
    torch.testing.assert_close(got, expected[:, positions], rtol=1e-12, atol=1e-12)
    eigenvalues = torch.linalg.eigvalsh(sigma)
    assert eigenvalues.min() > -1e-12 and eigenvalues.sum(-1).max() <= 1 + 1e-12  # 0 <= Sigma, tr <= 1


@pytest.fixture(scope="module", params=["tiny-gla-ccq", "tiny-gdn-ccq", "tiny-gla", "tiny-gdn"])
def embedded(request):
    from ccq_eval.model.loading import load_model

    model, _ = load_model(request.param, device="cpu", dtype="float32")
    return request.param, model


@pytest.mark.parametrize("length", [40, 150])  # fla's layers: recurrent kernels up to 64 tokens, chunked above
def test_capture_reproduces_each_layers_read_on_the_embedded_models(embedded, length):
    """One forward with the recorder: for every layer and head the decomposition reproduces the kernel's
    own output at the answer position, CCQ models' q~ is the one rebuilt from Sigma, and the read kernels
    are restored afterwards (fla's own names are never touched)."""
    import fla.layers.gla as fla_gla

    from ccq_eval.model.modeling_ccq import READ_KERNELS

    _, model = embedded
    before, kernels_before = fla_gla.chunk_gla, dict(READ_KERNELS)
    ids = torch.randint(3, 259, (1, length), generator=torch.Generator().manual_seed(0))
    needle = (length // 3, length // 3 + 12)
    prompt = NeedlePrompt("synthetic", length, 50.0, 0, ids[0].tolist(), needle=needle,
                          value=(needle[0] + 4, needle[1]))
    recorder = ReadRecorder(model)
    with torch.no_grad(), recorder.capture():
        model(input_ids=ids, use_cache=False)
    assert fla_gla.chunk_gla is before and kernels_before == READ_KERNELS
    assert "ccq_query" not in vars(recorder.layers[0])
    reads = recorder.ordered()
    assert len(reads) == model.config.num_hidden_layers
    settings = CCQSettings(model.config)
    for read in reads:
        rows, spectra, samples = measure_layer(read, prompt, settings, sample_positions(length, 8, prompt))
        for row in rows:
            assert row["read_residual"] < 1e-5
            assert 0 <= row["needle_share_off"] <= 1 and 0 <= row["needle_share_on"] <= 1
            if model.config.ccq:
                assert row["lambda_source"] == "gate" and row["ccq_residual"] < 1e-5
            else:
                assert row["lambda_source"] == "constant" and row["lambda_answer"] == pytest.approx(2.0)
        assert len(spectra) == len(rows) * read.k.shape[-1]
        assert {s["position"] for s in samples} >= {needle[0], needle[1] - 1, length - 1}


def test_transformer_is_refused_in_one_line():
    from ccq_eval.inspection import InspectError
    from ccq_eval.inspection.run import check_models

    with pytest.raises(InspectError, match=r"a llama model.*GLA / Gated DeltaNet"):
        check_models(["tiny-transformer"])
