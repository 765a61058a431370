//! The TCPStore server side: arbitrary bytes from a client through the streaming request
//! decoder into the store state, as the server does. Never a panic; a decoded request
//! re-encodes to the bytes it came from; the state answers or closes, nothing else.
#![no_main]

use cohort_core::store::{ClientId, DecodeLimits, RequestDecoder, StoreState, decode_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, &[u8])| {
    let (piece, bytes) = input;
    let limits =
        DecodeLimits { max_key_len: 1 << 12, max_value_len: 1 << 16, max_key_count: 64, max_message_len: 1 << 20 };
    if let Ok(Some((req, used))) = decode_request(bytes, &limits) {
        assert_eq!(req.to_bytes(), &bytes[..used], "a decoded request re-encodes to its bytes");
    }
    let mut dec = RequestDecoder::new(limits);
    let mut state = StoreState::new();
    let client = ClientId(1);
    state.handle_connect(client);
    for chunk in bytes.chunks(usize::from(piece) + 1) {
        dec.extend(chunk);
        loop {
            match dec.decode() {
                Ok(Some(req)) => state.handle_request(client, req),
                Ok(None) => break,
                Err(_) => {
                    state.handle_disconnect(client);
                    return;
                }
            }
            while state.poll_output().is_some() {}
        }
    }
    state.handle_disconnect(client);
    while state.poll_output().is_some() {}
});
