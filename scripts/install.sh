#!/usr/bin/env bash
# The system programs specstream's media, speech and browser paths (and its tests) run, from Debian/Ubuntu apt:
#   ffmpeg (ffmpeg + ffprobe)  video clips and audio conversion
#   espeak-ng                  synthetic speech for the speech tests and `bench subtitles`
#   chromium                   the /subtitles page test (driven by playwright; no browser download)
# Idempotent: installs only what is missing; `apt-get update` runs once, before the one `apt-get install`.
# As root it calls apt-get directly, otherwise through sudo. SPECSTREAM_INSTALL_DRY_RUN=1 prints the apt
# commands instead of running them. Python packages are not touched (the README's pip commands follow this).
set -euo pipefail

# program on PATH -> Debian package that ships it
declare -A PACKAGE_OF=([ffmpeg]=ffmpeg [ffprobe]=ffmpeg [espeak-ng]=espeak-ng [chromium]=chromium)

missing=()
for prog in ffmpeg ffprobe espeak-ng chromium; do
  if ! command -v "$prog" >/dev/null 2>&1; then
    pkg=${PACKAGE_OF[$prog]}
    [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install.sh: ffmpeg, ffprobe, espeak-ng and chromium are installed"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install.sh: missing ${missing[*]}; this script knows apt-get (Debian/Ubuntu) only: install them with" \
       "your system's package manager" >&2
  exit 1
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install.sh: missing ${missing[*]}; not root and no sudo: run as root" \
         "'apt-get update && apt-get install -y ${missing[*]}'" >&2
    exit 1
  fi
  as_root=(sudo)
fi

run() {
  if [ "${SPECSTREAM_INSTALL_DRY_RUN:-0}" = 1 ]; then
    echo "+ $*"
  else
    "$@"
  fi
}

echo "install.sh: installing ${missing[*]}"
run "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
run "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
[ "${SPECSTREAM_INSTALL_DRY_RUN:-0}" = 1 ] && exit 0
for prog in ffmpeg ffprobe espeak-ng chromium; do
  command -v "$prog" >/dev/null 2>&1 || { echo "install.sh: $prog still missing after apt-get install" >&2; exit 1; }
done
echo "install.sh: done"
