"""The limits of what the API accepts: name and URL patterns, sizes. The HTTP layer checks them
first, for a precise 422; the tables' named constraints (`app.core.tables`) refuse the same
values."""

import re

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$"
NAME_RE = re.compile(NAME_PATTERN)
# An instance key: a name that may also hold `+` and `~`, the two characters Airflow's default
# run-id pattern (`[scheduler] allowed_run_id_pattern`, `^[A-Za-z0-9_.~:+-]+$`) allows beyond
# the name alphabet, so `etl:scheduled__2026-12-06T00:00:00+00:00` is a key as it stands.
KEY_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:+~-]{0,199}$"
KEY_RE = re.compile(KEY_PATTERN)
# The start of instance keys, as a filter (`prefix=`): 1 to 200 characters of the key alphabet.
KEY_PREFIX_PATTERN = "^[A-Za-z0-9._:+~-]{1,200}$"
KEY_PREFIX_RE = re.compile(KEY_PREFIX_PATTERN)
# A token's key prefix: the start of a key, 1 to 100 characters.
PREFIX_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$"
PREFIX_RE = re.compile(PREFIX_PATTERN)
# ... which ends with a separator, so that `acme:` never reaches `acmeevil:1`.
PREFIX_DELIMITED_PATTERN = "[.:-]$"
PREFIX_DELIMITED_RE = re.compile(PREFIX_DELIMITED_PATTERN)
URL_PATTERN = "^[A-Za-z][A-Za-z0-9+.-]*://"
MAX_OUTPUT_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES = 65536
MAX_URL_CHARS = 2048
MAX_INT4 = 2147483647
# Instance labels: at most `MAX_LABELS` an instance, each key 1 to 63 characters of
# `[A-Za-z0-9._/-]` (no `=`, so `label=KEY=VALUE` splits at the first `=`), each value a
# string of at most `MAX_LABEL_VALUE_CHARS` characters.
LABEL_KEY_PATTERN = "^[A-Za-z0-9._/-]{1,63}$"
LABEL_KEY_RE = re.compile(LABEL_KEY_PATTERN)
MAX_LABEL_VALUE_CHARS = 200
MAX_LABELS = 32
