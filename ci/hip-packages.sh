#!/usr/bin/env bash
# Debian's clang-19, lld-19, llvm-19 and libamdhip64-dev, installed when missing (apt-get;
# root, or sudo): the HIP compile check and the gfx942 wavefront model need them.
set -euo pipefail
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
need=()
for p in clang-19 lld-19 llvm-19 libamdhip64-dev; do installed "$p" || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "   installing ${need[*]} (apt-get)"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "need root or sudo to install ${need[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
