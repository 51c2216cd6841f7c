# syntax=docker/dockerfile:1
#
# inlet container image. Needs BuildKit (the default builder of current Docker):
#   docker build -t inlet:latest .
#   docker run --rm -v "$PWD/connectors:/etc/inlet:ro" inlet:latest \
#     validate --config /etc/inlet/mysql-debezium-orders.yaml

FROM rust:1-bookworm AS builder
# librdkafka is compiled from source (cmake; its build includes a curl header) and links
# OpenSSL. RocksDB is Debian's, linked through ROCKSDB_LIB_DIR (.cargo/config.toml); clang
# generates its bindings.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        cmake libcurl4-openssl-dev libssl-dev pkg-config librocksdb-dev libclang-dev clang \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and target directories are cache mounts, so rebuilds recompile only what changed;
# the binary is copied out of the target cache in the same step, before the mount goes away.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin inlet \
    && cp target/release/inlet /usr/local/bin/inlet

FROM debian:bookworm-slim
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 librocksdb7.8 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 inlet \
    && useradd --system --uid 10001 --gid inlet --home-dir /var/lib/inlet --no-create-home \
        --shell /usr/sbin/nologin inlet \
    && mkdir -p /var/lib/inlet /etc/inlet \
    && chown inlet:inlet /var/lib/inlet
COPY --from=builder /usr/local/bin/inlet /usr/local/bin/inlet
# Relative paths in a config (the default SQLite catalog and warehouse) land here: mount a
# volume at this path to keep them.
WORKDIR /var/lib/inlet
USER 10001
# Prometheus metrics and /health.
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/inlet"]
CMD ["--help"]
