"""Testing aids shipped with the package: tiny random models with a tokenizer trained on the
spot (the demo, the tests, the benchmarks; nothing downloaded). Outside the product's core:
imports nothing of hotweights."""
