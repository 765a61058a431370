//! Authentication by a shared secret, challenge-response: the secret never crosses the wire.
//!
//! A job may set a secret (`COHORT_AUTH_TOKEN`, or a file named by `COHORT_AUTH_TOKEN_FILE`).
//! Then every connection between ranks proves, in both directions, that its other end knows it:
//!
//! 1. Each side sends its [`Handshake`](super::Handshake) with the auth flag and a fresh random
//!    32-byte [`AuthNonce`] where an unauthenticated handshake has zeros.
//! 2. Each side reads the other's handshake, then sends its [`PROOF_LEN`]-byte proof: an
//!    HMAC-SHA256 under the secret of a label naming the sender's [`Role`] (the side that
//!    dialled or the side that accepted) and both handshakes' bytes, the dialler's first.
//! 3. Each side checks the other's proof ([`verify`]), then answers with its
//!    [`HandshakeReply`](super::HandshakeReply) as without a secret: a wrong proof is refused
//!    with [`HandshakeError::AuthMismatch`](super::HandshakeError::AuthMismatch), so both sides
//!    learn it.
//!
//! A proof covers fresh nonces from both sides, so a recorded one is worth nothing on another
//! connection; it names the sender's role and covers both ranks, so a proof one side sends
//! cannot be reflected back to it as the other side's. The store uses the same exchange with
//! its own labels ([`Role::StoreClient`], [`Role::StoreServer`]) over its own messages.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;

/// A shared secret. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthSecret(Vec<u8>);

impl AuthSecret {
    /// A secret of these bytes; `None` if there are none (an empty secret protects nothing).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<AuthSecret> {
        let bytes = bytes.into();
        (!bytes.is_empty()).then_some(AuthSecret(bytes))
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length: `new_from_slice` fails for none.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts keys of every length")
    }
}

impl fmt::Debug for AuthSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthSecret(..)")
    }
}

/// A fresh random challenge, sent in a handshake in place of the zeros of an unauthenticated one.
/// Drivers draw it from the operating system's generator; core never draws randomness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AuthNonce(pub [u8; NONCE_LEN]);

/// Who sends a proof: part of what it covers, so that one side's proof is never valid as the
/// other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The rank that dialled the connection.
    Dialer,
    /// The rank that accepted it.
    Acceptor,
    /// A store client.
    StoreClient,
    /// The store server.
    StoreServer,
}

impl Role {
    /// The role at the other end of the connection.
    pub const fn peer(self) -> Role {
        match self {
            Role::Dialer => Role::Acceptor,
            Role::Acceptor => Role::Dialer,
            Role::StoreClient => Role::StoreServer,
            Role::StoreServer => Role::StoreClient,
        }
    }

    const fn label(self) -> &'static [u8] {
        match self {
            Role::Dialer => b"cohort auth v1: mesh dialer",
            Role::Acceptor => b"cohort auth v1: mesh acceptor",
            Role::StoreClient => b"cohort auth v1: store client",
            Role::StoreServer => b"cohort auth v1: store server",
        }
    }
}

fn mac_of(secret: &AuthSecret, role: Role, first: &[u8], second: &[u8]) -> Hmac<Sha256> {
    let mut mac = secret.mac();
    mac.update(role.label());
    // Lengths first, so that no two different pairs of messages run together the same way.
    mac.update(&(first.len() as u64).to_le_bytes());
    mac.update(first);
    mac.update(&(second.len() as u64).to_le_bytes());
    mac.update(second);
    mac
}

/// The proof that `role` knows `secret`, over the connection's two opening messages: on the
/// mesh, the dialler's handshake bytes first, then the acceptor's; on the store, the client's
/// hello, then the server's.
pub fn proof(secret: &AuthSecret, role: Role, first: &[u8], second: &[u8]) -> [u8; PROOF_LEN] {
    mac_of(secret, role, first, second).finalize().into_bytes().into()
}

/// Whether `proof` (any bytes a peer sent) is `role`'s proof over the two messages under
/// `secret`. Compared in constant time.
pub fn verify(secret: &AuthSecret, role: Role, first: &[u8], second: &[u8], proof: &[u8]) -> bool {
    mac_of(secret, role, first, second).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> AuthSecret {
        AuthSecret::new(s.as_bytes()).unwrap()
    }

    #[test]
    fn a_proof_verifies_under_the_same_secret_role_and_messages_only() {
        let (a, b) = (b"dialler's handshake".as_slice(), b"acceptor's handshake".as_slice());
        let p = proof(&secret("s3cret"), Role::Dialer, a, b);
        assert!(verify(&secret("s3cret"), Role::Dialer, a, b, &p));
        assert!(!verify(&secret("other"), Role::Dialer, a, b, &p), "another secret");
        assert!(!verify(&secret("s3cret"), Role::Acceptor, a, b, &p), "reflected as the other side's");
        assert!(!verify(&secret("s3cret"), Role::Dialer, b, a, &p), "messages swapped");
        assert!(!verify(&secret("s3cret"), Role::Dialer, b"dialler's handshak", b"eacceptor's handshake", &p));
        assert!(!verify(&secret("s3cret"), Role::Dialer, a, b, &p[..31]), "a short proof");
        assert!(!verify(&secret("s3cret"), Role::Dialer, a, b, &[]), "no proof");
    }

    #[test]
    fn an_empty_secret_is_refused_and_a_secret_never_prints() {
        assert_eq!(AuthSecret::new(Vec::new()), None);
        assert_eq!(format!("{:?}", secret("hunter2")), "AuthSecret(..)");
    }

    #[test]
    fn the_proof_is_hmac_sha256_of_the_label_and_the_length_prefixed_messages() {
        // Pins the construction, so that two builds of cohort always agree on it.
        let p = proof(&secret("key"), Role::StoreClient, b"a", b"bc");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"key").unwrap();
        mac.update(b"cohort auth v1: store client");
        mac.update(&[1, 0, 0, 0, 0, 0, 0, 0, b'a', 2, 0, 0, 0, 0, 0, 0, 0, b'b', b'c']);
        assert_eq!(p.as_slice(), mac.finalize().into_bytes().as_slice());
    }
}
