"""The server side: what `hotweights serve` runs around vLLM (the launcher, the update
transaction's state machine, the environment it hands the plugin). May import `checkpoint`,
`protocol` and `errors`; never imported by the trainer side (`bridge`, `remote`,
`checkpoint`, `changes`, `layout`, `protocol`)."""
