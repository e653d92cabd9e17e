"""The command line: `hotweights serve / demo / status / sync / diagnose / layout`. Each
subcommand's module is imported only when it runs, so `hotweights --help` loads neither
torch nor vLLM. May import anything."""
