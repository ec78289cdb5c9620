//! Arbitrary bytes as a script of received datagrams: de-obfuscation, the packet parser and the
//! FEC receiver (with loss reports applied to a sender). See
//! `tokenway_wire::fec::receive_path` for the input format.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tokenway_wire::fec::receive_path::run(data);
});
