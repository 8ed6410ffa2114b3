#!/usr/bin/env bash
# Install the Debian/Ubuntu packages named on the command line that are not installed yet:
# with apt-get as root, otherwise print the command to run. Used by the Makefile.
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system packages: ${missing[*]} (names as on Debian/Ubuntu; install your distribution's equivalents)"
  command -v dpkg-query >/dev/null 2>&1 && exit 1 || exit 0  # no dpkg: cannot tell, go on
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing system packages: run 'sudo apt-get install ${missing[*]}', then make again"
  exit 1
fi
echo "installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
