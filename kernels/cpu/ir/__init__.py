"""The lower tier of the CPU kernels: Numba intrinsics that emit LLVM IR, summing in ggml's x86 order.

builder (types and helpers every intrinsic uses), legacy and kquants (one-row dot products), tiles
(prompt products over several tokens), rows8 and packed (eight rows at once for decode), dense (f16 /
bf16 rows), attention (decode attention's pieces), unpack (K-quant codes one per byte), vecmath (exp
and SiLU). The @njit kernel modules one level up (legacy, kquants, dense, iquants, ops, fused, moe)
call these; nothing here imports them.
"""
