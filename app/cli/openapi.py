"""`steprecord openapi`: print the OpenAPI document."""

import json

from ..main import create_app


def openapi_json() -> str:
    document = create_app().openapi()
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)
