"""Triton kernels, each checked against a torch reference: the fused CCQ read (`ccq_forward`,
`ccq_backward`, `ccq_decode`, reference in `ccq_eval.model.ccq`), the paired q/k L2 norm
(`l2norm_pair`), per-token log-probabilities (`token_logprob`); `triton_device` launches on the
inputs' GPU and `autotune` copies shipped autotune winners into triton's cache.
"""
