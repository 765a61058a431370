//! The connection handshake and its reply: total decoding, checks that never panic.
#![no_main]

use cohort_core::protocol::{
    HANDSHAKE_LEN, Handshake, HandshakeExpectation, HandshakeReply, REPLY_PREFIX_LEN, ReplyPrefix,
};
use cohort_core::{GroupId, Rank};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Some(hs) = bytes.first_chunk::<HANDSHAKE_LEN>()
        && let Ok(h) = Handshake::decode(hs)
    {
        assert_eq!(&h.encode(), hs);
        let expect = HandshakeExpectation::new(GroupId(0), Rank(0), 4).with_peer(Rank(1));
        if let Err(e) = h.check(&expect) {
            let reply = HandshakeReply::reject(&e);
            assert_eq!(HandshakeReply::decode(&reply.encode()).ok(), Some(reply));
        }
    }
    let _ = HandshakeReply::decode(bytes);
    if let Some(prefix) = bytes.first_chunk::<REPLY_PREFIX_LEN>()
        && let Ok(p) = ReplyPrefix::decode(prefix)
    {
        let rest = &bytes[REPLY_PREFIX_LEN..];
        let n = p.message_len().min(rest.len());
        let _ = p.finish(&rest[..n]);
    }
});
