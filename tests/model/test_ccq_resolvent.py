"""The resolvent read q~ = (I + lambda Sigma)^-1 r (ccq_form = "resolvent"): the CUDA path's algorithm
matches the reference, it solves the system it names, it never expands the query, and the models built
with it decode exactly. Its three forms' agreement is test_ccq_operator's, parametrized over the form."""

import json

import pytest
import torch
from test_ccq_operator import _inputs, _random_state
from test_models_ccq import CCQ, KINDS, _ccq_model, _fla_model, _save, _tokens

from ccq_eval.model.ccq import (
    CCQGate,
    CCQState,
    _ccq_chunk_kernel,
    ccq_read_chunk,
    ccq_read_keys,
    ccq_read_recurrent,
    ccq_read_reference,
    unit_keys,
)
from ccq_eval.model.loading import load_model

RESOLVENT = {"form": "resolvent"}


def _explicit_sigmas(kappa, log_gamma, centered=True, state=None):
    """Sigma_t for every (b, t, h) from its definition (docs/operator.md), position by position: [B, T, H, K, K]."""
    B, T, H, K = kappa.shape
    sigmas = torch.empty(B, T, H, K, K, dtype=torch.float64)
    gamma = log_gamma.exp()
    for b in range(B):
        for h in range(H):
            P = torch.zeros(K, K, dtype=torch.float64) if state is None else state.P[b, h].clone()
            m = torch.zeros(K, dtype=torch.float64) if state is None else state.m[b, h].clone()
            n = torch.zeros((), dtype=torch.float64) if state is None else state.n[b, h].clone()
            for t in range(T):
                key = kappa[b, t, h]
                P = gamma[b, t, h] * P + torch.outer(key, key)
                m = gamma[b, t, h] * m + key
                n = gamma[b, t, h] * n + 1
                mu = m / n
                sigmas[b, t, h] = P / n - (torch.outer(mu, mu) if centered else 0)
    return sigmas


def _solve_exactly(r, lam, sigmas):
    K = r.shape[-1]
    system = torch.eye(K, dtype=torch.float64) + lam[..., None, None] * sigmas
    return torch.linalg.solve(system, r.unsqueeze(-1)).squeeze(-1)


def _crowded(kappa, rank=2, seed=5):
    """Keys crowded into a rank-`rank` bulk: Sigma gets a large top eigenvalue (the hard case)."""
    K = kappa.shape[-1]
    spread = torch.randn(K, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    basis = torch.linalg.qr(spread)[0]
    return unit_keys(kappa @ basis @ basis.T + 0.01 * kappa)


@pytest.mark.parametrize("with_state", [False, True])
def test_kernel_path_matches_reference_values_and_gradients_fp64(with_state):
    """The CUDA path's algorithm (one linear-attention pass per CG step) through the CPU backend: the same
    q~, state and gradients (through the per-position step scalars) as the O(T^2) reference."""
    r, kappa, log_gamma, lam = _inputs(T=150)
    state = _random_state(2, 3, 8) if with_state else None
    weights = torch.randn(r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def run(read):
        leaves = [x.clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
        q, final = read(*leaves)
        return q, final, torch.autograd.grad((q * weights).sum(), leaves)

    q_ref, s_ref, grads_ref = run(lambda *x: ccq_read_reference(*x, 3, True, state, **RESOLVENT))
    start = state if with_state else CCQState(*(torch.zeros_like(s) for s in _random_state(2, 3, 8)))
    q_k, s_k, grads_k = run(lambda *x: _ccq_chunk_kernel(*x, 3, True, start, 64, from_zero=not with_state,
                                                         form="resolvent"))
    torch.testing.assert_close(q_k, q_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(s_k, s_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads_k, grads_ref):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_solves_the_system_against_linalg_solve(centered, with_state):
    """With as many CG steps as the head dim, q~ is (I + lambda Sigma_t)^-1 r_t for the explicit Sigma_t, to
    rounding, at every position; lambda up to 64, where the series is useless."""
    r, kappa, log_gamma, lam = _inputs(B=1, T=40, H=2, K=6, lam_max=64.0, seed=4)
    state = _random_state(1, 2, 6) if with_state else None
    sigmas = _explicit_sigmas(kappa, log_gamma, centered, state)
    expected = _solve_exactly(r, lam, sigmas)
    q, _ = ccq_read_chunk(r, kappa, log_gamma, lam, 6, centered, state, chunk_size=16, **RESOLVENT)
    torch.testing.assert_close(q, expected, rtol=1e-9, atol=1e-9)
    system = torch.eye(6, dtype=torch.float64) + lam[..., None, None] * sigmas
    residual = r - (system @ q.unsqueeze(-1)).squeeze(-1)
    assert (residual.norm(dim=-1) <= 1e-9 * r.norm(dim=-1)).all()


def test_error_falls_within_the_conjugate_gradient_bound():
    """Fewer steps than the head dim: the error in the (I + lambda Sigma)-norm is at most
    2 ((sqrt(c) - 1) / (sqrt(c) + 1))^S of the solution's, c = 1 + lambda (0 <= Sigma <= I), and
    shrinks with every step."""
    r, kappa, log_gamma, _ = _inputs(B=1, T=60, H=2, K=16, seed=6)
    kappa = _crowded(kappa, rank=3)
    lam = torch.full(log_gamma.shape, 16.0, dtype=torch.float64)
    sigmas = _explicit_sigmas(kappa, log_gamma)
    system = torch.eye(16, dtype=torch.float64) + lam[..., None, None] * sigmas
    exact = _solve_exactly(r, lam, sigmas)

    def energy(x):
        return (x.unsqueeze(-2) @ system @ x.unsqueeze(-1)).squeeze(-1).squeeze(-1).sqrt()

    c = 17.0
    rate = (c**0.5 - 1) / (c**0.5 + 1)
    previous = energy(exact)
    for steps in range(1, 9):
        q, _ = ccq_read_chunk(r, kappa, log_gamma, lam, steps, True, **RESOLVENT)
        error = energy(q - exact)
        slack = 1e-12 * energy(exact)  # rounding: early positions (Sigma of low rank) are solved exactly
        assert (error <= 2 * rate**steps * energy(exact) + slack).all()
        assert (error <= previous + slack).all()
        previous = error
    assert (previous < 1e-2 * energy(exact)).all()


@pytest.mark.parametrize("steps", [1, 2, 4, 16, 40])
@pytest.mark.parametrize("centered", [True, False])
def test_never_expands_the_query(steps, centered):
    """||q~|| <= ||r|| at every position after any number of steps and for any lambda (here up to 64, with
    keys crowded so that lambda s_max >> 2, where the series of order 1 expands)."""
    r, kappa, log_gamma, _ = _inputs(T=300, seed=3)
    kappa = _crowded(kappa)
    for decay_shift, lam_value in [(3.0, 4.0), (3.0, 64.0), (50.0, 64.0)]:  # 50: gamma = 1 ("none")
        log_gamma = torch.nn.functional.logsigmoid(torch.randn_like(log_gamma) + decay_shift)
        lam = torch.full_like(log_gamma, lam_value)
        q, _ = ccq_read_chunk(r, kappa, log_gamma, lam, steps, centered, **RESOLVENT)
        assert (q.norm(dim=-1) <= r.norm(dim=-1) * (1 + 1e-12)).all()
        assert (q.norm(dim=-1) < 0.999 * r.norm(dim=-1)).any()  # it does contract
    series, _ = ccq_read_chunk(r, kappa, log_gamma, lam, 1, centered)
    assert (series.norm(dim=-1) > r.norm(dim=-1)).any()  # what the resolvent avoids


def test_lambda_zero_is_identity_bit_for_bit():
    for dtype in (torch.float32, torch.float64):
        r, kappa, log_gamma, lam = _inputs(dtype=dtype)
        state = _random_state(2, 3, 8, dtype=dtype)
        zero = torch.zeros_like(lam)
        for read in (ccq_read_chunk, ccq_read_recurrent, ccq_read_reference):
            q, _ = read(r, kappa, log_gamma, zero, 5, True, state, form="resolvent")
            assert torch.equal(q, r), read.__name__


def test_zero_query_stays_zero_with_finite_gradients():
    """A position with r = 0 has a zero residual from the start: no 0/0 in the step scalars or their
    gradients."""
    r, kappa, log_gamma, lam = _inputs(T=20)
    r = r.clone()
    r[:, 5] = 0
    leaves = [x.clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
    q, _ = ccq_read_chunk(*leaves, 3, True, **RESOLVENT)
    assert torch.equal(q[:, 5], torch.zeros_like(q[:, 5]))
    grads = torch.autograd.grad(q.square().sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)


def test_split_calls_continue_exactly():
    """Chunked prefill over two calls then decode steps == one call (the state carries everything)."""
    r, kappa, log_gamma, lam = _inputs(T=100)

    def piece(lo, hi, state, read=ccq_read_chunk):
        inputs = (x[:, lo:hi] for x in (r, kappa, log_gamma, lam))
        return read(*inputs, 3, True, state, **RESOLVENT)

    q_full, s_full = piece(0, 100, None)
    q1, s1 = piece(0, 70, None)
    q2, s2 = piece(70, 97, s1)
    q3, s3 = piece(97, 100, s2, ccq_read_recurrent)
    torch.testing.assert_close(torch.cat([q1, q2, q3], 1), q_full, rtol=1e-10, atol=1e-10)
    for a, b in zip(s3, s_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_read_keys_takes_the_resolvent_and_rejects_bad_values():
    """What the layers call forms kappa and lambda, then reads with the resolvent; bad forms and step
    counts are refused with the field's name."""
    r, kappa, log_gamma, _ = _inputs(T=30)
    k = 3.0 * kappa  # raw keys: normalised inside
    gate = CCQGate(torch.randn(3, 8, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 4.0)
    q, _ = ccq_read_keys(r, k, log_gamma, gate, 4, True, form="resolvent")
    expected, _ = ccq_read_reference(r, kappa, log_gamma, gate.values(r).double(), 4, True, form="resolvent")
    torch.testing.assert_close(q, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"ccq_form must be one of .*'neumann'"):
        ccq_read_chunk(r, kappa, log_gamma, log_gamma, 1, True, form="neumann")
    with pytest.raises(ValueError, match="ccq_solve_steps must be >= 1"):
        ccq_read_recurrent(r, kappa, log_gamma, log_gamma, 0, True, form="resolvent")


# ---- models with ccq_form = "resolvent" ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_then_decode_equals_full_forward(kind):
    model = _ccq_model(kind, ccq_form="resolvent", ccq_solve_steps=3)
    x = _tokens(203)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        series = _ccq_model(kind, ccq_order=3)(x, use_cache=False).logits  # same weights, other read
        assert not torch.allclose(full, series, atol=1e-6)
        out = model(x[:, :130], use_cache=True)
        pieces = [out.logits]
        out = model(x[:, 130:197], past_key_values=out.past_key_values, use_cache=True)  # > 64 tokens
        pieces.append(out.logits)
        for t in range(197, 203):  # one-token decode steps: the recurrent form on the cached (P, m, n)
            out = model(x[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_lambda_zero_model_equals_fla_logits(kind, tmp_path):
    """A plain fla checkpoint attached with the resolvent read and lambda = 0 computes fla's logits."""
    fla_model = _fla_model(kind)
    folder = _save(fla_model, tmp_path / kind)
    model, _ = load_model(str(folder), dtype="float64", ccq_lambda=2.0,
                          ccq_fields={"ccq_form": "resolvent", "ccq_solve_steps": 5})
    assert model.config.ccq_form == "resolvent" and model.config.ccq_gate == "constant"
    x = _tokens(150)
    with torch.no_grad():
        expected = fla_model(x).logits
        assert not torch.allclose(model(x).logits, expected, atol=1e-6)  # lambda = 2 acts
        for name, param in model.named_parameters():
            if name.endswith("ccq_gate_bias"):
                param.fill_(float("-inf"))
        assert torch.equal(model(x).logits, expected)  # the same ops on q~ = r exactly


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip_and_old_checkpoints_read_as_series(kind, tmp_path):
    model = _ccq_model(kind, ccq_form="resolvent", ccq_solve_steps=6, ccq_order=2)
    folder = _save(model, tmp_path / "resolvent")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["ccq_form"] == "resolvent" and saved["ccq_solve_steps"] == 6
    loaded, _ = load_model(str(folder), dtype="float64")
    fields = (loaded.config.ccq_form, loaded.config.ccq_solve_steps, loaded.config.ccq_order)
    assert fields == ("resolvent", 6, 2)
    assert all(block.attn.ccq_form == "resolvent" for block in loaded.model.layers)
    x = _tokens(80)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)

    # A CCQ checkpoint from before the field existed: no ccq_form / ccq_solve_steps, the series read.
    series = _ccq_model(kind, ccq_order=2)
    old = _save(series, tmp_path / "old")
    fields = json.loads((old / "config.json").read_text())
    del fields["ccq_form"], fields["ccq_solve_steps"]
    (old / "config.json").write_text(json.dumps(fields))
    loaded, _ = load_model(str(old), dtype="float64")
    assert loaded.config.ccq_form == "series"
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, series(x).logits)


def test_training_step_reaches_the_gate_through_the_solve():
    model = _ccq_model("gla", dtype=torch.float32, ccq_form="resolvent").train()
    x = _tokens(100)
    loss = model(x, labels=x).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "ccq_gate" in n]
    assert torch.isfinite(loss) and grads
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# ---- GPU (not run on CPU-only machines) ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's kernels")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_cuda_resolvent_matches_fp64_cpu_reference(dtype, tol):
    """The CUDA path of the resolvent (never the fused order-1 kernels: one chunk_simple_gla pass per CG
    step, state in fp32) in fp32 and bf16 against the fp64 CPU chunk form, from an initial state, for
    prefill and a decode step: relative L2 error of q~ within `tol`, and the final state within it."""
    r, kappa, log_gamma, lam = _inputs(B=1, T=1000, H=4, K=64)
    state = _random_state(1, 4, 64)
    q_ref, s_ref = ccq_read_chunk(r, kappa, log_gamma, lam, 4, True, state, **RESOLVENT)
    cuda_state = CCQState(*(s.cuda().float() for s in state))
    on_gpu = [x.to("cuda", dtype) for x in (r, kappa)]
    on_gpu += [x.to("cuda", torch.float32) for x in (log_gamma, lam)]
    q_gpu, s_gpu = ccq_read_chunk(*on_gpu, 4, True, cuda_state, **RESOLVENT)
    first = [x[:, :1] for x in (r, kappa, log_gamma, lam)]
    step_ref, _ = ccq_read_recurrent(*first, 4, True, s_ref, **RESOLVENT)
    step_gpu, _ = ccq_read_recurrent(*(x[:, :1] for x in on_gpu), 4, True, s_gpu, **RESOLVENT)
    for got, want in ((q_gpu, q_ref), (step_gpu, step_ref), *zip(s_gpu, s_ref)):
        relative = ((got.double().cpu() - want).norm() / want.norm()).item()
        print(f"{dtype}: relative L2 error GPU vs fp64 CPU = {relative:.2e} (tolerance {tol})")
        assert relative < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's kernels")
def test_cuda_resolvent_of_one_step_never_takes_the_fused_kernels(monkeypatch):
    """One CG step on CUDA with a head dim the fused order-1 kernels support: the resolvent still runs the
    unfused path (the fused kernels compute the series), for prefill, decoding and training."""
    from ccq_eval.model.kernels import ccq_decode, ccq_forward

    def refuse(*args, **kwargs):
        raise AssertionError("the resolvent reached a fused series kernel")

    monkeypatch.setattr(ccq_forward, "ccq_order1_forward", refuse)
    monkeypatch.setattr(ccq_decode, "ccq_order1_decode", refuse)
    r, kappa, log_gamma, _ = _inputs(B=1, T=200, H=2, K=128)
    gate = CCQGate(None, torch.zeros(2, dtype=torch.float64), 4.0)
    expected, _ = ccq_read_keys(r, kappa, log_gamma, gate, 1, form="resolvent")
    on_gpu = [x.to("cuda", torch.float32) for x in (r, kappa, log_gamma)]
    gpu_gate = CCQGate(None, torch.zeros(2, device="cuda", requires_grad=True), 4.0)
    with torch.no_grad():
        q, state = ccq_read_keys(*on_gpu, gpu_gate, 1, form="resolvent")
        first = (x[:, :1] for x in on_gpu)
        step, _ = ccq_read_keys(*first, gpu_gate, 1, initial_state=state, form="resolvent")
    trained, _ = ccq_read_keys(*on_gpu, gpu_gate, 1, form="resolvent")
    trained.sum().backward()
    assert step.shape == (1, 1, 2, 128) and torch.isfinite(gpu_gate.bias.grad).all()
    for got in (q, trained):
        assert ((got.double().cpu() - expected).norm() / expected.norm()).item() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's kernels")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 5e-2)])
def test_gpu_resolvent_model_matches_fp64_cpu(kind, dtype, tol):
    """A CCQ model with ccq_form = "resolvent" on CUDA (what it would run there, fp32 or bf16) against the
    same weights in fp64 on the CPU: relative L2 error of the logits within `tol`."""
    config_cls, model_cls = CCQ[kind]
    torch.manual_seed(0)
    shape = {"hidden_size": 256, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 384}
    if kind == "gated_deltanet":
        shape["head_dim"] = 64
    model = model_cls(config_cls(**shape, ccq_form="resolvent")).eval()
    x = _tokens(2048)
    with torch.no_grad():
        cpu_logits = model.double()(x, use_cache=False).logits
        gpu_logits = model.to("cuda", dtype)(x.cuda(), use_cache=False).logits.double().cpu()
    relative = ((gpu_logits - cpu_logits).norm() / cpu_logits.norm()).item()
    print(f"{kind} {dtype}: relative L2 error GPU vs fp64 CPU = {relative:.2e} (tolerance {tol})")
    assert relative < tol
