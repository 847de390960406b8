#!/usr/bin/env bash
# Checks the layer contracts of pyproject.toml ([tool.importlinter]) with import-linter.
# The stage folders (train/, serve/, …) become lorafleet.train, lorafleet.serve, … through setuptools'
# package-dir, which grimp cannot follow in an editable install; so the package is first copied to a
# temporary folder the way `pip install .` lays it out, and linted there.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
(cd "$REPO" && "$PY" -c "from setuptools import setup; setup()" -q build_py --build-lib "$BUILD/lib" >/dev/null 2>&1)
echo "lint-imports: $(find "$BUILD/lib/lorafleet" -name '*.py' | wc -l) modules of lorafleet copied for analysis"
cd "$BUILD/lib"
"$(dirname "$PY")/lint-imports" --no-cache "$REPO/pyproject.toml"
