//! Data-plane frames: the streaming decoder fed arbitrary bytes in arbitrary pieces, the
//! fixed header decoder, and the control-message codec on every decoded frame. Never a panic;
//! a decoded frame re-encodes to the bytes it came from; a decoded control message re-encodes
//! to a frame that decodes to it again; nothing larger than the limit is ever announced as
//! accepted.
#![no_main]

use cohort_core::protocol::{FrameDecoder, FrameHeader, FrameLimits, HEADER_LEN, decode_control, encode_control};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, u32, &[u8])| {
    let (piece, limit, bytes) = input;
    let limits = FrameLimits::new(u64::from(limit % (1 << 20)));
    if let Some(head) = bytes.first_chunk::<HEADER_LEN>()
        && let Ok(h) = FrameHeader::decode(head, &limits)
    {
        assert!(h.payload_len <= limits.max_payload);
        assert_eq!(&h.encode(), head, "a decoded header re-encodes to its bytes");
    }
    let mut dec = FrameDecoder::new(limits);
    let piece = usize::from(piece % 97) + 1;
    for chunk in bytes.chunks(piece) {
        dec.handle_bytes(chunk);
        while let Some(frame) = dec.poll_frame() {
            match frame {
                Ok(f) => {
                    assert!(f.payload.len() as u64 <= limits.max_payload);
                    let _ = f.text();
                    let world = f.header.step % 4096 + 1;
                    if let Ok(Some(msg)) = decode_control(f.header.kind, f.header.seq, &f.payload, world) {
                        let again = encode_control(&msg);
                        assert_eq!(decode_control(again.kind, again.seq, &again.payload, world), Ok(Some(msg)));
                    }
                }
                Err(_) => return, // a clear error ends the stream
            }
        }
    }
    dec.handle_eof();
    while dec.poll_frame().is_some() {}
});
