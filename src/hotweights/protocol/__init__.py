"""The protocol: what both ends of the wire agree on (the shared-memory manifest, the HTTP
helper, the access tokens). The bridge, `RemoteGroup` and the plugin's routes all speak it,
so none imports another to reach a server. Imports `errors` only."""
