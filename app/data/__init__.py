"""The data layer: all SQL the service sends outside the database functions, one module per
concern. None imports the web framework; each takes a connection and returns domain types
(`app.core.domain`) or plain rows.

- `judge`: events and heartbeats, through the judge's functions (`app/sql/`);
- `reads`: the API's reads (records, pages, instances, attempts, records across instances);
- `dashboard`: the dashboard's own reads;
- `stream`: what a live stream reads, and its LISTEN session;
- `tokens`: API tokens and the access policy;
- `leases`: the lease sweeper's statement;
- `revision`: the schema revision the database is at, the migration lock;
- `replication`: WAL positions of a primary and a standby (the read replica's lag).
"""
