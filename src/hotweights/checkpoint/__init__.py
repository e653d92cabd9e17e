"""Checkpoint sync: write only what changed to safetensors shards, never a torn file."""
