//! The TCPStore client side: arbitrary bytes as the reply to each kind of request.
#![no_main]

use cohort_core::store::{DecodeLimits, ReplyDecoder, ReplyKind, decode_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u8, u8, &[u8])| {
    let (which, n, bytes) = input;
    let kind = match which % 8 {
        0 => ReplyKind::Bytes,
        1 => ReplyKind::Check,
        2 => ReplyKind::Int,
        3 => ReplyKind::Keys,
        4 => ReplyKind::MultiBytes(usize::from(n % 16)),
        5 => ReplyKind::Nonce,
        6 => ReplyKind::QueuePop,
        _ => ReplyKind::Wait,
    };
    let limits =
        DecodeLimits { max_key_len: 1 << 12, max_value_len: 1 << 16, max_key_count: 64, max_message_len: 1 << 20 };
    if let Ok(Some((reply, used))) = decode_reply(bytes, kind, &limits) {
        assert_eq!(reply.to_bytes(), &bytes[..used], "a decoded reply re-encodes to its bytes");
    }
    let mut dec = ReplyDecoder::new(limits);
    for chunk in bytes.chunks(usize::from(n % 13) + 1) {
        dec.extend(chunk);
        match dec.decode(kind) {
            Ok(Some(_)) | Ok(None) => {}
            Err(_) => return,
        }
    }
});
