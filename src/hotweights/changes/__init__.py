"""Changes: which bytes of which live tensors changed since a version (block fingerprints,
the kernel's write watch). Used by `checkpoint` and `remote`. Imports `errors` only."""
