"""Integrations with RL frameworks (optional extras: `hotweights[trl]`). The trainer side:
may import `bridge`, `remote`, `checkpoint`, `changes`, `layout`, `protocol` and `errors`;
never `server` or `vllm_plugin`."""
