"""What a quant type costs: make one (quantize: recipe -> kquant_numba / legacy_numba encoders, with
kquant and gguf's quants as their references), measure it (perplexity: llama-perplexity's PPL and KL),
compare several side by side (report: `quality`), and keep that report for `plan` (store)."""
