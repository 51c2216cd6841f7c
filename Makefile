# The two commands a new user needs: `make demo` and `make test`.
# Build output lives outside the clone so repeated runs (and CI on the same machine) reuse it.
CARGO_TARGET_DIR ?= $(HOME)/.cache/inlet-target
INLET_CACHE ?= $(HOME)/.cache/inlet
export CARGO_TARGET_DIR INLET_CACHE

.PHONY: demo test deps lint schema

deps:
	@scripts/build-deps.sh

## Runs the real pipeline on embedded defaults: embedded Kafka, SQLite catalog, ./inlet-demo.
demo: deps
	cargo run --locked -- demo

## Runs every test: unit, golden, CLI, and end to end against a real broker with pyiceberg.
test: deps
	@scripts/test-env.sh >/dev/null
	. "$(INLET_CACHE)/env.sh" && cargo test --locked

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings

## Regenerates the config's JSON Schema after changing the configuration types (src/config/, crates/decode/src/config.rs).
schema:
	cargo run --locked -q -- config-schema > schemas/config.schema.json
