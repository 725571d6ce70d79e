"""The colocated server: a role beside prefill and decode that runs both on one engine in
one process, with no room and no KV transfer. It is the baseline ``bench e2e`` compares
disaggregated serving with (:mod:`pdgrpc.colocated.server`)."""
