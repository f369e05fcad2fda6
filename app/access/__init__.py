"""Access: who a request is and what it may reach. `tokens` keeps each worker's cache of the
token table, the scopes, and how a request was let in (`Admission`, which a handler asks for
its writer); `tenancy` confines a token with a key prefix to its instances; `sessions` signs
and reads the dashboard's session cookie. The check in front of the routes that uses them,
and the dashboard's sign-in it answers with, are `app.gate` and `app.dashboard.pages` (both
sit above the pages they guard); each client's share of the pool is `app.core.shares` (the
pool itself accounts for it). May import: `app.core` and `app.data`."""
