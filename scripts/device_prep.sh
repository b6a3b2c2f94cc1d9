#!/usr/bin/env bash
# Prepares what a GPU machine without network needs for the benchmarks (run here, once a session):
#   .whl/  wheels of the app's dependencies its image lacks (Python 3.12, x86-64)
#   .tok/  the default model's tokenizer and chat template (benchmarks/random_hf_model.py --tokenizer .tok)
# Both are git-ignored through .git/info/exclude; name them in the device call's carry and start its
# command with `source scripts/device_env.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.tok/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
# the versions installed here, so the device runs what the tests ran
pins=$(python - <<'PY'
from importlib.metadata import version
names = ["annotated-types", "click-default-group", "fastapi", "gguf", "itsdangerous", "opentelemetry-api",
         "pydantic", "pydantic_core", "python-multipart", "sqlite-fts4", "sqlite-utils", "starlette",
         "typing-inspection", "uvicorn", "xgrammar", "apache-tvm-ffi", "uvloop", "httptools"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
# the tokenizer of the embedded default model, from its converted directory
mkdir -p .tok
dir=$(python -c "
from chatengine.engine import loader
gguf = loader.default_gguf_path()
print(loader._convert_gguf(gguf, loader._gguf_digest(gguf)))")
cp "$dir"/tokenizer.json "$dir"/tokenizer_config.json "$dir"/chat_template.jinja .tok/
du -sh .whl .tok
