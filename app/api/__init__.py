"""The HTTP API under `/v1`: handlers that parse, call a data module, and shape the answer.
`routes/` holds one module per group of routes (`ROUTES`, in the OpenAPI document's order),
`bodies` what each write accepts (and the label filter of the lists), `spec` the shapes the
OpenAPI document gives each answer (handlers render JSON directly), `docs` Swagger UI and
ReDoc. Problems (`app.core.problems`) are the one error shape. May import: `app.core`,
`app.data`, `app.access`, `app.ops` and `app.live`; never `app.dashboard` or `app.gate`."""
