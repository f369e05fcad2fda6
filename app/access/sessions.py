"""The dashboard's sessions: a signed, expiring cookie that names a token without holding it.

The cookie is `<token id>.<expiry, Unix seconds>.<HMAC-SHA256>`, the HMAC keyed with the
server's session secret over the id, the expiry and the token's SHA-256 digest. A stolen
cookie therefore never reveals the token (nor can it be used as one against the API), it
stops working at its expiry, and it stops working as soon as its token is revoked (the id
then names no active token, and a token created later never has the same id and digest).
Forging one needs the secret.
"""

import base64
import hashlib
import hmac
import re

# The session's cookie: over https `__Host-` prefixed (the browser keeps it only when it is
# Secure, for this host alone, on path `/`: no other host of the domain, and no page over
# http, can set or shadow it); over plain http, where a cookie cannot be Secure and so
# cannot have the prefix, the plain name. A request over https reads only the prefixed one.
COOKIE = "steprecord_ui_token"
SECURE_COOKIE = "__Host-" + COOKIE


def cookie_name(secure: bool) -> str:
    return SECURE_COOKIE if secure else COOKIE


SESSION_RE = re.compile(r"(\d{1,19})\.(\d{1,12})\.([A-Za-z0-9_-]{43})", re.ASCII)


def _mac(secret: bytes, token_id: int, token_digest: bytes, expires: int) -> str:
    signed = f"{token_id}.{expires}.".encode() + token_digest
    mac = hmac.new(secret, signed, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def sign(secret: bytes, token_id: int, token_digest: bytes, expires: int) -> str:
    """The cookie value of a session of the token `token_id` until `expires`."""
    return f"{token_id}.{expires}.{_mac(secret, token_id, token_digest, expires)}"


def token_id_of(value: str, now: float) -> int | None:
    """The token a session cookie names, when it is well-formed and not expired (its
    signature is checked by `verify`, which needs the token's digest)."""
    found = SESSION_RE.fullmatch(value)
    if found is None or int(found[2]) <= now:
        return None
    return int(found[1])


def verify(secret: bytes, value: str, token_digest: bytes) -> bool:
    """Whether `value` was signed with `secret` for the token of `token_digest`."""
    found = SESSION_RE.fullmatch(value)
    if found is None:
        return False
    expected = _mac(secret, int(found[1]), token_digest, int(found[2]))
    return hmac.compare_digest(expected, found[3])
