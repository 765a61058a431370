//! The connection handshake and its reply: total decoding, checks that never panic; and the
//! authentication after it: a peer's handshake and proof, any bytes, are checked without a
//! panic, and accepted only when the proof is the one the secret gives.
#![no_main]

use cohort_core::protocol::{
    AuthSecret, HANDSHAKE_LEN, Handshake, HandshakeExpectation, HandshakeReply, PROOF_LEN, REPLY_PREFIX_LEN,
    ReplyPrefix, Role, proof, verify,
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
        let _ = h.check(&expect.with_auth());
        // What follows the handshake is the peer's proof: checked as the dialled side would.
        let secret = AuthSecret::new(b"fuzz secret".as_slice()).expect("a secret");
        let mine = expect.handshake(0).encode();
        let theirs = &bytes[HANDSHAKE_LEN..];
        let sent = &theirs[..theirs.len().min(PROOF_LEN)];
        let right = proof(&secret, Role::Acceptor, &mine, hs);
        assert_eq!(verify(&secret, Role::Acceptor, &mine, hs, sent), sent == right);
        assert!(verify(&secret, Role::Acceptor, &mine, hs, &right));
        assert!(!verify(&secret, Role::Dialer, &mine, hs, &right), "a proof is not valid for the other role");
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
