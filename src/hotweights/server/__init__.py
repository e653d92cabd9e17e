"""The server side: what `hotweights serve` runs around vLLM (the launcher, the update
transaction's state machine, the environment it hands the plugin). Never imported by the
trainer side (`bridge`, `checkpoint`, `remote`, `changes`, `layout`, `protocol`)."""
