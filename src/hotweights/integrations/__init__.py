"""Integrations with RL frameworks (optional extras: `trl`). May import
`bridge`, `remote`, `checkpoint`, `changes`, `layout`, `protocol`, `errors`, and
`vllm_plugin` for colocate mode (vLLM in the trainer's process); never `server`."""
