"""The ground floor: every Triton kernel of nanoserve, each file beside its torch reference.

- attention.py: paged decode (split-KV, cascade prefix pass, reduce), extend (varlen, causal,
  over a cached prefix), the KV store; references `attention_reference`, `store_kv_reference`,
  `gather_kv`.
- linear.py: the small-M matmul of decode batches (GEMV, tensor-core tiles, deterministic
  split-K) and the measured rule that picks it over cuBLAS; `linear_reference`.
- norm.py: RMSNorm with the residual add (and the split-K sum, or the embedding gather of a
  decode graph's first kernel); `rms_norm_reference`, `embed_rms_norm_reference`.
- rotary.py: q/k per-head RMSNorm + rotary + KV store in one launch; `rope_reference`.
- activation.py: SiLU-and-mul; `silu_and_mul_reference`.
- all_reduce.py, ll_words.py: the tensor-parallel all-reduce fused with the residual add and
  RMSNorm over symmetric memory, and the LL word format its sends use; `all_reduce_rms_norm_reference`.
- moe.py: the router's softmax top-k and the fused expert MLPs (decode path, grouped GEMMs over
  pairs sorted by expert on the device); `route_reference`, `fused_moe_reference`.
- sampling.py: greedy and temperature sampling in one read of the logits; `sample_reference`.
- launch.py: Triton's interpreter flag and programmatic dependent launch.

Invariant: nothing here imports any other part of nanoserve. Kernels take every choice
(PDL, launch order, ...) as an argument; the callers read those from `KernelSwitches`
(nanoserve/switches.py). Launchers never read device data on the host, so CUDA graphs can
capture them.
"""
