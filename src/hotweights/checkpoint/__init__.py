"""Checkpoint sync: write only what changed to safetensors shards, never a torn file.

May import `changes` and `errors`; never `remote`, `bridge`, `server` or `vllm_plugin`.
This file stays light (no torch): the CLI reads `MODES` from it for `--help`.
"""

MODES = ("auto", "reflink", "journal", "copy")  # how changed shards are written (sync.py)
