"""What a quant type costs: make one (quantize: recipe -> kquant / kquant_numba encoders), measure it
(perplexity: llama-perplexity's PPL and KL), and compare several side by side (report: `quality`)."""
