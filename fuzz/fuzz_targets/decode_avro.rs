#![no_main]
//! Debezium Avro (Confluent wire format, offline writer schemas of the golden cases): decoding
//! any message and typing its changes never panics or allocates without bound.

use std::sync::OnceLock;

use inlet::decode::fuzzing::{avro_decoder, exercise};
use inlet::decode::Decoder;

static DECODER: OnceLock<Box<dyn Decoder>> = OnceLock::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let decoder = DECODER.get_or_init(|| {
        avro_decoder(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../crates/decode/tests/golden/debezium-avro/schemas"
        ))
    });
    exercise(decoder.as_ref(), data)
});
