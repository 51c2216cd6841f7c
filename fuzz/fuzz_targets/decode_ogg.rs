#![no_main]
//! GoldenGate JSON: decoding any message and typing its changes never panics.

use inlet::config::FormatKind;
use inlet::decode::fuzzing::{exercise, json_decoder};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    exercise(json_decoder(FormatKind::OggJson).as_ref(), data)
});
