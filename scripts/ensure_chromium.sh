#!/usr/bin/env bash
# Make sure Debian's headless-capable chromium is installed (the browser tests of the HTML reports need it).
# Installs it with apt when missing; needs root (CI runs as root). Prints the browser's path on success.
set -euo pipefail
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  echo "$CHROMIUM"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "chromium is missing and this is not root: run as root: apt-get update && apt-get install -y chromium" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null
if [ ! -x "$CHROMIUM" ]; then
  echo "apt-get installed chromium but $CHROMIUM is not there" >&2
  exit 1
fi
echo "$CHROMIUM"
