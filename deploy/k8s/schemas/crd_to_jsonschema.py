"""Turn a CustomResourceDefinition's ``openAPIV3Schema`` into a standalone JSON Schema file.

    python deploy/k8s/schemas/crd_to_jsonschema.py CRD.yaml VERSION SOURCE > OUT.json

The API server prunes fields a CRD does not declare; a file check cannot prune, so, as
kubernetes-validate's ``--strict`` does for built-in kinds, every object that lists its
``properties`` gets ``additionalProperties: false`` unless the CRD keeps unknown fields there
(``x-kubernetes-preserve-unknown-fields``) or types its extra keys (``additionalProperties``).
``apiVersion`` and ``kind`` are pinned to the CRD's. What JSON Schema cannot say is left out and
listed in ``$comment``: CEL rules (``x-kubernetes-validations``) and list-type hints.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def _strict(node: Any) -> Any:
    """A copy of ``node`` with closed objects; the ``x-kubernetes-*`` keys dropped."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items() if not key.startswith("x-kubernetes-")}
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_version_schema(crd: dict, version: str, source: str) -> dict:
    """The JSON Schema of ``version`` of ``crd``; ``source`` says where the CRD came from."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    served = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if not served:
        raise SystemExit(f"{crd['metadata']['name']} has no version {version!r}")
    schema = _strict(served[0]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (f"{kind} {group}/{version} from {source}, converted by "
                     "deploy/k8s/schemas/crd_to_jsonschema.py (objects closed as with --strict; CEL "
                     "x-kubernetes-validations not expressible here, checked by tests/deploy instead)."),
        **schema,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, version, source = argv
    with open(path) as f:
        crd = yaml.safe_load(f)
    json.dump(crd_version_schema(crd, version, source), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
