"""The Triton kernels launch on their inputs' GPU, not on the current one (ccq_eval/model/kernels/triton_device.py)."""

import pytest
import torch

from ccq_eval.model.kernels import triton_device
from ccq_eval.model.kernels.triton_device import launches_on_input_device


class _TensorOnCuda1(torch.Tensor):
    """A CPU tensor that reports itself on cuda:1, for checking which device the guard picks."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_guard_makes_the_first_tensors_device_current(monkeypatch):
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(triton_device.torch.cuda, "device", Recorder)
    seen = []
    add = launches_on_input_device(lambda scale, x, y=None: seen.append(entered[:]) or scale * x)
    fake = torch.Tensor._make_subclass(_TensorOnCuda1, torch.ones(2))
    result = add(2.0, fake, y=torch.zeros(1))
    assert seen == [[torch.device("cuda", 1)]]  # entered before the call, with the first tensor's device
    assert entered == [torch.device("cuda", 1), "exit"]
    assert torch.equal(result.as_subclass(torch.Tensor), torch.full((2,), 2.0))


def test_guard_leaves_cpu_calls_alone(monkeypatch):
    def refuse(device):
        raise AssertionError("no device switch for CPU tensors")

    monkeypatch.setattr(triton_device.torch.cuda, "device", refuse)
    assert launches_on_input_device(lambda x: x + 1)(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]
    assert launches_on_input_device(lambda n: n + 1)(2) == 3  # no tensor at all


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_on_the_second_gpu_match_the_first():
    """With cuda:0 current, the fused CCQ forward, the decoding step and the log-softmax on cuda:1
    give what they give on cuda:0 (before the guard they were launched on cuda:0)."""
    from ccq_eval.model.kernels.ccq_decode import ccq_order1_decode
    from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward
    from ccq_eval.model.kernels.token_logprob import token_logprob_triton

    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 300, 2, 128
    r, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g) + 3)
    gate = (0.3 * torch.randn(H, K, generator=g), torch.randn(H, generator=g), 4.0)
    logits, targets = torch.randn(7, 1000, generator=g), torch.randint(0, 1000, (7,), generator=g)
    results = []
    torch.cuda.set_device(0)
    for device in ("cuda:0", "cuda:1"):
        on = lambda x: x.to(device)  # noqa: E731, B023 (called within this iteration)
        gate_on = (on(gate[0]), on(gate[1]), gate[2])
        q, state = ccq_order1_forward(on(r), on(k), on(log_gamma), None, True, output_final_state=True,
                                      raw_keys=True, gate=gate_on)
        step = ccq_order1_decode(on(r[:, :1]), on(k[:, :1]), on(log_gamma[:, :1]), gate_on, state)
        logprob, greedy = token_logprob_triton(on(logits), on(targets))
        results.append([x.cpu() for x in (q, *state, step[0], *step[1], logprob, greedy)])
    assert torch.cuda.current_device() == 0
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_adapter_makes_the_models_gpu_current():
    """CUDA graphs capture on the current device's streams: the adapter makes the model's GPU current."""
    from adapter_support import byte_tokenizer, tiny_model

    from ccq_eval.harness.adapter import CCQEvalLM

    tokenizer = byte_tokenizer()
    torch.cuda.set_device(0)
    CCQEvalLM(model=tiny_model(tokenizer, dtype=torch.float32).to("cuda:1"), tokenizer=tokenizer, max_length=256)
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)
