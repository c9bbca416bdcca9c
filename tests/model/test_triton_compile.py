"""Every Triton kernel of the project compiles for an H100/H200 (sm_90) with the installed triton,
on a machine without a GPU: triton's bundled ptxas builds the cubin. Catches what the interpreter
cannot (types, layouts, shared memory, the compiler itself) before device time is spent."""

import os

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

from ccq_eval.model.kernels import ccq_backward, ccq_chunk_states, ccq_decode, ccq_forward, l2norm_pair, token_logprob

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS) or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="triton's nvidia backend (ptxas) is not installed")

BF16, F32 = "*bf16", "*fp32"
SM90_SHARED_BYTES = 232448  # per block, opt-in: the limit triton's launcher reported on the H200
CHUNK = dict(H=4, K=128, C=64)  # GLA-340M's heads


def _signature(kernel, types):
    """Types for the pointer / scalar arguments (the rest constexpr), in the kernel's argument order."""
    return {name: types.get(name, "constexpr") for name in kernel.arg_names}


def _compile(kernel, types, constants, candidate=0):
    jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
    config = kernel.configs[candidate] if isinstance(kernel, Autotuner) else None
    constants = {**(config.kwargs if config else {}), **constants}  # an entry may pick another candidate
    options = {"num_warps": config.num_warps if config else 4, "num_stages": config.num_stages if config else 2}
    # Pointers 16-byte aligned, as the launcher specialises them for torch's allocations: without the
    # hint triton cannot vectorise loads, and the register counts (ptxas -v) are not the GPU's.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(jit.arg_names)
               if types.get(name, "").startswith("*")}
    source = ASTSource(fn=jit, signature=_signature(jit, types), constexprs=constants, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], f"{jit.__name__}: no cubin"
    assert compiled.metadata.shared <= SM90_SHARED_BYTES, (
        f"{jit.__name__} {config}: {compiled.metadata.shared} bytes of shared memory, over the H100/H200's "
        f"{SM90_SHARED_BYTES} (the launch would fail with OutOfResources)")


READ_TYPES = dict(r=BF16, kappa=BF16, key_inv_norm=F32, log_gamma=F32, lam=F32, gate_weight=F32, gate_bias=F32,
                  lam_max="fp32", P_in=BF16, m_in=F32, n_in=F32, q_out=BF16, T="i32", NT="i32")
KERNELS = {
    **{f"chunk_states_{'states' if states else 'totals'}": (
        ccq_chunk_states.ccq_chunk_states_kernel,
        dict(kappa=BF16, key_inv_norm=F32, log_gamma=F32, seg_P=F32, seg_m=F32, seg_n=F32, seg_decay=F32,
             P_in=BF16, m_in=F32, n_in=F32, T="i32", NT="i32", NSEG="i32", SEG="i32"),
        dict(H=6, K=256, C=64, BR=ccq_chunk_states.STATE_ROWS, NORMALIZE=True, IEEE=False, STATES=states))
       for states in (False, True)},  # Gated DeltaNet-340M's heads: the widest state rows
    "state_scan": (ccq_chunk_states._ccq_state_scan_kernel,
                   dict(P_in=BF16, m_in=F32, n_in=F32, chunk_decay=F32, P0=F32, m0=F32, n0=F32, P_final=F32,
                        m_final=F32, n_final=F32, NT="i32"),
                   dict(K=128, BLOCK=ccq_chunk_states.SCAN_BLOCK, KB=128, STEPS=ccq_chunk_states.SCAN_STEPS,
                        HAS_INITIAL=True, STORE_FINAL=True)),
    "read": (ccq_forward._ccq_read_kernel, READ_TYPES,
             dict(**CHUNK, CENTERED=True, NORMALIZE=True, GATE=True, IEEE=False)),
    "read_k256": (ccq_forward._ccq_read_kernel, READ_TYPES,  # Gated DeltaNet-340M's heads
                  dict(H=6, K=256, C=64, CENTERED=True, NORMALIZE=True, GATE=True, IEEE=False)),
    "bwd_query": (ccq_backward._ccq_bwd_query_kernel,
                  dict(r=BF16, kappa=BF16, log_gamma=F32, lam=F32, gate_weight=F32, gate_bias=F32, lam_max="fp32",
                       P_in=BF16, m_in=F32, n_in=F32, dq=BF16, dr=BF16, dPu_out=BF16, dm_out=BF16, dn_out=F32,
                       dlam_out=F32, dweight_out=F32, T="i32", NT="i32"),
                  dict(**CHUNK, CENTERED=True, NORMALIZE=True, GATE=True, IEEE=False)),
    "bwd_local": (ccq_backward._ccq_bwd_local_kernel,
                  dict(r=BF16, dPu=BF16, dm=BF16, dn=F32, log_gamma=F32, Q=BF16, g_acc=F32, h_acc=F32,
                       chunk_decay_rev=F32, T="i32", NT="i32"),
                  dict(**CHUNK, CENTERED=True, IEEE=False)),
    "bwd_key": (ccq_backward._ccq_bwd_key_kernel,
                dict(r=BF16, kappa=BF16, log_gamma=F32, dPu=BF16, dm=BF16, dn=F32, Q=BF16, g_acc=F32, h_acc=F32,
                     dkappa=F32, dk=BF16, dc=F32, T="i32", NT="i32"),
                dict(**CHUNK, CENTERED=True, NORMALIZE=True, IEEE=False)),
    "inverse_norms": (ccq_forward._inverse_norms_kernel, dict(x=BF16, inv_norm=F32, N="i32"),
                      dict(K=256, ROWS=ccq_forward.NORM_TILE // 256)),
    "decode": (ccq_decode._ccq_decode_kernel,
               dict(r=BF16, k=BF16, log_gamma=F32, gate_weight=F32, gate_bias=F32, lam_max="fp32", P=F32, m=F32,
                    n=F32, P_out=F32, m_out=F32, n_out=F32, q_out=BF16),
               dict(H=4, K=128, BK=ccq_decode.DECODE_ROWS, CENTERED=True, QUERY_GATE=True)),
    "token_logprob": (token_logprob._token_logprob_kernel,
                      dict(logits=BF16, targets="*i64", logprob_out=F32, greedy_out="*i1", V="i32", stride_row="i32"),
                      dict(BLOCK=4096)),
    "l2norm_pair_fwd": (l2norm_pair._l2norm_pair_fwd_kernel,
                        dict(q=BF16, k=BF16, y=BF16, rstd=F32, **{f"{x}_s{d}": "i32" for x in "qk" for d in "bth"},
                             T="i32", H="i32", N="i32", eps="fp32"),
                        dict(K=256, BD=256, BLOCK_ROWS=l2norm_pair.TILE // 256)),
    "l2norm_pair_bwd": (l2norm_pair._l2norm_pair_bwd_kernel,
                        dict(y=BF16, rstd=F32, dy=BF16, dx=BF16, M="i32"),
                        dict(K=48, BD=64, BLOCK_ROWS=l2norm_pair.TILE // 64)),
}


# Every autotune candidate: the GPU's autotuner compiles them all, and one that does not compile (too
# much shared memory, say) fails the first call of its shape.
CANDIDATES = [(name, i) for name, (kernel, _, _) in sorted(KERNELS.items())
              for i in range(len(kernel.configs) if isinstance(kernel, Autotuner) else 1)]


@pytest.mark.parametrize("name,candidate", CANDIDATES, ids=[f"{n}-{i}" for n, i in CANDIDATES])
def test_kernel_compiles_for_sm90(name, candidate):
    kernel, types, constants = KERNELS[name]
    _compile(kernel, types, constants, candidate)
