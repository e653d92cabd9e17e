"""The environment `hotweights serve` hands to the vLLM it starts: what the plugin reads.

The server side sets these names; `vllm_plugin` reads them (it imports this module, never
the other way round).
"""

ACTIVE = "HOTWEIGHTS_ACTIVE"  # "1" in the environment of a vLLM hotweights started
SERVER_ID = "HOTWEIGHTS_SERVER_ID"  # set by `hotweights serve` (not `local.start_engine`)
REMOTE = "HOTWEIGHTS_REMOTE"  # "1": `serve --remote`, updates come over the transfer engine
CHECKPOINT_STATS = "HOTWEIGHTS_CHECKPOINT_STATS"  # remote: the shards' stats before the load
REMOTE_ENGINE = "hotweights"  # the weight-transfer engine `register` adds to vLLM's registry
