"""Layout: from a Hugging Face config and the live vLLM parameter names and shapes, the map
of every vLLM tensor to its HF pieces, and the HF model of views built on it. Pure: imports
`errors` only, never vLLM."""
