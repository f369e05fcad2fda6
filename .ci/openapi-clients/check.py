"""CI gate: client generators accept the OpenAPI document and lose none of its operations.

- openapi-python-client generates a client without a single warning, with a module for every
  operation of the document, and every generated module imports;
- openapi-typescript generates types, and a typed call of every operation (written here from
  the document, so an operation added later is checked without touching this directory)
  passes `tsc --strict`.

Run from anywhere, after `npm ci` in this directory:

    .venv-test/bin/python .ci/openapi-clients/check.py [openapi/openapi.json]
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GENERATED = HERE / "generated"
NODE_BIN = HERE / "node_modules" / ".bin"
PYTHON_BIN = Path(sys.executable).parent
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# How a generated module of openapi-python-client names its request.
REQUEST = re.compile(r'"method":\s*"(\w+)",\s*"url":\s*"([^"]+)"')

Operation = tuple[str, str, dict[str, Any]]


def operations(document: dict[str, Any]) -> list[Operation]:
    return [
        (method, path, operation)
        for path, item in sorted(document["paths"].items())
        for method, operation in item.items()
        if method in METHODS
    ]


def run(command: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        **kwargs,
    )


def check_python_client(path: Path, ops: list[Operation]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "steprecord_api"
        # Its post-generation hooks run ruff, which lives beside this interpreter.
        env = {**os.environ, "PATH": f"{PYTHON_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        generate = run(
            [
                PYTHON_BIN / "openapi-python-client",
                "generate",
                "--path",
                path,
                "--meta",
                "none",
                "--output-path",
                package,
                "--fail-on-warning",
            ],
            env=env,
        )
        problems = []
        if generate.returncode != 0 or "warning" in generate.stdout.lower():
            problems.append(f"openapi-python-client warned or failed:\n{generate.stdout}")
        generated = {
            (method, url)
            for module in (package / "api").rglob("*.py")
            for method, url in REQUEST.findall(module.read_text())
        }
        problems += [
            f"openapi-python-client generated no call of {method.upper()} {path}"
            for method, path, _ in ops
            if (method, path) not in generated
        ]
        if not generated:
            return problems
        imports = run(
            [
                sys.executable,
                "-c",
                "import importlib, pkgutil, steprecord_api as p\n"
                "for m in pkgutil.walk_packages(p.__path__, 'steprecord_api.'):\n"
                "    importlib.import_module(m.name)",
            ],
            cwd=tmp,
        )
        if imports.returncode != 0:
            problems.append(f"the generated Python client does not import:\n{imports.stdout}")
        return problems


def resolved(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = document
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        schema = node
    return schema


def example(document: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> Any:
    """A value of the schema's type, with every property of an object."""
    schema = resolved(document, schema)
    if depth > 10:
        raise ValueError("the schema is recursive beyond what an example can show")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            branches = [b for b in schema[key] if resolved(document, b).get("type") != "null"]
            return example(document, (branches or schema[key])[0], depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        return {
            name: example(document, prop, depth + 1)
            for name, prop in schema.get("properties", {}).items()
        }
    if kind == "array":
        return [example(document, schema.get("items", {}), depth + 1)]
    if kind == "string":
        return "2026-12-02T10:00:00Z" if schema.get("format") == "date-time" else "x"
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return {"any": ["JSON", 1, None]}


def json_schemas(content: dict[str, Any]) -> list[dict[str, Any]]:
    return [media["schema"] for kind, media in content.items() if kind.endswith("json")]


def common_required(document: dict[str, Any], responses: list[dict[str, Any]]) -> list[str]:
    """The properties every one of these responses is sure to have."""
    required: set[str] | None = None
    for response in responses:
        for schema in json_schemas(resolved(document, response).get("content", {})):
            names = set(resolved(document, schema).get("required", []))
            required = names if required is None else required & names
    return sorted(required or ())


def typed_call(document: dict[str, Any], method: str, path: str, op: dict[str, Any]) -> str:
    init: dict[str, Any] = {}
    for parameter in op.get("parameters", []):
        parameter = resolved(document, parameter)
        where = init.setdefault("params", {}).setdefault(parameter["in"], {})
        where[parameter["name"]] = example(document, parameter.get("schema", {}))
    body = resolved(document, op.get("requestBody", {})).get("content", {})
    if bodies := json_schemas(body):
        init["body"] = example(document, bodies[0])
    responses = op.get("responses", {})
    ok = [r for status, r in responses.items() if status.startswith("2")]
    failed = [r for status, r in responses.items() if status[0] in "45"]
    touched = {
        "data": common_required(document, ok),
        "error": ["code"] if "code" in common_required(document, failed) else [],
    }
    used = [name for name, names in touched.items() if names]
    arguments = json.dumps(path)
    if init:
        arguments += ", " + json.dumps(init, indent=2).replace("\n", "\n    ")
    call = f"await client.{method.upper()}({arguments});"
    lines = [
        f"  // {method.upper()} {path}",
        "  {",
        f"    const {{ {', '.join(used)} }} = {call}" if used else f"    {call}",
    ]
    for name in used:
        lines.append(f"    if ({name} !== undefined) {{")
        lines += [f"      void {name}[{json.dumps(n)}];" for n in touched[name]]
        lines.append("    }")
    lines.append("  }")
    return "\n".join(lines)


def check_typescript(path: Path, document: dict[str, Any], ops: list[Operation]) -> list[str]:
    GENERATED.mkdir(exist_ok=True)
    types = run([NODE_BIN / "openapi-typescript", path, "--output", GENERATED / "schema.d.ts"])
    if types.returncode != 0 or "warn" in types.stdout.lower():
        return [f"openapi-typescript warned or refused the document:\n{types.stdout}"]
    calls = "\n\n".join(typed_call(document, *op) for op in ops)
    (GENERATED / "calls.ts").write_text(
        "// Written by check.py from the OpenAPI document: a typed call of every operation.\n"
        'import createClient from "openapi-fetch";\n'
        'import type { paths } from "./schema";\n\n'
        'const client = createClient<paths>({ baseUrl: "http://127.0.0.1:8000" });\n\n'
        f"export async function callEveryOperation(): Promise<void> {{\n{calls}\n}}\n"
    )
    compiled = run([NODE_BIN / "tsc", "--project", HERE / "tsconfig.json"])
    if compiled.returncode != 0:
        return [f"tsc --strict refused {GENERATED / 'calls.ts'}:\n{compiled.stdout}"]
    return []


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else ROOT / "openapi" / "openapi.json").resolve()
    document = json.loads(path.read_text())
    ops = operations(document)
    problems = check_python_client(path, ops) + check_typescript(path, document, ops)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"{len(ops)} operations: the Python client has them all, and each TypeScript call")
        print("type-checks under tsc --strict")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
