"""The bridge: the trainer's side of a local server. Connect, map the served weights, build
the Hugging Face model of views, run the update transaction. Speaks to the server through
`protocol`; may import `protocol`, `layout`, `changes`, `checkpoint`, `remote` (lazily),
`errors`; never `server` or `vllm_plugin`."""
