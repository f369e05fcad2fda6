"""The core: what every other package shares, and what imports nothing of the service outside
itself. The shapes of data, one module per role: `domain` (events, outcomes, and what a data
call answers or refuses), `record` (the step record's fields, written once), `tables` (the
schema as SQLAlchemy tables, every invariant a named constraint), `limits` (the sizes and
patterns the API accepts), `serialize` (JSON in and out), `cursors` (the opaque keyset
cursors of every list), `problems` (the one error shape, RFC 9457). With them the plumbing
below the data layer: `config` (settings), `db` (the connection pool and the migrations'
engine), `shares` (each token's and tenant's share of that pool), `tracing` (the spans a
connection's use is timed by), `static` (files the service serves itself) and `shown` (client
text made safe to show). May import: nothing of `app` outside `app.core`."""
