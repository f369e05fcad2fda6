"""Operations: what runs the service beside its routes. `server` (uvicorn's protocol with
deadlines against slow clients), `embedded` (the embedded PostgreSQL), `observe` (request ids,
logs, Prometheus metrics), `readiness` (`/readyz`'s shared check), `sweeper` (expired leases),
`pruning` (retention), `replica` (reads from a streaming replica), `nodes` (on Citus, each
instance's node) and `distribution` (distributing the schema on Citus at migrate). The
command that drives them, `steprecord`, is `app.cli`, above everything. May import:
`app.core` and `app.data`."""
