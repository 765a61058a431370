//! Data-plane frames: the streaming decoder the TCP transport reads with, fed arbitrary bytes in
//! arbitrary pieces (handed over, or read into its own buffers as production does, with a small
//! staging buffer so that payloads are read straight into theirs), with or without the
//! connection's peer to check senders against, or with whole frames taken in place as a
//! shared-memory reader takes them; the fixed header decoder; and the
//! control-message codec on every decoded frame. Never a panic; a decoded frame re-encodes to
//! the bytes it came from; a decoded control message re-encodes to a frame that decodes to it
//! again; nothing larger than the limit is ever accepted; no frame from another sender passes
//! the source check.
#![no_main]

use cohort_core::Rank;
use cohort_core::protocol::{
    FrameDecoder, FrameHeader, FrameLimits, FreshBuffers, HEADER_LEN, decode_control, encode_control,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, u32, u16, &[u8])| {
    let (piece, limit, mode, bytes) = input;
    let limits = FrameLimits::new(u64::from(limit % (1 << 20)));
    if let Some(head) = bytes.first_chunk::<HEADER_LEN>()
        && let Ok(h) = FrameHeader::decode(head, &limits)
    {
        assert!(h.payload_len <= limits.max_payload);
        assert_eq!(&h.encode(), head, "a decoded header re-encodes to its bytes");
    }
    let staging = HEADER_LEN + usize::from(mode >> 4) % 512;
    let mut dec = FrameDecoder::with_buffers(limits, staging, FreshBuffers);
    let source = (mode & 1 == 1).then(|| Rank(u32::from(mode >> 1) % 4));
    if let Some(peer) = source {
        dec = dec.expect_source(peer);
    }
    let read_into = mode & 2 == 2;
    let in_place = read_into && mode & 4 == 4;
    let piece = usize::from(piece % 97) + 1;
    let check = |dec: &mut FrameDecoder| -> bool {
        while let Some(frame) = dec.poll_frame() {
            match frame {
                Ok(f) => {
                    assert_eq!(f.payload.len() as u64, f.header.payload_len);
                    assert!(f.payload.len() as u64 <= limits.max_payload);
                    if let Some(peer) = source {
                        assert_eq!(f.header.source, peer, "the source check let another sender through");
                    }
                    let _ = f.text();
                    let world = f.header.step % 4096 + 1;
                    if let Ok(Some(msg)) = decode_control(f.header.kind, f.header.seq, &f.payload, world) {
                        let again = encode_control(&msg);
                        assert_eq!(decode_control(again.kind, again.seq, &again.payload, world), Ok(Some(msg)));
                    }
                }
                Err(_) => return false, // a clear error ends the stream
            }
        }
        true
    };
    for mut chunk in bytes.chunks(piece) {
        if read_into {
            while !chunk.is_empty() {
                if !check(&mut dec) {
                    return;
                }
                // As a shared-memory reader does: a whole frame waiting at a frame boundary is
                // taken in place, under the same checks.
                if in_place {
                    match dec.peek_frame(chunk) {
                        Some(Ok((h, len))) => {
                            assert_eq!(h.payload_len, len as u64);
                            assert!(h.payload_len <= limits.max_payload);
                            assert!(HEADER_LEN + len <= chunk.len(), "a peeked frame lies within the bytes");
                            if let Some(peer) = source {
                                assert_eq!(h.source, peer, "the source check let another sender through");
                            }
                            chunk = &chunk[HEADER_LEN + len..];
                            continue;
                        }
                        Some(Err(_)) => {
                            assert_eq!(dec.poll_frame(), None, "a peeked failure is reported once");
                            return;
                        }
                        None => {}
                    }
                }
                let buf = dec.read_buf();
                assert!(!buf.is_empty(), "read_buf is never empty after a drain");
                let n = buf.len().min(chunk.len());
                buf[..n].copy_from_slice(&chunk[..n]);
                dec.advance(n);
                chunk = &chunk[n..];
            }
        } else {
            dec.handle_bytes(chunk);
        }
        if !check(&mut dec) {
            return;
        }
    }
    dec.handle_eof();
    while dec.poll_frame().is_some() {}
});
