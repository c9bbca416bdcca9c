"""The model side: the CCQ operator (`ccq`), the CCQ-GLA / CCQ-Gated-DeltaNet classes
(`modeling_ccq`), checkpoint loading (`loading`) and the registry of named models (`registry`);
Triton kernels in `kernels`, the torch backend for fla's ops in `fla_cpu`, CUDA-graph replay in
`cuda_graphs`. Importing this package loads nothing else (the registry needs no torch);
`import ccq_eval.model.auto` registers the CCQ model types with transformers' Auto classes.
"""
