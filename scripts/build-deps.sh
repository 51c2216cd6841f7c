#!/usr/bin/env bash
# Installs the system packages the build needs: cmake and a curl header for librdkafka's
# source build; Debian's RocksDB with clang for its bindings (linked, not compiled: the C++
# build takes half an hour). Idempotent and quiet when nothing is missing.
set -euo pipefail

need=()
for p in cmake g++ make pkg-config libcurl4-openssl-dev libssl-dev librocksdb-dev libclang-dev clang; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "build-deps: installing ${need[*]}" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "build-deps: cargo not found; install a Rust toolchain (https://rustup.rs) first" >&2
  exit 1
fi
