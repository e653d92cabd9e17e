"""Remote servers: weight updates sent over torch.distributed to machines that hold a copy
(the trainer's `RemoteGroup`, the channel and the delta format both ends use). May import
`checkpoint`, `changes`, `layout` (TP shards), `protocol` and `errors`; never `bridge`,
`server` or `vllm_plugin`."""
