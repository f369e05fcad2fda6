"""The dashboard at `/ui`: read-only pages rendered on the server, and its sign-in. `pages`
holds the pages' routes, `formatting` what they show in words (times, durations, step names,
outputs), `rendering` the templates' environment and the render of a page, `signin` the
sign-in form and session cookie, `timeline` the instance page's time scale, `templates/` the
Jinja2 templates and `assets/` the stylesheet and the small live-update script. It reads
through the data modules as the API does, and checks a list's label filter with the API's own
check (`app.api.bodies.label_filter`), so both refuse the same text the same way. May import:
`app.core`, `app.data`, `app.access`, `app.ops`, and of `app.api` only `app.api.bodies`; the
API never imports the dashboard."""
